"""Flags -> configs for the CLI verbs: errors come back under the flag's name, checked before anything loads."""
from __future__ import annotations

import argparse
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from trtinfer.errors import ConfigError

T = TypeVar("T")

# config field -> the flag that sets it
GENERATION_FLAGS = {
    "max_new_tokens": "--max-new-tokens", "min_new_tokens": "--min-new-tokens", "do_sample": "--sample",
    "temperature": "--temperature", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty", "no_repeat_ngram_size": "--no-repeat-ngram-size", "seed": "--seed",
    "stop": "--stop", "num_beams": "--num-beams", "length_penalty": "--length-penalty",
    "early_stopping": "--early-stopping", "num_return_sequences": "--num-return-sequences",
    "prompt_lookup_num_tokens": "--prompt-lookup-num-tokens", "logprobs": "--logprobs",
    "top_logprobs": "--top-logprobs", "num_assistant_tokens": "--num-assistant-tokens",
}
RUNTIME_FLAGS = {"provider": "--provider", "prefill_graph": "--prefill-graph", "huge_pages": "--huge-pages"}
#: :data:`trtinfer.runtime.config.PROVIDERS`, written here so that parsing the command line loads no runtime (numpy
#: and the rest come with the verb that runs); tests/cli holds the two equal
PROVIDER_CHOICES = ("cpu", "cuda", "tensorrt")


def add_provider_flag(parser: argparse.ArgumentParser, default: str | None = "cpu", help: str | None = None) -> None:
    """``--provider`` (``RuntimeConfig.provider``) on a verb that loads an engine; ``default`` None where the verb's
    config (or the engine) chooses."""
    parser.add_argument("--provider", choices=PROVIDER_CHOICES, default=default, help=help)


def add_cpu_runtime_flags(parser: argparse.ArgumentParser, prefill_graph: bool | None = True,
                          huge_pages: bool | None = False, spinning: bool | None = True) -> None:
    """``--prefill-graph/--no-prefill-graph``, ``--huge-pages/--no-huge-pages`` and ``--spinning/--no-spinning``
    (``RuntimeConfig.prefill_graph``, ``.huge_pages``, ``.spinning``) on a verb that loads a decoder engine, with the
    verb's defaults (None where the verb's config holds them). Huge pages are off by default for one-off verbs:
    moving the packed weights costs ~2.6 s per GiB at load, more than a few hundred decoded tokens gain (Gemma-3-270M
    fp32, 48 tokens: 8.4 s against 5.3-5.9 s)."""
    parser.add_argument("--prefill-graph", action=argparse.BooleanOptionalAction, default=prefill_graph,
                        help="CPU: run prompts on the engine's int8 prefill graph where it has one (`build --prefill "
                             "int8`); --no-prefill-graph runs every pass on the decoder graph (default: on)")
    parser.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=huge_pages,
                        help="CPU: move the weights ONNX Runtime packs at load onto 2 MiB pages (Linux 6.1+, "
                             "transparent huge pages in 'madvise' mode): decode 3-11%% faster, the load ~2.6 s "
                             "longer per GiB packed (default: on for serve, off for generate and eval)")
    parser.add_argument("--spinning", action=argparse.BooleanOptionalAction, default=spinning,
                        help="CPU: ONNX Runtime's workers spin between the parallel sections of a run; "
                             "--no-spinning lets them sleep, leaving the cores to other work (a load client or "
                             "other services on the same cores: int4 served 12%% more tokens/s on 2 cores; alone, "
                             "its decode ~8%% slower) (default: on)")


def config_from_flags(factory: Callable[..., T], flags: Mapping[str, str], **values: object) -> T:
    """``factory(**values)``; a :class:`ConfigError` about a field is re-raised in the words of its flag.

    ``temperature must be > 0, got -1.0`` becomes ``--temperature must be > 0, got -1.0``; the field that opens the
    message and every other field name with an underscore in it (``min_tokens must be <= max_tokens``) is renamed,
    so cross-field messages read in flags too, while plain words (``host must be a host name``) stay words.
    """
    try:
        return factory(**values)
    except ConfigError as e:
        if e.field not in flags:
            raise
        names = re.compile(r"\b(" + "|".join(re.escape(f) for f in sorted(flags, key=len, reverse=True)) + r")\b")
        text = str(e)
        said = names.sub(lambda m: flags[m.group(1)] if m.start() == 0 or "_" in m.group(1) else m.group(0), text)
        said = said.replace(" or None", "")  # the Python API's "unset"; a flag left out is that
        raise ConfigError(said, field=e.field) from e


def check_text_flag(flag: str, values: Sequence[str] | None) -> None:
    """Raise InputError naming ``flag`` and its occurrence (1-based) when a value is not valid UTF-8.

    Bytes that are not UTF-8 reach ``sys.argv`` as lone surrogates; the tokenizer would fail on them later.
    """
    from trtinfer.runtime.tokenizer import check_text

    for i, value in enumerate(values or (), start=1):
        check_text(value, f"{flag} {i}", fix="pass UTF-8 text")


def path_arg(text: str) -> str:
    """An argparse ``type`` for paths: an empty one would mean the current folder (``Path("")`` is ``.``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a file or folder")
    return text
