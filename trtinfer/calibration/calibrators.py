"""Calibrators: stream activations out of a graph and reduce them to one range per tensor.

``collect`` adds the chosen tensors as extra graph outputs (weights stay in their external file: only the graph
proto is rewritten, in memory), runs ONNX Runtime over the feeds and hands every batch of every
tensor to a callback, then forgets it. The calibrators are such callbacks, registered by name:

- ``minmax``: running min and max; ``amax = max(|min|, |max|)``.
- ``percentile``: a histogram of ``|x|`` (ONNX Runtime's ``HistogramCollector``, updated per batch); ``amax`` is
  the given percentile of it (ONNX Runtime's ``compute_percentile``).
- ``entropy``: a histogram of ``|x|`` anchored at 0; ``amax`` minimises the KL divergence between the clipped
  reference histogram and its 128-level quantization, TensorRT's ``EntropyCalibration2`` search.

Beside them, :class:`ChannelRangeCollector` keeps per-channel (last axis) min and max in the same pass: the
statistics SmoothQuant needs. ``calibrate(..., channel_scales=s)`` calibrates ``x / s`` (per channel) instead of
``x``: the ranges of a smoothed graph's activations without building that graph.

Why not ``onnxruntime.quantization.create_calibrator`` end to end: it works on our graphs (SmolLM2 fp32, 211
MatMuls, com.microsoft ops, external data: 7.6 s and 1.3 GB to augment), but its histogram calibrators keep every
batch's full outputs until ``compute_data`` (16 samples x 9 feeds x 121 tensors of a 30-layer model is tens of GB)
and it runs with graph optimizations off. Here nothing but the histograms outlives a batch.
"""
from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Iterable, Sequence, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import ONNX_NAME, StageDir
from trtinfer.errors import CalibrationError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TensorRange:
    """The observed ``min``/``max`` of a tensor and the calibrated symmetric threshold ``amax`` (scale = amax/127)."""

    min: float
    max: float
    amax: float

    def to_dict(self) -> dict[str, float]:
        """``{"min", "max", "amax"}`` as plain floats."""
        return {"min": self.min, "max": self.max, "amax": self.amax}


class Calibrator:
    """Base of the registered calibrators: ``update(name, batch)`` per tensor and batch, then ``ranges()``."""

    name = ""

    def update(self, tensor: str, batch: np.ndarray) -> None:
        """Fold one batch of ``tensor``'s values into the running statistics."""
        raise NotImplementedError

    def ranges(self) -> dict[str, TensorRange]:
        """The range of every tensor seen."""
        raise NotImplementedError


_CALIBRATORS: dict[str, type[Calibrator]] = {}


def register_calibrator(name: str) -> Callable[[type[Calibrator]], type[Calibrator]]:
    """Class decorator: make a :class:`Calibrator` available as ``method=name``."""
    def deco(cls: type[Calibrator]) -> type[Calibrator]:
        cls.name = name
        _CALIBRATORS[name] = cls
        return cls
    return deco


def calibrator_names() -> list[str]:
    """The registered calibrator names."""
    return sorted(_CALIBRATORS)


def get_calibrator(name: str) -> type[Calibrator]:
    """The calibrator class registered as ``name``; a :class:`ConfigError` listing the known ones otherwise."""
    if name not in _CALIBRATORS:
        raise ConfigError(f"unknown calibration method {name!r}; known: {', '.join(calibrator_names())}",
                          field="method")
    return _CALIBRATORS[name]


def _finite(batch: np.ndarray) -> np.ndarray:
    flat = np.asarray(batch, dtype=np.float32).ravel()
    return flat if np.isfinite(flat).all() else flat[np.isfinite(flat)]


@register_calibrator("minmax")
class MinMaxCalibrator(Calibrator):
    """Running min and max of each tensor; ``amax = max(|min|, |max|)``."""

    def __init__(self) -> None:
        self._lo: dict[str, float] = {}
        self._hi: dict[str, float] = {}

    def update(self, tensor: str, batch: np.ndarray) -> None:
        flat = _finite(batch)
        if flat.size == 0:
            return
        lo, hi = float(flat.min()), float(flat.max())
        self._lo[tensor] = min(lo, self._lo.get(tensor, lo))
        self._hi[tensor] = max(hi, self._hi.get(tensor, hi))

    def ranges(self) -> dict[str, TensorRange]:
        return {t: TensorRange(lo, self._hi[t], max(abs(lo), abs(self._hi[t]))) for t, lo in self._lo.items()}


