"""Calibration: activation ranges of a stage's graph over real prefill and decode feeds, saved for reuse.

    texts (file / JSONL / built-in) -> CalibrationSet (token windows) -> feeds (prefill + decode with KV)
        -> collect (extra graph outputs, streamed) -> calibrator (minmax / percentile / entropy)
        -> CalibrationTable -> calibration.json + calibration.cache (TensorRT)

:func:`calibrate_stage` does all of it for a stage directory and a :class:`CalibrationConfig`, or reuses a saved
table (``cache_file``) after checking it fits the graph.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from trtinfer.artifact import StageDir, read_stage
from trtinfer.calibration.calibrators import (
    Calibrator,
    ChannelRange,
    ChannelRangeCollector,
    EntropyCalibrator,
    MinMaxCalibrator,
    PercentileCalibrator,
    TensorRange,
    calibrate,
    calibrator_names,
    collect,
    entropy_threshold,
    get_calibrator,
    register_calibrator,
    weight_matmul_inputs,
)
from trtinfer.calibration.data import (
    BUILTIN_TEXTS,
    DEFAULT_TEXT,
    EVAL_TEXT,
    CalibrationSet,
    StageFeeds,
    builtin_text,
    calibration_set,
    iter_feeds,
    load_texts,
    stage_calibration_set,
)
from trtinfer.calibration.table import (
    CACHE_NAME,
    JSON_NAME,
    TRT_VERSION,
    CalibrationTable,
    graph_hash,
    load_table,
    scale_hex,
)
from trtinfer.errors import CalibrationError, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CalibrationConfig:
    """How to calibrate: the method, the data and its shape, or a saved table to reuse instead.

    ``source``: a text or JSONL file, ``builtin:NAME``, or None for the built-in default text. Each of
    ``num_samples`` windows gives one prefill of ``seq_len`` tokens and ``decode_steps`` decode steps.
    ``cache_file``: a ``calibration.json``/``calibration.cache`` (or a folder holding one) to reuse.
    """

    method: str = "minmax"
    percentile: float = 99.99
    source: str | Path | None = None
    num_samples: int = 16
    seq_len: int = 128
    decode_steps: int = 8
    cache_file: str | Path | None = None

    def __post_init__(self) -> None:
        if self.method not in calibrator_names():
            raise ConfigError(f"unknown calibration method {self.method!r}; known: {', '.join(calibrator_names())}",
                              field="method")
        if not 0 < self.percentile <= 100:
            raise ConfigError(f"percentile must be in (0, 100], got {self.percentile}", field="percentile")
        for name, low in (("num_samples", 1), ("seq_len", 1), ("decode_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}", field=name)

    def settings(self) -> dict[str, object]:
        """The settings recorded with a table (paths as strings; ``cache_file`` left out)."""
        d = asdict(self)
        d.pop("cache_file")
        d["source"] = None if self.source is None else str(self.source)
        if self.method != "percentile":
            d.pop("percentile")
        return d


#: SmoothQuant's factors from per-channel ranges: ``{tensor: ChannelRange} -> {tensor: s [C]}``
Smoothing = Callable[[dict[str, ChannelRange]], dict[str, np.ndarray]]


def calibrate_stage(stage: str | Path | StageDir, config: CalibrationConfig | None = None, *,
                    tensors: Sequence[str] | None = None, progress: bool = True,
                    smoothing: Smoothing | None = None, smoothed_names: Mapping[str, str] | None = None,
                    smoothing_info: Mapping[str, object] | None = None) -> CalibrationTable:
    """Calibrate ``stage``'s graph (or reuse ``config.cache_file``, checked against the graph) into a table.

    ``tensors`` defaults to the activation inputs of MatMuls with constant weights. Save the result with
    :meth:`CalibrationTable.save`.

    ``smoothing`` (SmoothQuant): a function from the tensors' per-channel ranges to per-channel factors ``s``;
    the table then holds the ranges of ``x / s`` under ``smoothed_names[x]`` (default: the same name) and the
    factors (``table.smoothing``, with ``smoothing_info`` such as the alpha). One pass over the graph collects
    the per-channel ranges; minmax ranges of ``x / s`` follow from them exactly, percentile and entropy take a
    second pass (over the fp32 graph, dividing each batch by ``s``). A reused table must hold factors for every
    tensor when smoothing, and none when not.
    """
    from trtinfer.stage_weights import materialized

    config = config or CalibrationConfig()
    stage = stage if isinstance(stage, StageDir) else read_stage(stage)
    with materialized(stage) as runnable:  # ONNX Runtime reads weights from files: the checkpoint's, written out
        return _calibrate_stage(runnable, config, tensors, progress, smoothing, smoothed_names, smoothing_info)


def _calibrate_stage(stage: StageDir, config: CalibrationConfig, tensors: Sequence[str] | None, progress: bool,
                     smoothing: Smoothing | None, smoothed_names: Mapping[str, str] | None,
                     smoothing_info: Mapping[str, object] | None) -> CalibrationTable:
    names = list(tensors) if tensors is not None else weight_matmul_inputs(stage)
    renamed = {t: (smoothed_names or {}).get(t, t) for t in names} if smoothing else {t: t for t in names}
    ghash = graph_hash(stage)
    if config.cache_file is not None:
        table = load_table(config.cache_file)
        table.check(ghash)  # the graph first, then the smoothing, then the names (which smoothing renames)
        _check_smoothing(table, config.cache_file, names, renamed, smoothing is not None)
        table.check(ghash, [renamed[t] for t in names])
        log.info("reusing calibration %s (%d tensors, %s)", config.cache_file, len(table.ranges), table.method)
        return table
    cset = stage_calibration_set(stage, config.source, num_samples=config.num_samples, seq_len=config.seq_len,
                                 decode_steps=config.decode_steps)
    if smoothing is None:
        ranges = calibrate(stage, cset, method=config.method, tensors=names, percentile=config.percentile,
                           progress=progress)
        return CalibrationTable(ranges, config.method, ghash, cset.dataset_hash, config.settings())
    channels = ChannelRangeCollector()
    calibrate(stage, cset, method="minmax", tensors=names, progress=progress, channel_ranges=channels)
    per_channel = channels.ranges()
    factors = smoothing(per_channel)
    if config.method == "minmax":
        smoothed = {t: per_channel[t].divided(factors[t]) for t in names}
    else:
        smoothed = calibrate(stage, cset, method=config.method, tensors=names, percentile=config.percentile,
                             progress=progress, channel_scales=factors)
    record = {**(smoothing_info or {}), "tensors": renamed,
              "factors": {t: [float(v) for v in factors[t]] for t in names}}
    return CalibrationTable({renamed[t]: smoothed[t] for t in names}, config.method, ghash, cset.dataset_hash,
                            config.settings(), record)


def _check_smoothing(table: CalibrationTable, path: str | Path, names: Sequence[str], renamed: Mapping[str, str],
                     smoothing: bool) -> None:
    """Refuse a reused table whose ranges belong to another smoothing than the one asked for (one line)."""
    sm = table.smoothing
    if not smoothing:
        if sm is not None:
            raise CalibrationError(f"{path} holds the ranges of SmoothQuant-smoothed activations (alpha "
                                   f"{sm.get('alpha')}); quantize with smoothing on, or calibrate again")
        return
    if sm is None:
        raise CalibrationError(f"{path} has no SmoothQuant factors (a TensorRT calibration.cache holds per-tensor "
                               "scales only); give the calibration.json saved with it, or turn smoothing off")
    bad = [t for t in names if sm["tensors"].get(t) != renamed[t] or t not in sm["factors"]
           or not all(math.isfinite(v) and v > 0 for v in sm["factors"][t])]
    if bad:
        raise CalibrationError(f"{path} lacks valid SmoothQuant factors for {len(bad)} tensor(s) this graph "
                               f"smooths: {', '.join(bad[:3])}; calibrate again")


__all__ = [
    "BUILTIN_TEXTS", "CACHE_NAME", "DEFAULT_TEXT", "EVAL_TEXT", "JSON_NAME", "TRT_VERSION",
    "CalibrationConfig", "CalibrationSet", "CalibrationTable", "Calibrator", "ChannelRange",
    "ChannelRangeCollector", "EntropyCalibrator",
    "MinMaxCalibrator", "PercentileCalibrator", "Smoothing", "StageFeeds", "TensorRange",
    "builtin_text", "calibrate", "calibrate_stage", "calibration_set", "calibrator_names", "collect",
    "entropy_threshold", "get_calibrator", "graph_hash", "iter_feeds", "load_table", "load_texts",
    "register_calibrator", "scale_hex", "stage_calibration_set", "weight_matmul_inputs",
]
