"""Saved calibrations: ``calibration.json`` (ours, keyed by graph and data set) and ``calibration.cache`` (TensorRT's).

``calibration.json``::

    {"format": 1, "kind": "trtinfer-calibration", "method": "entropy", "graph_hash": "<sha256>",
     "dataset_hash": "<sha256>", "settings": {...}, "tensors": {"<name>": {"min": .., "max": .., "amax": ..}},
     "smoothing": {"alpha": 0.5, "tensors": {"<fp32 name>": "<smoothed name>"}, "factors": {"<fp32 name>": [..]}}}

``smoothing`` (optional) is there when the ranges are those of SmoothQuant's smoothed activations ``x / s``: the
ranges are then keyed by the smoothed tensors' names (what the written graph quantizes), and the per-channel
factors ``s`` of each fp32 tensor are kept so a reuse rebuilds the same graph. A TensorRT table cannot hold them.

``calibration.cache`` is TensorRT's text calibration table, which ONNX Runtime's TensorRT execution provider
(``trt_int8_use_native_calibration_table``) and NVIDIA ModelOpt read::

    TRT-100100-EntropyCalibration2
    <tensor name>: <hex of the big-endian float32 scale = amax / 127>

The header's number is TensorRT's version as ``NV_TENSORRT_VERSION`` spells it (major * 10000 + minor * 100 +
patch): 100100 is TensorRT 10.1.0, the release that deprecated implicit calibration in favour of QDQ; the
number only labels the table. The algorithm names TensorRT knows are ``EntropyCalibration2``,
``EntropyCalibration``, ``MinMaxCalibration`` and ``LegacyCalibration``; TensorRT has no percentile
calibrator, so percentile ranges are written as ``MinMaxCalibration`` (the scales are final: ONNX Runtime's
reader checks only the ``TRT-`` prefix and ModelOpt skips the header line).
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trtinfer.artifact import DATA_NAME, ONNX_NAME, StageDir
from trtinfer.calibration.calibrators import TensorRange
from trtinfer.errors import CalibrationError, OutputError

log = logging.getLogger(__name__)

JSON_NAME = "calibration.json"
CACHE_NAME = "calibration.cache"
TABLE_FORMAT = 1
#: TensorRT 10.1.0 as NV_TENSORRT_VERSION writes it
TRT_VERSION = 100100
#: calibration method -> TensorRT algorithm name in the table header
TRT_ALGORITHMS = {"entropy": "EntropyCalibration2", "minmax": "MinMaxCalibration", "percentile": "MinMaxCalibration"}
_METHOD_OF_ALGO = {"EntropyCalibration2": "entropy", "EntropyCalibration": "entropy", "MinMaxCalibration": "minmax",
                   "LegacyCalibration": "legacy"}
#: the smallest scale written: TensorRT refuses a zero dynamic range (an all-zero tensor)
_MIN_SCALE = 1.1754944e-38


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def graph_hash(model: str | Path | StageDir) -> str:
    """sha256 over the graph file and its external data (by each file's sha256; a stage's recorded hashes are
    reused, so a stage and its ``model.onnx`` path give the same hash)."""
    if isinstance(model, StageDir):
        files = model.info["files"]
        digests = {n: files[n]["sha256"] for n in (ONNX_NAME, DATA_NAME) if n in files}
    else:
        import onnx

        path = Path(model)
        proto = onnx.load(str(path), load_external_data=False)
        names = {e.value for i in proto.graph.initializer for e in i.external_data if e.key == "location"}
        digests = {ONNX_NAME: _sha256_file(path)}
        digests.update({DATA_NAME if n == path.name + ".data" else n: _sha256_file(path.parent / n) for n in names})
    return hashlib.sha256(json.dumps(sorted(digests.items())).encode()).hexdigest()


def scale_hex(amax: float) -> str:
    """The table's text for ``amax``: big-endian float32 bits of ``amax / 127`` (127 -> ``3f800000``)."""
    scale = max(float(amax) / 127.0, _MIN_SCALE)
    return struct.pack(">f", scale).hex()


def hex_amax(text: str) -> float:
    """Inverse of :func:`scale_hex`: ``amax = scale * 127``."""
    return float(struct.unpack(">f", bytes.fromhex(text.strip().zfill(8)))[0]) * 127.0