@register_calibrator("percentile")
class PercentileCalibrator(Calibrator):
    """``amax`` = the ``percentile`` (e.g. 99.99) of ``|x|``, to one bin of a 2048-bin histogram.

    The histogram is ONNX Runtime's ``HistogramCollector`` (symmetric: over ``|x|``, widened as larger values
    arrive), updated per batch; the threshold is its ``compute_percentile`` (the lower edge of the bin holding
    the percentile), capped at the observed ``max(|min|, |max|)``.
    """

    def __init__(self, percentile: float = 99.99, num_bins: int = 2048) -> None:
        from onnxruntime.quantization.calibrate import HistogramCollector

        if not 0 < percentile <= 100:
            raise ConfigError(f"percentile must be in (0, 100], got {percentile}", field="percentile")
        self.collector = HistogramCollector(method="percentile", symmetric=True, num_bins=num_bins,
                                            num_quantized_bins=128, percentile=percentile, scenario="same")

    def update(self, tensor: str, batch: np.ndarray) -> None:
        flat = _finite(batch)
        if flat.size == 0:
            return
        with contextlib.redirect_stdout(io.StringIO()):  # the collector prints a line per call
            self.collector.collect({tensor: flat})

    def ranges(self) -> dict[str, TensorRange]:
        if not self.collector.histogram_dict:
            return {}
        with contextlib.redirect_stdout(io.StringIO()):
            found = self.collector.compute_percentile()
        out = {}
        for t, h in self.collector.histogram_dict.items():
            lo, hi = float(h[2]), float(h[3])
            out[t] = TensorRange(lo, hi, min(max(float(found[t][1]), 0.0), max(abs(lo), abs(hi))))
        return out


class AbsHistogram:
    """A histogram of ``|x|`` over ``[0, width * bins)`` per tensor; bins are added as larger values arrive, and
    pairs merged (width doubled) past ``4 * num_bins`` so a late outlier cannot blow it up."""

    def __init__(self, num_bins: int = 2048) -> None:
        self.num_bins = num_bins
        self.hist: dict[str, np.ndarray] = {}
        self.width: dict[str, float] = {}

    def add(self, tensor: str, values: np.ndarray) -> None:
        """Count ``|values|`` into ``tensor``'s histogram."""
        a = np.abs(values)
        top = float(a.max())
        h = self.hist.get(tensor)
        if h is None or self.width[tensor] == 0:  # first batch (or only zeros so far): bins span this batch
            zeros = 0 if h is None else int(h.sum())
            width = top / self.num_bins
            h = np.zeros(self.num_bins, np.int64)
            h[0] += zeros
            self.width[tensor] = width
        width = self.width[tensor]
        if width > 0:
            need = int(np.ceil(top / width))
            while need > 4 * self.num_bins:
                h = np.add.reduceat(h, np.arange(0, h.size, 2)) if h.size > 1 else h
                width *= 2
                need = int(np.ceil(top / width))
            if need > h.size:
                h = np.concatenate([h, np.zeros(need - h.size, np.int64)])
            idx = np.minimum((a / width).astype(np.int64), h.size - 1)
            h = h + np.bincount(idx, minlength=h.size)
        else:
            h[0] += a.size
        self.hist[tensor], self.width[tensor] = h, width

    def edges(self, tensor: str) -> np.ndarray:
        """Bin edges of ``tensor``'s histogram."""
        return np.arange(self.hist[tensor].size + 1) * self.width[tensor]


