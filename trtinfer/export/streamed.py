"""Export without materializing the model: trace a weightless module, then stream each weight from the checkpoint.

How, and why this way:

1. The model is built from its config under ``accelerate.init_empty_weights`` and each parameter becomes a
   ``torch.empty`` tensor. Its pages are never written, so they cost no memory: the trace only reads them (the
   kernel maps untouched pages to the shared zero page). Buffers (rotary ``inv_freq``) are real, as the config
   makes them. torch 2.13's TorchScript exporter then traces the full-depth model with ``export_params=False``:
   the graph comes out whole and weightless, the same graph (op for op) as a trace of the loaded model.
   Tracing a reduced-depth model and replicating its layer would be faster but would rebuild by hand what the
   exporter names and orders; the meta device / fake tensors fail in the data-dependent mask code.
2. Each weight the graph reads unchanged keeps its parameter's name; tied parameters are found by identity, so
   a tied LM head reads the embedding's checkpoint tensor.
3. With folding on, the exporter computes the folded weights from the *empty* values, so they come out as
   nameless inputs (``onnx::MatMul_583``). A second trace with folding off says how each was made: both traces
   carry the same scoped node names, so the node that reads ``onnx::MatMul_583`` in the folded graph
   (``/model/model/layers.0/mlp/down_proj/MatMul``) reads, in the unfolded one, ``Transpose(model.model.layers.0.
   mlp.down_proj.weight)``: its recipe (:func:`weight_recipes`). A tied LM head is the embedding's recipe.
4. Each weight is then read from the memory-mapped shard, widened to the graph's float32 in blocks (transposed
   where the recipe is one 2-D Transpose) and appended to the external-data file, aligned so ONNX Runtime can map
   it; any other recipe (Gemma's ``1 + w``) runs on that one tensor with onnx's reference evaluator.

Peak memory is the trace (activations of a 2x7 batch, the graph proto without weights) plus one block.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.errors import ExportError
from trtinfer.export.checkpoint import Checkpoint, to_float32

log = logging.getLogger(__name__)

WRAPPER_PREFIX = "model."  # DecoderWithPast keeps the HF model as ``self.model``: input and node names carry it
ALIGN = 64 * 1024  # ONNX Runtime maps external data only at offsets aligned to the allocation granularity
BLOCK_BYTES = 64 * 2**20  # float32 bytes widened (and transposed) at a time


@dataclass(frozen=True)
class WeightSource:
    """How to make one weight of the folded graph: from which parameters or buffers, through which folded ops.

    ``nodes`` are the ops the exporter folded away between the sources and the weight (serialized NodeProtos, in
    the unfolded trace's order); none for a parameter the graph reads as is, one ``Transpose`` for a Linear's W.T.
    """

    graph_name: str
    sources: tuple[str, ...]  # unfolded-graph input names (``model.`` + parameter or buffer name)
    nodes: tuple[bytes, ...]
    output: str  # the value the nodes compute (== sources[0] when there are none)

    @property
    def transposed_2d(self) -> bool:
        """A single 2-D transpose of one source: written block by block, never materialized."""
        if len(self.nodes) != 1 or len(self.sources) != 1:
            return False
        import onnx

        node = onnx.NodeProto.FromString(self.nodes[0])
        perm = [list(a.ints) for a in node.attribute if a.name == "perm"]
        return node.op_type == "Transpose" and perm in ([[1, 0]], [])


def empty_model(config: Any) -> Any:
    """A traceable causal LM of ``config`` whose parameters own no memory (see the module docstring)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and p.device.type == "meta":
                module._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=torch.float32),
                                                              requires_grad=False)
    model.tie_weights()  # re-point tied parameters at the replaced ones
    return model.eval()