@dataclass(frozen=True)
class CalibrationTable:
    """Per-tensor ranges with what they were computed for: the graph, the data set, the method and settings."""

    ranges: dict[str, TensorRange]
    method: str
    graph_hash: str = ""
    dataset_hash: str = ""
    settings: dict[str, Any] = field(default_factory=dict)
    smoothing: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The ``calibration.json`` content."""
        d = {"format": TABLE_FORMAT, "kind": "trtinfer-calibration", "method": self.method,
             "graph_hash": self.graph_hash, "dataset_hash": self.dataset_hash, "settings": self.settings,
             "tensors": {n: r.to_dict() for n, r in self.ranges.items()}}
        if self.smoothing is not None:
            d["smoothing"] = self.smoothing
        return d

    def to_trt(self, trt_version: int = TRT_VERSION) -> str:
        """The ``calibration.cache`` text (TensorRT's calibration table)."""
        algo = TRT_ALGORITHMS.get(self.method, "MinMaxCalibration")
        lines = [f"TRT-{trt_version}-{algo}"]
        lines += [f"{name}: {scale_hex(r.amax)}" for name, r in self.ranges.items()]
        return "\n".join(lines) + "\n"

    def save(self, folder: str | Path) -> tuple[Path, Path]:
        """Write ``calibration.json`` and ``calibration.cache`` into ``folder``; returns their paths."""
        out = Path(folder)
        try:
            out.mkdir(parents=True, exist_ok=True)
            js, cache = out / JSON_NAME, out / CACHE_NAME
            js.write_text(json.dumps(self.to_json(), indent=1), encoding="utf-8")
            cache.write_text(self.to_trt(), encoding="utf-8")
        except OSError as e:
            err = OutputError(f"cannot write the calibration into {out}: {e.strerror or e}")
            err.path = str(out)
            raise err from None
        log.info("calibration of %d tensors saved to %s and %s", len(self.ranges), js, cache)
        return js, cache

    def check(self, graph: str, tensors: Sequence[str] = ()) -> None:
        """Refuse (one line) a table computed for another graph, or one lacking some of ``tensors``.

        A TensorRT ``.cache`` table has no graph hash: then only the tensor names can be checked.
        """
        if self.graph_hash and self.graph_hash != graph:
            raise CalibrationError(
                f"the calibration cache was computed for another graph (hash {self.graph_hash[:12]}, this graph is "
                f"{graph[:12]}); calibrate again or give the cache computed for this graph")
        missing = [t for t in tensors if t not in self.ranges]
        if missing:
            more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
            raise CalibrationError(f"the calibration cache lacks {len(missing)} tensor(s) this graph needs: "
                                   f"{', '.join(missing[:3])}{more}; calibrate again")


def _read_json(path: Path, text: str) -> CalibrationTable:
    try:
        d = json.loads(text)
        if d.get("kind") != "trtinfer-calibration":
            raise ValueError("not a trtinfer calibration")
        if d.get("format") != TABLE_FORMAT:
            raise CalibrationError(f"{path} has format {d.get('format')}, this trtinfer reads {TABLE_FORMAT}; "
                                   "calibrate again")
        ranges = {n: TensorRange(float(r["min"]), float(r["max"]), float(r["amax"])) for n, r in d["tensors"].items()}
        smoothing = d.get("smoothing")
        if smoothing is not None and not (isinstance(smoothing.get("factors"), dict)
                                          and isinstance(smoothing.get("tensors"), dict)):
            raise ValueError("its smoothing entry lacks factors or tensors")
        return CalibrationTable(ranges, str(d["method"]), str(d["graph_hash"]), str(d["dataset_hash"]),
                                dict(d.get("settings", {})), smoothing)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, CalibrationError):
            raise
        raise CalibrationError(f"{path} is not a trtinfer calibration.json ({e}); calibrate again") from None


def _read_trt(path: Path, text: str) -> CalibrationTable:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    header = lines[0] if lines else ""
    parts = header.split("-", 2)
    if len(parts) != 3 or parts[0] != "TRT":
        raise CalibrationError(f"{path} does not start with a TensorRT calibration header (TRT-<version>-<algo>), "
                               f"found {header[:40]!r}")
    ranges = {}
    for n, line in enumerate(lines[1:], 2):
        name, sep, value = line.rpartition(":")
        try:
            amax = hex_amax(value)
        except (ValueError, struct.error):
            amax = math.nan
        if not sep or not name or not math.isfinite(amax):
            raise CalibrationError(f"{path} line {n} is not '<tensor>: <8 hex digits>': {line[:60]!r}")
        ranges[name.strip()] = TensorRange(-amax, amax, amax)
    return CalibrationTable(ranges, _METHOD_OF_ALGO.get(parts[2], parts[2]), settings={"trt_header": header})


def load_table(path: str | Path) -> CalibrationTable:
    """Read a saved calibration: a ``calibration.json``, a TensorRT ``.cache`` table, or a folder holding either
    (``calibration.json`` preferred). From a TensorRT table only the scales are known: ``min = -amax``."""
    p = Path(path)
    if p.is_dir():
        found = [p / n for n in (JSON_NAME, CACHE_NAME) if (p / n).is_file()]
        if not found:
            raise CalibrationError(f"{p} holds neither {JSON_NAME} nor {CACHE_NAME}; give the calibration file")
        p = found[0]
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrationError(f"calibration cache {p} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"calibration cache {p} is unreadable ({e})") from None
    table = _read_json(p, text) if text.lstrip().startswith("{") else _read_trt(p, text)
    if not table.ranges:
        raise CalibrationError(f"calibration cache {p} holds no tensor ranges; calibrate again")
    return table