@register_calibrator("entropy")
class EntropyCalibrator(Calibrator):
    """``amax`` minimising KL(reference || 128-level quantized), as TensorRT's ``EntropyCalibration2``.

    ONNX Runtime's own entropy calibrator works on a signed histogram with another search; TensorRT's needs a
    histogram of ``|x|`` anchored at 0, which :class:`AbsHistogram` keeps.
    """

    def __init__(self, num_bins: int = 2048, num_quantized_bins: int = 128) -> None:
        self.histogram = AbsHistogram(num_bins)
        self.num_quantized_bins = num_quantized_bins
        self._minmax = MinMaxCalibrator()

    def update(self, tensor: str, batch: np.ndarray) -> None:
        flat = _finite(batch)
        if flat.size == 0:
            return
        self._minmax.update(tensor, flat)
        self.histogram.add(tensor, flat)

    def ranges(self) -> dict[str, TensorRange]:
        out = {}
        for t, r in self._minmax.ranges().items():
            hist, width = self.histogram.hist[t], self.histogram.width[t]
            if hist.size > self.histogram.num_bins:  # grown past its bins: back to num_bins over the whole range
                k = -(-hist.size // self.histogram.num_bins)
                hist, width = np.add.reduceat(hist, np.arange(0, hist.size, k)), width * k
            edges = np.arange(hist.size + 1) * width
            amax = entropy_threshold(hist, edges, self.num_quantized_bins)
            out[t] = TensorRange(r.min, r.max, min(amax, r.amax))
        return out


def _smooth_rows(x: np.ndarray, valid: np.ndarray, eps: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """Per row, give empty (valid) bins ``eps`` taken evenly from the others, so KL stays finite (MXNet's
    ``_smooth_distribution``); also returns which rows are usable (some non-empty bin, nothing driven to <= 0)."""
    zeros = valid & (x == 0)
    nonzero = valid & (x != 0)
    n_zeros, n_nonzero = zeros.sum(1), nonzero.sum(1)
    eps1 = eps * n_zeros / np.maximum(n_nonzero, 1)
    out = x + eps * zeros - eps1[:, None] * nonzero
    ok = (n_nonzero > 0) & ~(valid & (out <= 0)).any(1)
    return np.where(valid, out, 0.0), ok


def entropy_threshold(hist: np.ndarray, edges: np.ndarray, num_quantized_bins: int = 128,
                      chunk: int = 128) -> float:
    """The clip point (a bin edge) of the ``|x|`` histogram with the least KL divergence after quantization.

    TensorRT's ``EntropyCalibration2`` search (NVIDIA's GTC 2017 "8-bit inference with TensorRT"), as MXNet and
    ONNX Runtime write it: for each candidate of ``i`` bins (``num_quantized_bins`` up), the reference ``p`` is the
    first ``i`` bins with everything beyond folded into the last; ``q`` merges those bins into
    ``num_quantized_bins`` levels and spreads each level evenly over the bins where ``p`` is non-empty; both are
    smoothed and the KL divergence compared. Ties go to the larger threshold. Candidates are evaluated ``chunk``
    at a time as rows of one matrix.
    """
    hist = np.asarray(hist, dtype=np.float64)
    n, levels = hist.size, num_quantized_bins
    if n <= levels or hist.sum() == 0:
        return float(edges[-1])
    tail = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # tail[i] = sum(hist[i:])
    j = np.arange(n)
    kls = []
    candidates = np.arange(levels, n + 1)
    for start in range(0, candidates.size, chunk):
        ii = candidates[start:start + chunk]
        rows = np.arange(ii.size)
        valid = j[None, :] < ii[:, None]
        level = np.where(valid, (j[None, :] * levels) // ii[:, None], levels)  # ``levels``: a bin past the end
        ref = np.where(valid, hist[None, :], 0.0)
        p = ref.copy()
        p[rows, ii - 1] += tail[ii]
        nz = p > 0
        flat = rows[:, None] * (levels + 1) + level
        counts = np.bincount(flat.ravel(), weights=ref.ravel(), minlength=ii.size * (levels + 1))
        nonempty = np.bincount(flat[nz], minlength=ii.size * (levels + 1))
        q = np.where(nz, counts[flat] / np.maximum(nonempty[flat], 1), 0.0)
        ps, p_ok = _smooth_rows(p, valid)
        qs, q_ok = _smooth_rows(q, valid)
        ps /= ps.sum(1, keepdims=True)
        qs /= np.where(q_ok, qs.sum(1), 1.0)[:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(valid, ps * np.log(np.where(valid, ps, 1.0) / np.where(valid, qs, 1.0)), 0.0)
        kls.append(np.where(p_ok & q_ok, terms.sum(1), np.inf))
    kl = np.concatenate(kls)
    if not np.isfinite(kl).any():
        return float(edges[-1])
    best = kl.size - 1 - int(np.argmin(kl[::-1]))  # the last minimum: ties go to the larger threshold
    return float(edges[candidates[best]])


@dataclass(frozen=True)
class ChannelRange:
    """Per-channel (last axis) observed ``min`` and ``max`` of a tensor."""

    min: np.ndarray
    max: np.ndarray

    @property
    def amax(self) -> np.ndarray:
        """``max(|min|, |max|)`` per channel."""
        return np.maximum(np.abs(self.min), np.abs(self.max))

    def divided(self, s: np.ndarray) -> TensorRange:
        """The per-tensor range of ``x / s`` (``s > 0`` per channel): exact, from the per-channel extremes."""
        lo, hi = float((self.min / s).min()), float((self.max / s).max())
        return TensorRange(lo, hi, max(abs(lo), abs(hi)))


class ChannelRangeCollector:
    """Running per-channel (last axis) min and max of each tensor (non-finite values ignored)."""

    def __init__(self) -> None:
        self._lo: dict[str, np.ndarray] = {}
        self._hi: dict[str, np.ndarray] = {}

    def update(self, tensor: str, batch: np.ndarray) -> None:
        """Fold one batch ``[..., C]`` of ``tensor`` into its per-channel extremes."""
        x = np.asarray(batch, dtype=np.float32)
        x = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
        if x.shape[0] == 0:
            return
        finite = np.isfinite(x)
        lo = np.where(finite, x, np.inf).min(axis=0)
        hi = np.where(finite, x, -np.inf).max(axis=0)
        if tensor in self._lo:
            lo, hi = np.minimum(lo, self._lo[tensor]), np.maximum(hi, self._hi[tensor])
        self._lo[tensor], self._hi[tensor] = lo, hi

    def ranges(self) -> dict[str, ChannelRange]:
        """The per-channel range of every tensor seen (a channel never finite: 0, 0)."""
        out = {}
        for t, lo in self._lo.items():
            hi = self._hi[t]
            seen = lo <= hi
            out[t] = ChannelRange(np.where(seen, lo, 0).astype(np.float32), np.where(seen, hi, 0).astype(np.float32))
        return out


# --- running graphs -------------------------------------------------------------------------------------------

def _model_path(model: str | Path | StageDir) -> Path:
    """The graph file of a stage, a stage folder or a path to an ``.onnx`` file."""
    if isinstance(model, StageDir):
        return model.onnx_path
    return Path(model) / ONNX_NAME if Path(model).is_dir() else Path(model)


def weight_matmul_inputs(model_path: str | Path | StageDir, op_types: Sequence[str] = ("MatMul",)) -> list[str]:
    """Activation inputs of ``op_types`` nodes whose other input is a constant weight (what int8 QDQ quantizes).

    In graph order, each name once (q/k/v projections share their input).
    """
    import onnx

    from trtinfer.stage_weights import checkpoint_inputs

    model = onnx.load(str(_model_path(model_path)), load_external_data=False)
    consts = {i.name for i in model.graph.initializer} | checkpoint_inputs(model)
    consts |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    found: dict[str, None] = {}
    for node in model.graph.node:
        if node.op_type in op_types and len(node.input) >= 2 and node.input[1] in consts \
                and node.input[0] not in consts:
            found[node.input[0]] = None
    return list(found)


@contextlib.contextmanager
def _augmented_session(path: Path, tensors: Sequence[str]) -> Any:
    """An ONNX Runtime CPU session on ``path`` with ``tensors`` added as graph outputs (weights left on disk)."""
    import onnx

    from trtinfer.stage_weights import materialized_file

    with materialized_file(path) as whole:  # a stage's weights may be in its checkpoint: written out for the session
        model = onnx.load(str(whole), load_external_data=False)
        yield _session_with_outputs(model, whole, tensors)


def _session_with_outputs(model: Any, path: Path, tensors: Sequence[str]) -> Any:
    import onnx

    known = {i.name for i in model.graph.input} | {o for n in model.graph.node for o in n.output}
    missing = [t for t in tensors if t not in known]
    if missing:
        raise CalibrationError(f"{path} has no tensor {', '.join(missing[:3])}"
                               f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}; "
                               "name node outputs or graph inputs of this graph")
    outputs = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in outputs:  # no type given: ONNX Runtime infers it (fp16 graphs give fp16 outputs)
            model.graph.output.append(onnx.ValueInfoProto(name=t))
    from trtinfer.runtime.memory import stage_session_options
    from trtinfer.runtime.page_out import cpu_session

    so = stage_session_options(path)
    # the weights stay where they are: ONNX Runtime reads them from the original folder
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent.resolve()))
    return cpu_session(model.SerializeToString(), so, path.parent)


def collect(model_path: str | Path | StageDir, feeds: Iterable[dict[str, np.ndarray]], tensors: Sequence[str],
            on_batch: Callable[[str, np.ndarray], None], progress: bool = True) -> int:
    """Run the graph over ``feeds`` and call ``on_batch(tensor, values)`` for each of ``tensors`` on every run.

    ``feeds`` is any iterable of feed dicts, or a :class:`~trtinfer.calibration.data.StageFeeds` (a calibration
    set on a stage), whose decode feeds take their KV cache from the same runs (one run per feed). Values are
    not kept after the callback returns. Returns the number of runs.
    """
    from tqdm.auto import tqdm

    from trtinfer.calibration.data import StageFeeds, iter_feeds

    path = _model_path(model_path)
    tensors = list(dict.fromkeys(tensors))
    total = len(feeds) if isinstance(feeds, Sized) else None
    runs = 0
    with _augmented_session(path, tensors) as sess, \
            tqdm(total=total, desc="calibrating", unit="run", leave=False,
                 disable=None if progress else True) as bar:  # None: draws only on a terminal

        def hand_over(outputs: dict[str, np.ndarray]) -> None:
            nonlocal runs
            for t in tensors:
                on_batch(t, outputs[t])
            runs += 1
            bar.update(1)

        if isinstance(feeds, StageFeeds):
            for _ in iter_feeds(feeds.stage, feeds.cset, sess, on_outputs=lambda _f, outs: hand_over(outs),
                                all_logits=feeds.all_logits):
                pass
        else:
            for feed in feeds:
                hand_over(dict(zip(tensors, sess.run(tensors, feed))))
    if runs == 0:
        raise CalibrationError("calibration got no feeds: the calibration data produced no samples")
    return runs


def calibrate(stage_or_model_path: str | Path | StageDir, feeds: Iterable[dict[str, np.ndarray]] | Any, *,
              method: str = "minmax", tensors: Sequence[str] | None = None, op_types: Sequence[str] = ("MatMul",),
              percentile: float = 99.99, progress: bool = True,
              channel_scales: dict[str, np.ndarray] | None = None,
              channel_ranges: ChannelRangeCollector | None = None) -> dict[str, TensorRange]:
    """Ranges of ``tensors`` (default: activation inputs of weight ``op_types`` nodes) over ``feeds`` by ``method``.

    ``feeds``: feed dicts, a ``StageFeeds``, or a ``CalibrationSet`` when ``stage_or_model_path`` is a stage
    directory (its feeds are then built from the stage's graph contract). ``channel_scales`` (tensor -> ``s [C]``):
    calibrate ``x / s`` instead of ``x`` for those tensors. ``channel_ranges``: also fold every batch (undivided)
    into this per-channel collector, in the same pass.
    """
    from trtinfer.artifact import read_stage
    from trtinfer.calibration.data import CalibrationSet, StageFeeds

    cls = get_calibrator(method)
    calibrator = cls(percentile=percentile) if method == "percentile" else cls()  # type: ignore[call-arg]
    stage = stage_or_model_path
    if not isinstance(stage, StageDir) and Path(stage).is_dir():
        stage = read_stage(stage, verify=False)
    if isinstance(feeds, CalibrationSet):
        if not isinstance(stage, StageDir):
            stage = read_stage(stage, verify=False)
        feeds = StageFeeds(stage, feeds)
    names = list(tensors) if tensors is not None else weight_matmul_inputs(stage, op_types)
    if not names:
        raise CalibrationError(f"{_model_path(stage)} has no {'/'.join(op_types)} node with a constant weight "
                               "to calibrate; name the tensors explicitly")
    log.info("calibrating %d tensors with %s", len(names), method)
    scales = {t: np.asarray(v, np.float32) for t, v in (channel_scales or {}).items()}

    def on_batch(tensor: str, batch: np.ndarray) -> None:
        if channel_ranges is not None:
            channel_ranges.update(tensor, batch)
        calibrator.update(tensor, batch / scales[tensor] if tensor in scales else batch)

    runs = collect(stage, feeds, names, on_batch, progress=progress)
    ranges = calibrator.ranges()
    log.info("calibrated %d tensors over %d runs", len(ranges), runs)
    return ranges
