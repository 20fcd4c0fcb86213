"""SmoothQuant for int8-static: move activation outliers into the weights before per-tensor int8 activations.

For one activation ``X [.., K]`` read by GEMMs ``W_1 .. W_m`` (q/k/v, or gate/up, share one ``X`` and one ``s``)::

    s_j = clip(max|X_j| ** alpha / max_i max|W_i[j, :]| ** (1 - alpha))          (Xiao et al. 2023, eq. 4)
    X W_i = (X / s) (diag(s) W_i)

``X / s`` has flat channels (the outlier channels shrink), the weight rows grow (per-output-channel int8 absorbs
that well). ``1/s`` goes where it costs nothing and stays exact in fp32:

    norm fold:      RMSNorm(x) * gamma          -> RMSNorm(x) * (gamma / s)         (the norm's output read only
                    (Skip)SimplifiedLayerNormalization, RMSNormalization, LayerNormalization (gamma and beta)    by these GEMMs)
    producer fold:  a * (x @ W_up)              -> a * (x @ (W_up / s))             (down_proj: SiLU(gate) * up; the
                    columns of the producing weight; exact, and free under per-output-channel int8  up output read only here)
    explicit Mul:   X                           -> Mul(X, 1/s)                      (o_proj after attention, anything else)

The Q/DQ pair then reads the smoothed tensor (a new tensor ``<X>_smoothed`` for an explicit Mul; the same name
for a fold, whose values change): those are the names in the calibration table. Calibration statistics are taken
on the fp32 graph (per-channel min/max, :class:`~trtinfer.calibration.ChannelRangeCollector`); the smoothed
tensor's range follows without a second graph: ``X / s`` per channel (exactly ``max_j(amax_j / s_j)`` for minmax).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from trtinfer.errors import ConfigError
from trtinfer.quantization.weights import WeightSite, add_initializer

log = logging.getLogger(__name__)

#: smoothing factors outside this range are clipped (a dead channel or a zero weight row must not blow up a scale)
S_MIN, S_MAX = 1e-3, 1e3
#: norms whose output is ``normalized * gamma (+ beta)``: op type -> (gamma input, beta input or None)
NORM_GAMMA = {("", "SimplifiedLayerNormalization"): (1, None), ("", "RMSNormalization"): (1, None),
              ("", "LayerNormalization"): (1, 2), ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2, None),
              ("com.microsoft", "SkipLayerNormalization"): (2, 3)}


@dataclass
class SmoothSite:
    """One activation tensor ``x`` and the weight GEMMs reading it (they share its Q/DQ pair and its ``s``)."""

    x: ir.Value
    gemms: list[WeightSite]

    @property
    def name(self) -> str:
        """The activation's tensor name in the fp32 graph."""
        return self.x.name or "?"

    def weight_row_amax(self) -> np.ndarray:
        """``max_i max_n |W_i[j, n]|`` per input channel ``j``."""
        return np.max([row_amax(g.array()) for g in self.gemms], axis=0)


def row_amax(w: np.ndarray) -> np.ndarray:
    """``max_n |w[j, n]|`` per row, without an ``|w|`` copy of the weight."""
    return np.maximum(w.max(axis=1), -w.min(axis=1))  # type: ignore[no-any-return]


def group_by_input(sites: Sequence[WeightSite]) -> dict[str, SmoothSite]:
    """The distinct activation inputs of ``sites`` (by name, in graph order), each with the GEMMs reading it."""
    groups: dict[str, SmoothSite] = {}
    for s in sites:
        x = s.node.inputs[0]
        assert x is not None
        if not x.name:
            raise ConfigError(f"the activation input of {s.name} has no name; int8-static needs named tensors to "
                              "calibrate")
        groups.setdefault(x.name, SmoothSite(x, [])).gemms.append(s)
    return groups


def smoothing_factors(act_amax: np.ndarray, weight_amax: np.ndarray, alpha: float) -> np.ndarray:
    """``s_j = act_amax_j ** alpha / weight_amax_j ** (1 - alpha)``, clipped to ``[S_MIN, S_MAX]``; 1 where a
    channel never fired or its weight row is zero."""
    a = np.asarray(act_amax, np.float64)
    w = np.asarray(weight_amax, np.float64)
    dead = (a <= 0) | (w <= 0) | ~np.isfinite(a)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = np.power(np.maximum(a, 1e-30), alpha) / np.power(np.maximum(w, 1e-30), 1.0 - alpha)
    return np.clip(np.where(dead, 1.0, s), S_MIN, S_MAX).astype(np.float32)


#: readers that see only a tensor's shape: a fold that rescales the values leaves them right
SHAPE_READERS = frozenset({"Shape", "Size"})


