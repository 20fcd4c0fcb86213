"""Raise a graph's default-domain opset: what int4 for TensorRT (21) and the ``kv_scatter`` layout (24) need.

Between opset 13 and 24 most default-domain ops only gained types (bfloat16 at 22, float8/int4/float4 at 19-24) or
optional attributes and inputs whose defaults keep the old meaning (``Pad`` axes, ``Resize`` antialias, ``Cast``
saturate / round_mode, ``Split`` num_outputs, ``Attention``'s nonpad_kv_seqlen). What did change:

- opset 18: the ``axes`` attribute of the Reduce ops (:data:`AXES_INPUT_AT_18`) became an input: converted here,
  as an int64 initializer (TensorRT wants constant axes);
- the ops in :data:`CHANGED_MEANING`, at the opset given there: refused, not converted (``DFT`` 20: ``axis``
  attribute -> input; ``GridSample`` 20: modes renamed; ``GroupNormalization`` 21: per-channel scale and bias;
  ``AveragePool``/``MaxPool`` 22: with ``ceil_mode=1`` a window starting in the right padding is dropped, so the
  output shape can change).

The list was checked against ``onnx.defs`` (onnx 1.23): every schema with ``since_version`` in 18..24 compared
with its previous version (attributes, inputs, outputs, doc text).
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from trtinfer.errors import ConfigError

#: Reduce ops whose ``axes`` became an input at opset 18 (ReduceSum moved at 13)
AXES_INPUT_AT_18 = frozenset({"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
                              "ReduceMin", "ReduceProd", "ReduceSumSquare"})
#: default-domain ops whose meaning (not only their type list) changed at the given opset, which
#: :func:`upgrade_opset` does not convert (the pools only with ``ceil_mode=1``)
CHANGED_MEANING: dict[str, int] = {"DFT": 20, "GridSample": 20, "GroupNormalization": 21, "AveragePool": 22,
                                   "MaxPool": 22}
#: the oldest opset :func:`upgrade_opset` starts from (ReduceSum's axes input, Split's split input: opset 13)
MIN_SOURCE_OPSET = 13


def _is_default_domain(node: ir.Node) -> bool:
    return node.domain in ("", "ai.onnx")


def _changes_meaning(node: ir.Node, old: int, target: int) -> bool:
    """``node`` means something else at ``target`` than at ``old``."""
    at = CHANGED_MEANING.get(node.op_type)
    if at is None or not _is_default_domain(node) or not old < at <= target:
        return False
    if node.op_type in ("AveragePool", "MaxPool"):
        return node.attributes.get_int("ceil_mode", 0) == 1
    return True


def _axes_initializer(graph: ir.Graph, name: str, axes: np.ndarray) -> ir.Value:
    """``axes`` as an int64 initializer named ``name`` (``name_1``, ... when taken)."""
    base, i = name, 1
    while name in graph.initializers:
        name, i = f"{base}_{i}", i + 1
    value = ir.Value(name=name, shape=ir.Shape([axes.size]), type=ir.TensorType(ir.DataType.INT64),
                     const_value=ir.tensor(axes, name=name))
    graph.register_initializer(value)
    return value


def upgrade_opset(model: ir.Model, target: int) -> dict[str, int]:
    """Raise the default-domain opset to ``target`` (>= 18): Reduce ops' ``axes`` attribute becomes an input
    (opset 18); ops whose meaning changed (:data:`CHANGED_MEANING`) or a graph below opset 13 are refused with a
    ConfigError, before anything is edited. Returns ``{op: nodes converted}`` (empty when already there)."""
    old = model.opset_imports.get("", 0)
    if old >= target:
        return {}
    if old < MIN_SOURCE_OPSET:
        raise ConfigError(f"the graph is at opset {old}; upgrading below {MIN_SOURCE_OPSET} to {target} is not "
                          f"supported here: export at opset >= {MIN_SOURCE_OPSET}")
    nodes = list(ir.traversal.RecursiveGraphIterator(model.graph))
    bad = sorted({n.op_type for n in nodes if _changes_meaning(n, old, target)})
    if bad:
        raise ConfigError(f"cannot raise the graph from opset {old} to {target}: {', '.join(bad)} changed meaning; "
                          "give a graph without them")
    done: dict[str, int] = {}
    for n in nodes:
        if _is_default_domain(n) and n.op_type in AXES_INPUT_AT_18 and old < 18 and "axes" in n.attributes:
            graph = n.graph
            assert graph is not None
            axes = np.asarray(n.attributes["axes"].as_ints(), np.int64)
            value = _axes_initializer(graph, f"{n.name or n.op_type}_axes", axes)
            del n.attributes["axes"]
            n.resize_inputs(2)
            n.replace_input_with(1, value)
            done[n.op_type] = done.get(n.op_type, 0) + 1
    model.opset_imports[""] = target
    return done
