"""A stage's graph run piece by piece over calibration feeds: statistics of a model whose fp32 graph does not fit.

The graph's nodes, in file order (which ONNX keeps topological), are cut into consecutive pieces of about
``budget`` bytes of weights each, never between two consumers of one wanted tensor (q/k/v read one input: its
statistics are then complete when its piece ends). Each piece becomes a graph of its own: its inputs are the graph
inputs it reads and the values earlier pieces made, its outputs what later pieces or the caller (the KV: the
``present.*`` outputs) read, plus the wanted tensors it makes; a node feeding none of these is left out (the LM
head's product). Its weights are written to a temporary folder (fp32, from the stage's data file or its
checkpoint) and one ONNX Runtime session runs it over every calibration feed before the next piece is made. Memory
holds one piece's weights, the values crossing the cut for every run (a hidden state or two per token), and what the
caller keeps of the wanted tensors; a decode feed's KV cache is the piece's own ``present.*`` of the run before.

The feeds, their order and the KV threading are :func:`~trtinfer.calibration.data.iter_feeds`', run by a piece
instead of a whole-graph session, so every run sees the same values as on the whole graph.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from trtinfer._outputs import final_name, scratch_dir
from trtinfer.artifact import ONNX_NAME, StageDir
from trtinfer.errors import CalibrationError

log = logging.getLogger(__name__)

#: Weight bytes (as run: fp32) of one piece; a model under it runs as one piece. A Llama-3.2-1B-shape decoder layer
#: is 0.24 GiB, a Qwen3-14B-shape layer 1.3 GiB (a piece never splits a node), its embedding table 2.9 GiB.
PIECE_BYTES = 1 << 30


@dataclass(frozen=True)
class Piece:
    """Nodes ``[start, stop)`` of the graph, the values crossing into and out of them, and the wanted tensors whose
    every consumer lies among them."""

    start: int
    stop: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    wanted: tuple[str, ...]
    weight_bytes: int


def _is_weight(v: ir.Value | None) -> TypeGuard[ir.Value]:
    """An initializer: it travels with the node that reads it, never across a cut."""
    return v is not None and v.const_value is not None and v.producer() is None


#: initializer types of quantized weights (packed blocks, int8 weights and zero points)
_QUANTIZED = frozenset({ir.DataType.UINT8, ir.DataType.INT8, ir.DataType.UINT4, ir.DataType.INT4})


def _float_weights(model: ir.Model) -> bool:
    """Whether ``model`` holds no quantized weights (an unquantized graph or piece: its GEMMs' weights are float)."""
    return not any(v.const_value is not None and v.const_value.dtype in _QUANTIZED
                   for v in model.graph.initializers.values())


def _weight_bytes(node: ir.Node) -> int:
    return sum(int(w.nbytes) for v in node.inputs if _is_weight(v) and (w := v.const_value) is not None)


def plan(model: ir.Model, wanted: Sequence[str], budget: int = PIECE_BYTES,
         outputs: Sequence[str] | None = None) -> list[Piece]:
    """Cut ``model``'s nodes into pieces of about ``budget`` weight bytes (at least one node each); see the module
    docstring. Every name of ``wanted`` must be a value some node reads, or a graph output. ``outputs``: the graph
    outputs the caller reads besides ``wanted`` (every one by default). Nodes that feed none of them nor ``wanted``
    weigh nothing, never start a piece and are dropped from their piece's graph (calibration threads the ``present.*``
    KV and reads no logits: the LM head's product, 63% of Gemma-3-270M's calibration FLOPs, is not computed)."""
    graph = model.graph
    nodes = list(graph)
    if any(attr.type == ir.AttributeType.GRAPH or attr.type == ir.AttributeType.GRAPHS
           for node in nodes for attr in node.attributes.values()):
        raise CalibrationError("the graph has control flow (If/Loop/Scan bodies); it cannot be run in pieces")
    produced_at: dict[str, int] = {v.name: -1 for v in graph.inputs if v.name}
    first: dict[str, int] = {}
    read = {v.name for v in graph.outputs if v.name} if outputs is None else set(outputs)
    last: dict[str, int] = {v.name: len(nodes) for v in graph.outputs if v.name in read}
    needed, live = set(wanted) | read, np.zeros(len(nodes), bool)  # live: feeds something wanted or read
    for i in range(len(nodes) - 1, -1, -1):
        if any(v.name in needed for v in nodes[i].outputs):
            live[i] = True
            needed.update(v.name for v in nodes[i].inputs if v is not None and v.name)
    for i, node in enumerate(nodes):
        for v in node.inputs:
            if v is None or not v.name or _is_weight(v) or not live[i]:
                continue
            first.setdefault(v.name, i)
            last[v.name] = max(last.get(v.name, i), i)
        for v in node.outputs:
            if v.name:
                produced_at[v.name] = i
    for t in wanted:  # a graph output no node reads (the logits): the piece that makes it
        if t not in first and t in produced_at and produced_at[t] >= 0:
            first[t] = last[t] = produced_at[t]
    missing = [t for t in wanted if t not in first]
    if missing:
        raise CalibrationError(f"the graph has no node reading {', '.join(missing[:3])}; name tensors nodes read")
    blocked = np.zeros(len(nodes) + 1, bool)  # blocked[p]: no cut before node p
    blocked[:len(nodes)] = ~live  # a dead node rides with the piece before it: no piece is only dead nodes
    for t in wanted:
        blocked[first[t] + 1:last[t] + 1] = True
    weights = [_weight_bytes(node) if live[i] else 0 for i, node in enumerate(nodes)]
    cuts, held = [0], 0
    for i, w in enumerate(weights):
        if held and held + w > budget and not blocked[i]:
            cuts.append(i)
            held = 0
        held += w
    cuts.append(len(nodes))
    pieces = []
    for a, b in itertools.pairwise(cuts):
        reads = {v.name for i in range(a, b) if live[i] for v in nodes[i].inputs
                 if v is not None and v.name and not _is_weight(v)}
        inputs = tuple(sorted(n for n in reads if produced_at[n] < a))
        outputs = tuple(sorted(n for n, at in produced_at.items() if a <= at < b and last.get(n, -1) >= b))
        mine = tuple(t for t in wanted if a <= first[t] < b)
        pieces.append(Piece(a, b, inputs, outputs, mine, sum(weights[a:b])))
    return pieces


def piece_model(path: Path, piece: Piece, kinds: dict[str, tuple[np.dtype, int]]) -> ir.Model:
    """The graph of ``path`` cut down to ``piece`` (loaded again: the cut takes its nodes apart). ``kinds`` gives
    (dtype, rank) of each input made by an earlier piece, as seen in that piece's outputs."""
    from trtinfer.stage_weights import load_graph

    model = load_graph(path)
    graph = model.graph
    nodes = list(graph)
    keep = nodes[piece.start:piece.stop]
    kept = {id(n) for n in keep}
    values = {v.name: v for v in graph.inputs if v.name}
    for node in nodes:
        values.update((v.name, v) for v in node.outputs if v.name)
    originals = {v.name for v in graph.inputs}
    inputs = []
    for name in piece.inputs:
        old = values[name]
        if name in originals:
            inputs.append(old)
            continue
        dtype, rank = kinds[name]
        new = ir.Value(name=name, type=ir.TensorType(ir.DataType.from_numpy(dtype)), shape=ir.Shape([None] * rank))
        for use in list(old.uses()):
            if id(use.node) in kept:
                use.node.replace_input_with(use.idx, new)
        inputs.append(new)
    made = [t for t in piece.wanted if t in values and t not in piece.inputs and t not in piece.outputs]
    graph.outputs.clear()
    graph.outputs.extend(values[n] for n in (*piece.outputs, *made))
    dropped = [n for n in nodes if id(n) not in kept]
    for node in dropped:  # their reads are let go, so the weights only they read are dropped below
        for i in range(len(node.inputs)):
            node.replace_input_with(i, None)
    graph.remove(dropped, safe=False)
    graph.inputs.clear()
    graph.inputs.extend(inputs)
    ir.passes.common.RemoveUnusedNodesPass()(model)  # what feeds none of the piece's outputs (plan's ``outputs``)
    for name in [n for n, v in graph.initializers.items() if not v.uses()]:
        graph.initializers.pop(name)
    return model


class _PieceSession:
    """What :func:`~trtinfer.calibration.data.iter_feeds` drives, over one piece: the ``r``-th run takes the values
    earlier pieces made at their ``r``-th run (``carried[r]``) and adds what later pieces read to it. Its outputs are
    the piece's outputs and the wanted tensors it reads from earlier pieces."""

    def __init__(self, session: Any, piece: Piece, carried: list[dict[str, np.ndarray]]) -> None:
        self.session = session
        self.piece = piece
        self.carried = carried
        self.runs = 0
        self.names = [o.name for o in session.get_outputs()]
        self.passed = [t for t in piece.wanted if t in piece.inputs]

    def get_outputs(self) -> list[Any]:
        return [_Named(n) for n in (*self.names, *self.passed)]

    def run(self, _names: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        if self.runs == len(self.carried):
            self.carried.append({})
        held = self.carried[self.runs]
        self.runs += 1
        inputs = {n: feed[n] if n in feed else held[n] for n in self.piece.inputs}
        values = dict(zip(self.names, self.session.run(self.names, inputs)))
        held.update((n, values[n]) for n in self.piece.outputs)
        return [values[n] for n in self.names] + [inputs[n] for n in self.passed]


@dataclass(frozen=True)
class _Named:
    name: str


def collect_in_pieces(stage: StageDir, feeds: Any, tensors: Sequence[str],
                      on_batch: Callable[[str, np.ndarray], None], *, budget: int = PIECE_BYTES,
                      scratch: Path | None = None, progress: bool = True,
                      what: str = "calibrating") -> Iterator[tuple[str, ...]]:
    """Run ``stage``'s graph piece by piece over ``feeds`` (a :class:`~trtinfer.calibration.data.StageFeeds`),
    calling ``on_batch(tensor, values)`` for each of ``tensors`` on every run; yields, after each piece, the
    tensors it completed (every run of them handed over), so a caller can use and drop their statistics.

    Each piece's weights are written in a temporary folder in ``scratch`` (the stage being made, so a killed build's
    leftovers go with its own; beside ``stage`` by default) and removed when the piece has run. ``what``: the
    work, as the log and the progress bar name it."""
    from tqdm.auto import tqdm

    from trtinfer.calibration.data import iter_feeds, kv_names
    from trtinfer.runtime.memory import stage_session_options
    from trtinfer.runtime.page_out import cpu_session
    from trtinfer.stage_weights import load_graph, save_graph

    tensors = list(dict.fromkeys(tensors))
    pieces = plan(load_graph(stage.onnx_path), tensors, budget, outputs=kv_names(stage)[1])
    log.info("%s in %d piece(s) of up to %.2f GiB of weights", what, len(pieces),
             max(p.weight_bytes for p in pieces) / 2**30)
    later = [set().union(*(p.inputs for p in pieces[i + 1:])) for i in range(len(pieces))]
    carried: list[dict[str, np.ndarray]] = []
    kinds: dict[str, tuple[np.dtype, int]] = {}
    total = len(feeds) * len(pieces)
    with tqdm(total=total, desc=what, unit="run", leave=False, disable=None if progress else True) as bar:
        for i, piece in enumerate(pieces):
            with scratch_dir(scratch or stage.path.parent, final_name(stage.path)) as tmp:
                model = piece_model(stage.onnx_path, piece, kinds)
                floats = _float_weights(model)
                save_graph(model, tmp / ONNX_NAME, keep_references=False)
                del model
                # float weights are read in place: MLAS's packed copy would double the piece, and its column-panel
                # reads of a mapped [K, N] weight are slow to page out (runtime/page_out.py); quantized pieces pack,
                # as the engine does (MatMulNBits computes differently unpacked)
                session = cpu_session(str(tmp / ONNX_NAME), stage_session_options(tmp / ONNX_NAME, always=floats), tmp)
                runner = _PieceSession(session, piece, carried)

                def hand_over(_feed: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
                    for t in piece.wanted:  # noqa: B023 (called within this iteration)
                        on_batch(t, outputs[t])
                    bar.update(1)

                for _ in iter_feeds(stage, feeds.cset, runner, on_outputs=hand_over, all_logits=feeds.all_logits):
                    pass
                del session, runner
            if not carried:
                raise CalibrationError("calibration got no feeds: the calibration data produced no samples")
            for held in carried:
                for name in [n for n in held if n not in later[i]]:
                    del held[name]
            kinds.update((n, (v.dtype, v.ndim)) for n, v in carried[0].items())
            log.debug("piece %d/%d (nodes %d-%d, %.2f GiB): %d tensor(s) done", i + 1, len(pieces), piece.start,
                      piece.stop, piece.weight_bytes / 2**30, len(piece.wanted))
            yield piece.wanted
