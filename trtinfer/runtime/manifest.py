"""The engine directory's ``manifest.json``: what was built, how, and its limits. Read by the runtime."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trtinfer.errors import EngineLoadError

MANIFEST_NAME = "manifest.json"
MANIFEST_VERSION = 1


@dataclass(frozen=True)
class Manifest:
    """Parsed manifest; ``raw`` keeps every field for ``inspect``."""

    raw: dict[str, Any]

    @property
    def backend(self) -> str:
        """Backend name (``onnxruntime``)."""
        return str(self.raw["backend"])

    @property
    def geometry(self) -> dict[str, Any]:
        """Layers, KV heads, head dim, vocab, layer types."""
        return dict(self.raw["geometry"])

    @property
    def max_batch_size(self) -> int:
        """Largest batch the engine accepts."""
        return int(self.raw["limits"]["max_batch_size"])

    @property
    def max_seq_len(self) -> int:
        """Largest prompt + generated length."""
        return int(self.raw["limits"]["max_seq_len"])

    @property
    def files(self) -> dict[str, str]:
        """Role -> file name inside the engine directory."""
        return dict(self.raw["files"])


def kv_dtype(io: dict[str, Any]) -> str:
    """Element type of the KV cache (``float32``, ``float16`` or ``bfloat16``) from a graph's I/O listing."""
    past = [t for t in io["inputs"] if t["name"].startswith("past_key_values.")]
    return str(past[0]["dtype"]) if past else "float32"


def read_manifest(engine_dir: Path) -> Manifest:
    """Read and check ``engine_dir/manifest.json``."""
    path = Path(engine_dir) / MANIFEST_NAME
    if not Path(engine_dir).is_dir():
        raise EngineLoadError(f"engine directory {engine_dir} does not exist; build one with `trtinfer build`")
    if not path.is_file():
        raise EngineLoadError(f"{engine_dir} has no {MANIFEST_NAME}: not an engine directory (build one with `trtinfer build`)")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:
        raise EngineLoadError(f"{path} is not valid JSON ({e}); rebuild the engine") from e
    if raw.get("manifest_version") != MANIFEST_VERSION:
        raise EngineLoadError(
            f"{path} has manifest version {raw.get('manifest_version')}, this trtinfer reads {MANIFEST_VERSION}; "
            "rebuild the engine"
        )
    for key in ("backend", "geometry", "limits", "files", "io"):
        if key not in raw:
            raise EngineLoadError(f"{path} lacks '{key}'; rebuild the engine")
    for role, name in raw["files"].items():
        if not (Path(engine_dir) / name).is_file():
            raise EngineLoadError(f"engine file {name} ({role}) is missing from {engine_dir}; rebuild the engine")
    return Manifest(raw)
