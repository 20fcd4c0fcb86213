"""Export without materializing the model: trace with the weights as graph inputs, then stream each from the checkpoint.

How, and why this way:

1. The model is built from its config under ``accelerate.init_empty_weights`` (buffers such as rotary
   ``inv_freq`` are real, as the config makes them). :func:`weights_as_inputs` takes the parameters out and makes
   each an extra forward argument, put back into its slot for the call; the example values are zero-stride views
   of one float (``torch.zeros(1).expand(shape)``), so no weight is ever allocated. torch 2.13's TorchScript
   exporter traces the full-depth model: the weights come out as graph inputs named after their parameters, and
   everything else is constant-folded as usual.
   Why not keep them as parameters with ``export_params=False``: the exporter still constant-folds and
   shape-infers with every parameter in memory (it materializes the transposed Linear weights and encodes all
   of them into a protobuf: 4.4 GB peak and 60-90 s per trace at the 1B shape). The meta device fails outright
   (the exporter copies tensors out).
   (``torch.func.functional_call`` would do the swap but refuses to run under the tracer.)
2. With the weights as inputs the exporter cannot fold what it would have folded from them: a Linear's
   ``Transpose``, Gemma's ``1 + w``, a ``Cast``. :func:`fold_weight_chains` follows each weight input through
   such ops (every other input a constant) and records the chain as the recipe of a new weight read where the
   chain ended (``model.model.layers.0.mlp.down_proj.weight`` -> its ``Transpose`` output, read by ``MatMul``).
   A tied embedding is one parameter read twice: by ``Gather`` as stored, by the LM head through its Transpose.
3. A weight read as stored or as one 2-D Transpose stays a graph input, named in the graph's ``trtinfer.checkpoint``
   metadata with its checkpoint tensor (:mod:`trtinfer.stage_weights` reads it, widened to float32, when a stage
   needs it); any other recipe runs on that one tensor with onnx's reference evaluator and is written to the
   external-data file (a norm's ``1 + w``: small).

Peak memory is the trace (activations of a 2x7 batch, one weight made contiguous by a matmul at a time): it does
not grow with the model's depth, and the export writes no copy of the weights.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.checkpoint import Checkpoint, to_float32
from trtinfer.errors import ExportError
from trtinfer.stage_weights import ALIGN

log = logging.getLogger(__name__)

WRAPPER_PREFIX = "model."  # DecoderWithPast keeps the HF model as ``self.model``: weight input names carry it
WRAPPED_CHILD = "inner"  # the traced module's name inside the wrapper (dropped from node names after the trace)
#: ops the exporter would have folded on a weight: followed while every other input is a constant
FOLDABLE = frozenset({"Transpose", "Cast", "Add", "Sub", "Mul", "Div", "Identity", "Unsqueeze", "Reshape",
                      "Squeeze", "Neg", "Sqrt"})


@dataclass(frozen=True)
class WeightSource:
    """One weight of the exported graph: the parameter it comes from and the folded ops that make it.

    ``nodes`` are serialized NodeProtos in graph order (none: the parameter as stored; one ``Transpose``: a
    Linear's W.T), ``constants`` the serialized TensorProtos they read.
    """

    graph_name: str
    source: str  # the weight input (``model.`` + parameter name)
    nodes: tuple[bytes, ...]
    constants: tuple[bytes, ...]
    output: str = ""  # the traced value the nodes compute (their last output)

    @property
    def op_types(self) -> list[str]:
        """The folded ops, in order (``["Transpose"]`` for a Linear's W.T)."""
        import onnx

        return [onnx.NodeProto.FromString(b).op_type for b in self.nodes]

    @property
    def transposed_2d(self) -> bool:
        """A single 2-D transpose: written block by block, never materialized."""
        if len(self.nodes) != 1:
            return False
        import onnx

        node = onnx.NodeProto.FromString(self.nodes[0])
        perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
        return node.op_type == "Transpose" and perm in ([[1, 0]], [])


def empty_model(config: Any) -> Any:
    """A causal LM of ``config`` whose parameters live on the meta device (buffers are real)."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        from accelerate import init_empty_weights
    except ImportError as e:
        raise ExportError(f"the export needs accelerate ({e}); install the export stack, which declares it: "
                          "pip install 'trtinfer[export]'") from e

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.tie_weights()  # a tied LM head must be the embedding's parameter object, found by identity below
    return model.eval()


def weights_as_inputs(module: Any) -> tuple[Any, list[str], list[Any]]:
    """``(wrapper, parameter names, zero-stride example values)``: ``wrapper(*args, *weights)`` runs ``module(*args)``
    with those weights. Tied parameters appear once, under their first name.

    The parameters are taken out of ``module`` for good (each slot holds None; read names and shapes before), so
    the tracer sees a module with buffers only; each call puts the given tensors in the slots and clears them after.
    ``module`` stays a registered child, so the graph's node names keep their module scopes
    (``/model/model/layers.0/mlp/down_proj/MatMul``), which ``--keep-fp32`` patterns and the quantizers match.
    """
    import torch

    names, examples, originals = [], [], []
    for name, p in module.named_parameters():
        names.append(name)
        examples.append(torch.zeros(1, dtype=torch.float32).expand(tuple(p.shape)))
        originals.append(p)
    slots = [(m, k, id(v)) for m in module.modules() for k, v in m._parameters.items() if v is not None]
    for m, k, _ in slots:
        m._parameters[k] = None

    class Wrapped(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add_module(WRAPPED_CHILD, module)

        def forward(self, *args: Any) -> Any:
            n = len(args) - len(names)
            by_id = {id(p): w for p, w in zip(originals, args[n:])}
            try:
                for m, k, pid in slots:
                    m._parameters[k] = by_id[pid]  # tied slots held the same parameter: the same input
                return getattr(self, WRAPPED_CHILD)(*args[:n])
            finally:
                for m, k, _ in slots:
                    m._parameters[k] = None

    return Wrapped().eval(), names, examples


def drop_wrapper_scope(proto: Any) -> None:
    """Node and value names without the ``/inner`` scope :func:`weights_as_inputs` adds: the graph names its nodes
    as a trace of the module itself would (``/model/model/layers.0/mlp/down_proj/MatMul``)."""
    prefix = f"/{WRAPPED_CHILD}/"

    def strip(name: str) -> str:
        return "/" + name[len(prefix):] if name.startswith(prefix) else name

    for n in proto.graph.node:
        n.name = strip(n.name)
        n.input[:] = [strip(x) for x in n.input]
        n.output[:] = [strip(x) for x in n.output]
    for v in proto.graph.value_info:
        v.name = strip(v.name)


def _constant_values(proto: Any) -> dict[str, Any]:
    """Name -> TensorProto of every initializer and Constant-node output (``value`` attribute) of ``proto``."""
    import onnx

    out = {t.name: t for t in proto.graph.initializer}
    for n in proto.graph.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    t = onnx.TensorProto()
                    t.CopyFrom(a.t)
                    t.name = n.output[0]
                    out[n.output[0]] = t
    return out


def _chain_name(src: WeightSource, readers: list[Any]) -> str:
    """The name of a folded weight: the module of the node that reads it, the parameter's own name, the recipe
    (``model.model.layers.0.mlp.down_proj.weight.Transpose``; a tied LM head: ``model.lm_head.weight.Transpose``,
    not the embedding's name)."""
    leaf = src.source.rsplit(".", 1)[-1]
    scope = readers[0].name.split("/")[1:-1] if readers and readers[0].name.startswith("/") else []
    owner = ".".join(scope) if scope else src.source.rsplit(".", 1)[0]
    return ".".join([owner, leaf, *src.op_types])


def fold_weight_chains(proto: Any, weights: set[str]) -> list[WeightSource]:
    """Make every node that reads a weight, directly or through foldable ops, read a graph input instead.

    The value where a chain ends becomes a graph input of its own, described by the returned recipe; the chain's
    nodes go once nothing reads them. Weight inputs no node reads directly are dropped.
    """
    consts = _constant_values(proto)
    consumers: dict[str, list[Any]] = defaultdict(list)
    for n in proto.graph.node:
        for x in n.input:
            consumers[x].append(n)
    graph_outputs = {o.name for o in proto.graph.output}
    inputs = {i.name: i for i in proto.graph.input}
    made: dict[str, WeightSource] = {}

    def foldable(n: Any, value: str) -> bool:
        return n.op_type in FOLDABLE and len(n.output) == 1 and all(x == value or x in consts for x in n.input if x)

    def visit(source: str, value: str, chain: list[Any]) -> None:
        for n in consumers[value]:
            if foldable(n, value):
                visit(source, n.output[0], [*chain, n])
        if any(not foldable(n, value) for n in consumers[value]) or value in graph_outputs:
            used = sorted({x for c in chain for x in c.input if x in consts})
            made[value] = WeightSource(value, source, tuple(c.SerializeToString() for c in chain),
                                       tuple(consts[x].SerializeToString() for x in used), value)

    for w in sorted(weights):
        visit(w, w, [])
    producers = {o: n for n in proto.graph.node for o in n.output}
    renamed: dict[str, WeightSource] = {}
    for v, src in made.items():
        if not src.nodes:
            renamed[v] = src
            continue
        name = _chain_name(src, consumers[v])
        proto.graph.node.remove(producers[v])
        for n in consumers[v]:
            for i, x in enumerate(n.input):
                if x == v:
                    n.input[i] = name
        value = proto.graph.input.add()
        value.CopyFrom(inputs[src.source])
        value.name = name
        del value.type.tensor_type.shape.dim[:]  # set from the written tensor by attach_weights
        renamed[name] = WeightSource(name, src.source, src.nodes, src.constants, v)
    made = renamed
    while True:
        read = {x for n in proto.graph.node for x in n.input} | graph_outputs
        dead = [n for n in proto.graph.node if n.op_type in FOLDABLE | {"Constant"} and not set(n.output) & read]
        if not dead:
            break
        for n in dead:
            proto.graph.node.remove(n)
    read = {x for n in proto.graph.node for x in n.input} | graph_outputs
    keep = [i for i in proto.graph.input if i.name in read or (i.name not in weights and i.name not in made)]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)
    return [src for v, src in made.items() if v in read]


class SourceReader:
    """Values of the weight inputs: parameters from the checkpoint (tied ones share one stored tensor)."""

    def __init__(self, model: Any, ckpt: Checkpoint, *, row_prefix: bool = False) -> None:
        self.ckpt, self.row_prefix = ckpt, row_prefix
        self.params = dict(model.named_parameters(remove_duplicate=False))
        names: dict[int, list[str]] = defaultdict(list)
        for name, p in self.params.items():
            names[id(p)].append(name)
        self.stored = {pid: next((n for n in ns if n in ckpt), ns[0]) for pid, ns in names.items()}

    def tensor(self, source: str) -> str:
        """The checkpoint tensor behind weight input ``source``; raises if the checkpoint lacks it."""
        name = source.removeprefix(WRAPPER_PREFIX)
        if name not in self.params:
            raise ExportError(f"graph input {source} is not a parameter of the model")
        shape = tuple(self.params[name].shape)
        tensor = self.stored[id(self.params[name])]
        if tensor not in self.ckpt:
            raise ExportError(f"the checkpoint in {self.ckpt.folder} has no tensor {tensor} (parameter of shape "
                              f"{shape}); is it a checkpoint of this config's model?")
        stored = self.ckpt.tensors[tensor].shape
        prefix = self.row_prefix and len(stored) == len(shape) and stored[1:] == shape[1:] and stored[0] > shape[0]
        if stored != shape and not prefix:
            raise ExportError(f"checkpoint tensor {tensor} has shape {stored}; the config's model wants {shape}")
        return tensor

    def rows(self, source: str) -> int | None:
        """How many leading rows of its checkpoint tensor a weight takes (a cut vocabulary), None when all."""
        tensor = self.tensor(source)
        want = int(self.params[source.removeprefix(WRAPPER_PREFIX)].shape[0])
        return want if self.ckpt.tensors[tensor].shape[0] != want else None

    def fill(self, source: str, out: np.ndarray, block_bytes: int = 64 << 20) -> None:
        """Write one weight's float32 value into ``out`` (a parameter's memory) a block of rows at a time, each block
        through its own map: no whole-tensor copy, and at most one block of the shard is mapped at once."""
        tensor = self.tensor(source)
        dtype = self.ckpt.tensors[tensor].dtype
        rows = out.shape[0] if out.ndim else 1
        flat = out.reshape(rows, -1)
        step = max(1, block_bytes // max(1, 4 * flat.shape[1]))
        for a in range(0, rows, step):
            words = self.ckpt.raw(tensor)
            b = min(rows, a + step)  # a cut vocabulary takes the leading rows only
            flat[a:b] = to_float32(words.reshape(words.shape[0] if words.ndim else 1, -1)[a:b], dtype)
            del words
        self.ckpt.release()

    def value(self, source: str) -> np.ndarray:
        """The whole float32 value of one weight (one tensor in memory)."""
        tensor, rows = self.tensor(source), self.rows(source)
        words = self.ckpt.raw(tensor)
        value = to_float32(words[:rows] if rows else words, self.ckpt.tensors[tensor].dtype)
        return np.array(value) if self.ckpt.viewed(tensor) else value  # a view's buffer is reused by the next


def _evaluate(src: WeightSource, reader: SourceReader) -> np.ndarray:
    """Run the folded ops of ``src`` on the weight's real value (onnx's reference evaluator: one tensor's work)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    value = reader.value(src.source)
    if not src.nodes:
        return value
    graph = onnx.helper.make_graph(
        [onnx.NodeProto.FromString(b) for b in src.nodes], "fold",
        [onnx.helper.make_tensor_value_info(src.source, onnx.TensorProto.FLOAT, value.shape)],
        [onnx.helper.make_empty_tensor_value_info(src.output)],
        initializer=[onnx.TensorProto.FromString(b) for b in src.constants])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    outputs: Any = ReferenceEvaluator(model).run(None, {src.source: value})  # [the one output]
    return np.asarray(outputs[0])


def write_weights(sources: list[WeightSource], reader: SourceReader,
                  data_path: Path) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Compute each weight whose recipe is more than a read (Gemma's ``1 + w`` on a norm gain: small tensors) and
    append it, as float32, to ``data_path``; returns name -> (offset, length, shape)."""
    placed: dict[str, tuple[int, int, tuple[int, ...]]] = {}
    with open(data_path, "wb") as f:
        for src in sources:
            value = np.ascontiguousarray(_evaluate(src, reader), dtype=np.float32)
            pos = f.tell()
            if value.nbytes >= ALIGN:
                pos = -(-pos // ALIGN) * ALIGN
                f.seek(pos)
            f.write(value.tobytes())
            placed[src.graph_name] = (pos, f.tell() - pos, tuple(value.shape))
    return placed


def refer_weights(proto: Any, sources: list[WeightSource], reader: SourceReader) -> str:
    """Keep the weights read as stored or as one 2-D transpose as graph inputs of their final shape; returns the
    graph's ``trtinfer.checkpoint`` record of them (:mod:`trtinfer.stage_weights`)."""
    from trtinfer.stage_weights import reference_record

    inputs = {i.name: i for i in proto.graph.input}
    refs: dict[str, tuple[str, bool, int | None]] = {}
    for src in sources:
        tensor, rows = reader.tensor(src.source), reader.rows(src.source)
        shape = reader.ckpt.tensors[tensor].shape
        shape = (rows, *shape[1:]) if rows else shape
        transpose = bool(src.nodes)
        dims = inputs[src.graph_name].type.tensor_type.shape.dim
        del dims[:]
        for d in (tuple(reversed(shape)) if transpose else shape):
            dims.add().dim_value = int(d)
        refs[src.graph_name] = (tensor, transpose, rows)
    return reference_record(reader.ckpt, refs)


def attach_weights(proto: Any, placed: dict[str, tuple[int, int, tuple[int, ...]]], location: str) -> None:
    """Turn the weight inputs of ``proto`` into float32 initializers that point into the external-data file."""
    import onnx

    keep = [i for i in proto.graph.input if i.name not in placed]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)
    for name, (offset, length, shape) in placed.items():
        tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=list(shape))
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=k, value=v)
        proto.graph.initializer.append(tensor)