def weight_recipes(folded: Any, unfolded: Any, io_names: set[str], known: set[str]) -> list[WeightSource]:
    """For each weight input of the ``folded`` trace, the ops that make it from the ``unfolded`` trace's inputs.

    Both traces come from the same module, so their nodes carry the same scoped names: the folded graph's
    consumer ``/model/model/layers.0/input_layernorm/Mul_1`` reads, in the unfolded graph, the output of the
    chain the exporter folded (``Add(1, weight)`` for Gemma's norms, ``Transpose`` for a Linear's weight).
    ``known`` are the graph names of the model's parameters and buffers: a walk stops there, also where the
    exporter merged equal-looking (empty) parameters through an Identity whose output keeps the name.
    """
    _split_identities(folded, io_names)
    producer = {o: n for n in unfolded.graph.node for o in n.output}
    by_name = {n.name: n for n in unfolded.graph.node}
    weights = {i.name for i in folded.graph.input if i.name not in io_names}
    sources_u = {i.name for i in unfolded.graph.input if i.name not in io_names} | known
    out: dict[str, WeightSource] = {}
    for node in folded.graph.node:
        for k, name in enumerate(node.input):
            if name not in weights or name in out:
                continue
            twin = by_name.get(node.name)
            if twin is None or twin.op_type != node.op_type or len(twin.input) <= k:
                raise ExportError(f"cannot trace weight {name} back to the model: node {node.name} differs "
                                  "between the folded and unfolded traces")
            chain, srcs, stack, seen = [], [], [twin.input[k]], set()
            while stack:
                v = stack.pop()
                if v in seen or not v:
                    continue
                seen.add(v)
                if v in sources_u:
                    srcs.append(v)
                elif v in producer:
                    chain.append(producer[v])
                    stack.extend(producer[v].input)
                else:
                    raise ExportError(f"weight {name} depends on {v}, which is neither a parameter nor a constant")
            order = {id(n): i for i, n in enumerate(unfolded.graph.node)}
            chain.sort(key=lambda n: order[id(n)])
            out[name] = WeightSource(name, tuple(sorted(srcs)), tuple(n.SerializeToString() for n in chain),
                                     twin.input[k])
    missing = weights - set(out)
    if missing:
        raise ExportError(f"graph weights {sorted(missing)[:3]} are read by no node")
    return list(out.values())


def _split_identities(proto: Any, io_names: set[str]) -> None:
    """Give each ``Identity`` of a weight its own weight input and drop the Identity.

    The exporter merges weights whose traced values are equal into one input plus Identity nodes; here every
    weight is empty, so that merge says nothing about the real values. Each Identity's output becomes a weight of
    its own, traced back through the node that reads it.
    """
    while True:
        weights = {i.name: i for i in proto.graph.input if i.name not in io_names}
        hits = [n for n in proto.graph.node if n.op_type == "Identity" and n.input[0] in weights]
        if not hits:
            break
        for node in hits:
            value = proto.graph.input.add()
            value.CopyFrom(weights[node.input[0]])
            value.name = node.output[0]
            proto.graph.node.remove(node)
    used = {x for n in proto.graph.node for x in n.input} | {o.name for o in proto.graph.output}
    keep = [i for i in proto.graph.input if i.name in io_names or i.name in used]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)


class SourceReader:
    """Values of the unfolded graph's inputs: parameters from the checkpoint (float32), buffers from the model."""

    def __init__(self, model: Any, ckpt: Checkpoint) -> None:
        self.ckpt = ckpt
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.buffers = dict(model.named_buffers(remove_duplicate=False))
        names: dict[int, list[str]] = defaultdict(list)
        for name, p in self.params.items():
            names[id(p)].append(name)
        self.stored = {pid: next((n for n in ns if n in ckpt), ns[0]) for pid, ns in names.items()}

    @property
    def graph_names(self) -> set[str]:
        """The names the traced graph gives the parameters and buffers."""
        return {WRAPPER_PREFIX + n for n in (*self.params, *self.buffers)}

    def tensor(self, source: str) -> str | None:
        """The checkpoint tensor behind graph input ``source`` (None for a buffer); raises if the checkpoint lacks it."""
        name = source.removeprefix(WRAPPER_PREFIX)
        if name in self.buffers:
            return None
        if name not in self.params:
            raise ExportError(f"graph input {source} is neither a parameter nor a buffer of the model")
        tensor = self.stored[id(self.params[name])]
        if tensor not in self.ckpt:
            raise ExportError(f"the checkpoint in {self.ckpt.folder} has no tensor {tensor} (parameter of shape "
                              f"{tuple(self.params[name].shape)}); is it a checkpoint of this config's model?")
        if self.ckpt.tensors[tensor].shape != tuple(self.params[name].shape):
            raise ExportError(f"checkpoint tensor {tensor} has shape {self.ckpt.tensors[tensor].shape}; the config's "
                              f"model wants {tuple(self.params[name].shape)}")
        return tensor

    def value(self, source: str) -> np.ndarray:
        """The whole float32 value of one source (one tensor in memory)."""
        tensor = self.tensor(source)
        if tensor is None:
            return self.buffers[source.removeprefix(WRAPPER_PREFIX)].detach().numpy()
        return to_float32(self.ckpt.raw(tensor), self.ckpt.tensors[tensor].dtype)


