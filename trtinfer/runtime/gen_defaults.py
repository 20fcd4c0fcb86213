"""Generation defaults from an engine's ``generation_config.json`` (the model's, copied in at build time).

transformers reads that file to fill every ``generate`` option the caller leaves out; so does trtinfer. Fields are
mapped to :class:`GenerationConfig` names; a field the runtime has no use for (``max_length``, ``use_cache``, ids
handled by the tokenizer) is ignored; a value :class:`GenerationConfig` refuses is logged and left at its default,
so a model's odd file never stops an engine from loading.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from trtinfer.errors import ConfigError
from trtinfer.runtime.config import GenerationConfig

log = logging.getLogger(__name__)

#: generation_config.json key -> GenerationConfig field (same name unless said)
FIELDS = ("max_new_tokens", "min_new_tokens", "do_sample", "temperature", "top_k", "top_p", "min_p",
          "repetition_penalty", "no_repeat_ngram_size", "num_beams", "length_penalty", "early_stopping",
          "num_return_sequences", "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens",
          "num_assistant_tokens_schedule")


def read_generation_defaults_and_keys(engine_dir: Path) -> tuple[GenerationConfig, frozenset[str]]:
    """The engine's defaults (:class:`GenerationConfig` with the fields its ``generation_config.json`` sets) and the
    names of the fields the file really set (servers that follow vLLM apply only those, not transformers' own
    defaults such as ``top_k=50``)."""
    path = Path(engine_dir) / "generation_config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        log.warning("ignoring %s (%s); generation uses transformers' defaults", path, e)
        raw = {}
    chosen = {k: raw[k] for k in FIELDS if raw.get(k) is not None} if isinstance(raw, dict) else {}
    cfg = GenerationConfig()
    taken = set()
    for name, value in chosen.items():  # one at a time: a bad field costs only itself
        try:
            cfg = dataclasses.replace(cfg, **{name: value})
            taken.add(name)
        except ConfigError as e:
            log.warning("ignoring %s=%r from %s: %s", name, value, path, e)
    if chosen:
        log.debug("generation defaults from %s: %s", path, chosen)
    return cfg, frozenset(taken)