def _only_read_by(value: ir.Value, nodes: Sequence[ir.Node]) -> bool:
    """True when ``nodes`` (and shape-only readers) are all that read ``value`` and it is no graph output."""
    ids = {id(n) for n in nodes}
    return (all(id(u.node) in ids or (u.node.op_type in SHAPE_READERS and u.node.domain == "")
                for u in value.uses()) and not value.is_graph_output())


def _replace_const(graph: ir.Graph, node: ir.Node, index: int, array: np.ndarray, suffix: str) -> ir.Value:
    """Point ``node``'s input ``index`` at a new initializer holding ``array`` (the old one may have other readers)."""
    old = node.inputs[index]
    assert old is not None
    new = add_initializer(graph, f"{(old.name or 'c').replace('/', '_')}_{suffix}", array.astype(np.float32))
    node.replace_input_with(index, new)
    return new


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None or value.const_value is None or value.producer() is not None:
        return None
    return np.asarray(value.const_value.numpy())


def fold_place(site: SmoothSite, weight_producers: dict[int, WeightSite]) -> str:
    """Where ``1/s`` of ``site`` goes: ``norm``, ``producer`` or ``mul`` (see the module docstring)."""
    x, readers = site.x, [g.node for g in site.gemms]
    node = x.producer()
    if node is None or not _only_read_by(x, readers):
        return "mul"
    spec = NORM_GAMMA.get((node.domain or "", node.op_type))
    if spec is not None and node.outputs[0] is x:
        gamma, beta = spec
        ok = _const(node.inputs[gamma]) is not None and (
            beta is None or len(node.inputs) <= beta or node.inputs[beta] is None
            or _const(node.inputs[beta]) is not None)
        return "norm" if ok else "mul"
    if node.op_type == "Mul" and node.domain == "":
        for v in node.inputs:
            up = v.producer() if v is not None else None
            if v is not None and up is not None and id(up) in weight_producers and _only_read_by(v, [node]):
                return "producer"
    return "mul"


def apply_smoothing(graph: ir.Graph, site: SmoothSite, s: np.ndarray,
                    weight_producers: dict[int, WeightSite]) -> tuple[ir.Value, str]:
    """Rewrite ``graph`` so ``site``'s GEMMs read ``x / s`` with weights ``diag(s) W``; returns the tensor the Q/DQ
    pair must read and where ``1/s`` went. The weight sites are pointed at their new (smoothed) initializers."""
    s = np.asarray(s, np.float32)
    inv = (np.float32(1.0) / s).astype(np.float32)
    place = fold_place(site, weight_producers)
    x = site.x
    target = x
    if place == "norm":
        node = x.producer()
        assert node is not None
        gamma, beta = NORM_GAMMA[(node.domain or "", node.op_type)]
        _replace_const(node.graph or graph, node, gamma, _const(node.inputs[gamma]) * inv, "smoothed")  # type: ignore[operator]
        if beta is not None and len(node.inputs) > beta and node.inputs[beta] is not None:
            _replace_const(graph, node, beta, _const(node.inputs[beta]) * inv, "smoothed")  # type: ignore[operator]
    elif place == "producer":
        mul = x.producer()
        assert mul is not None
        v = next(v for v in mul.inputs if v is not None and v.producer() is not None
                 and id(v.producer()) in weight_producers and _only_read_by(v, [mul]))
        up = weight_producers[id(v.producer())]
        up.weight = _replace_const(graph, up.node, 1, up.array() * inv[None, :], "smoothed")
    else:
        base = (x.name or "x").rstrip("_")
        c = add_initializer(graph, f"{base}_smooth_inv", inv)
        mul = ir.node("Mul", [x, c], name=f"{base}_smooth")
        out = mul.outputs[0]
        out.name, out.shape, out.type = f"{base}_smoothed", x.shape, x.type
        order = {id(n): i for i, n in enumerate(graph)}
        graph.insert_before(min((g.node for g in site.gemms), key=lambda n: order[id(n)]), mul)
        for g in site.gemms:
            g.node.replace_input_with(0, out)
        target = out
    for g in site.gemms:
        g.weight = _replace_const(graph, g.node, 1, g.array() * s[:, None], "smoothed")
    return target, place


def smooth(graph: ir.Graph, groups: dict[str, SmoothSite], factors: dict[str, np.ndarray],
           sites: Sequence[WeightSite]) -> tuple[dict[str, ir.Value], dict[str, int]]:
    """Apply ``factors`` (activation name -> ``s``) to ``groups`` (every factor computed beforehand, on the fp32
    weights); returns the tensor each group's Q/DQ pair must read and how many ``1/s`` went where.

    ``sites`` are all weight MatMuls of the graph (a producer fold may rescale one that stays fp32).
    """
    producers = {id(s.node): s for s in sites}
    targets = {n: g.x for n, g in groups.items()}
    folds: dict[str, int] = {}
    for name, s_j in factors.items():
        targets[name], place = apply_smoothing(graph, groups[name], s_j, producers)
        folds[place] = folds.get(place, 0) + 1
    return targets, folds