def _evaluate(src: WeightSource, reader: SourceReader) -> np.ndarray:
    """Run the folded ops of ``src`` on its sources' real values (onnx's reference evaluator: one tensor's work)."""
    import onnx
    from onnx.reference import ReferenceEvaluator

    feeds = {s: reader.value(s) for s in src.sources}
    if not src.nodes:
        return feeds[src.output]
    nodes = [onnx.NodeProto.FromString(b) for b in src.nodes]
    graph = onnx.helper.make_graph(
        nodes, "fold", [onnx.helper.make_tensor_value_info(s, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                        for s, v in feeds.items()],
        [onnx.helper.make_empty_tensor_value_info(src.output)])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    return np.asarray(ReferenceEvaluator(model).run(None, feeds)[0])


def write_weights(sources: list[WeightSource], reader: SourceReader, data_path: Path,
                  dtypes: dict[str, np.dtype]) -> dict[str, tuple[int, int]]:
    """Append each weight, in its graph dtype, to ``data_path``; returns name -> (offset, length).

    A plain or transposed parameter streams from the shard in blocks; a weight made by other folded ops
    (Gemma's ``1 + w``) is computed whole, one tensor at a time.
    """
    placed: dict[str, tuple[int, int]] = {}
    ckpt = reader.ckpt
    with open(data_path, "wb") as f:
        for src in sources:
            dtype = dtypes[src.graph_name]
            tensor = reader.tensor(src.sources[0]) if len(src.sources) == 1 else None
            pos = f.tell()
            if tensor is not None and ckpt.tensors[tensor].nbytes >= ALIGN:
                pos = -(-pos // ALIGN) * ALIGN
                f.seek(pos)
            if tensor is not None and (src.transposed_2d or not src.nodes) and dtype == np.float32:
                info, words = ckpt.tensors[tensor], ckpt.raw(tensor)
                if src.transposed_2d:
                    rows, cols = words.shape  # writing W.T [cols, rows]: a block of W's columns at a time
                    step = max(1, BLOCK_BYTES // (4 * rows))
                    f.writelines(np.ascontiguousarray(to_float32(words[:, c:c + step], info.dtype).T).tobytes()
                                 for c in range(0, cols, step))
                else:
                    flat, step = words.reshape(-1), BLOCK_BYTES // 4
                    f.writelines(to_float32(flat[i:i + step], info.dtype).tobytes() for i in range(0, flat.size, step))
                del words
            else:
                f.write(np.ascontiguousarray(_evaluate(src, reader), dtype=dtype).tobytes())
            placed[src.graph_name] = (pos, f.tell() - pos)
    return placed


def weight_dtypes(proto: Any, sources: list[WeightSource]) -> dict[str, np.dtype]:
    """The numpy dtype the folded graph declares for each weight input."""
    import onnx

    names = {src.graph_name for src in sources}
    return {i.name: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type))
            for i in proto.graph.input if i.name in names}


def attach_weights(proto: Any, placed: dict[str, tuple[int, int]], location: str) -> None:
    """Turn the weight inputs of ``proto`` into initializers that point into the external-data file."""
    import onnx

    keep = [i for i in proto.graph.input if i.name not in placed]
    weights = [i for i in proto.graph.input if i.name in placed]
    del proto.graph.input[:]
    proto.graph.input.extend(keep)
    for value in weights:
        t = value.type.tensor_type
        tensor = onnx.TensorProto(name=value.name, data_type=t.elem_type, dims=[d.dim_value for d in t.shape.dim])
        offset, length = placed[value.name]
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", str(offset)), ("length", str(length))):
            tensor.external_data.add(key=k, value=v)
        proto.graph.initializer.append(tensor)
