"""One initializer name per reader of a shared weight, all names over the same bytes on disk.

ONNX Runtime maps each external initializer into memory on its own. When a CPU kernel prepacks a GEMM's weight
(MLAS's fp32 GEMM, ``MatMulNBits``) ONNX Runtime drops that initializer's mapping, unless another node still reads the
same initializer: then the whole mapped copy stays resident beside the packed one. A tied embedding read by a row
gather and by the head's prepacked GEMM is that case (Gemma-3-270M fp32: +671 MB resident; SmolLM2 int4, whose
``GatherBlockQuantized`` reads the head's 4-bit blocks: 144 -> 130 MiB after load once split). Giving each extra
reader its own initializer entry that points at the same ``location``/``offset``/``length`` keeps the file as it is
and lets each mapping live as long as its reader needs it: the packed head's goes, the gather's holds only the rows
it touched. Runs on the saved engine graph (the protobuf only; weights are not read).
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

#: ops whose CPU kernels prepack a constant weight (and then release it)
PREPACKED_READERS = frozenset({"MatMul", "FusedMatMul", "Gemm", "MatMulNBits"})


def one_name_per_reader(onnx_path: Path) -> int:
    """Rewrite ``onnx_path`` so that every external initializer read by several nodes, one of them a prepacking
    GEMM, has one name per reader over the same stored bytes; returns how many names were added."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    graph = model.graph
    external = {t.name: t for t in graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    readers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in external:
                readers.setdefault(name, []).append((node, k))
    outputs = {o.name for o in graph.output}
    added = 0
    for name, uses in readers.items():
        if len(uses) < 2 or name in outputs or not any(n.op_type in PREPACKED_READERS for n, _ in uses):
            continue
        for j, (node, k) in enumerate(uses[1:], start=1):
            alias = graph.initializer.add()
            alias.CopyFrom(external[name])
            alias.name = f"{name}__reader{j}"
            node.input[k] = alias.name
            added += 1
    if added:
        onnx.save(model, str(onnx_path))
        log.debug("%s: %d initializer name(s) added over shared weights", onnx_path.name, added)
    return added
