"""The tokenizer files an engine needs, taken from the model folder at export time (transformers only here)."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

from trtinfer._outputs import link_into
from trtinfer.errors import ExportError, ModelSourceError
from trtinfer.stages import TOKENIZER_FILES

log = logging.getLogger(__name__)


def _in_cache(folder: Path) -> bool:
    """True if ``folder`` lies in trtinfer's cache (where a stage is made in a temporary folder, then renamed)."""
    from trtinfer._cache import cache_path

    return folder.resolve().is_relative_to(cache_path().resolve())


def save_tokenizer(src: Path, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files of ``src`` into ``out``; return BOS/EOS/PAD as transformers' ``generate`` uses them.

    Into the cache they are hard links to the model folder's files where allowed (:func:`link_into`: no second copy
    of a 10 MB ``tokenizer.json`` per model; a cache entry is never edited, and one whose file changed through the
    model folder fails its stamp check and is made again); a folder the user asked for gets copies, which they edit.
    A slow tokenizer is converted to ``tokenizer.json`` (the torch-free runtime reads only that); a chat template
    held in ``tokenizer_config.json`` is also written to ``chat_template.jinja``.
    """
    from transformers import AutoTokenizer, GenerationConfig

    try:
        tok = AutoTokenizer.from_pretrained(src)
    except Exception as e:  # transformers raises anything from a broken file (JSONDecodeError, OSError, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelSourceError(f"cannot read the tokenizer in {src} ({type(e).__name__}: {first}); a model folder "
                               "needs its tokenizer files (tokenizer.json or a slow tokenizer's files): re-download "
                               "them") from e
    if not (src / "tokenizer.json").is_file():
        tok.save_pretrained(out)  # a slow tokenizer gets converted to tokenizer.json here
    if tok.chat_template and not (src / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(tok.chat_template)
    link = _in_cache(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (out / name).exists() and not (link and link_into(src / name, out / name)):
            shutil.copyfile(src / name, out / name)
    for extra in ("vocab.json", "merges.txt", "tokenizer.model", "vocab.txt", "added_tokens.json"):
        if (out / extra).exists():  # left by save_pretrained; the runtime reads tokenizer.json only
            (out / extra).unlink()
    if (out / "chat_template.jinja").is_file():  # a broken one would first show at a chat request, months later
        from trtinfer.errors import InputError
        from trtinfer.runtime.tokenizer import load_chat_template

        try:
            load_chat_template(str(out / "chat_template.jinja"))
        except InputError as e:
            log.warning("the model's chat template is not usable (%s): its engines will refuse chat requests until "
                        "chat_template.jinja is fixed in the model folder or the engine", e)
    if not (out / "tokenizer.json").is_file():
        raise ExportError(f"{src} has no fast tokenizer (tokenizer.json) and none could be made; the runtime needs one")
    try:
        eos = GenerationConfig.from_pretrained(src).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tok.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    return {"bos_token": tok.bos_token, "eos_token": tok.eos_token, "bos_token_id": tok.bos_token_id,
            "eos_token_ids": eos_ids, "pad_token_id": pad, "chat_template": bool(tok.chat_template)}
