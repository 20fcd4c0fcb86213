"""Other libraries' chatter during GGUF loading and the eager reference, shown only when logging asks for it.

transformers draws its "Converting and de-quantizing GGUF tensors" bar with plain ``tqdm`` (not its own switchable
one), and 5.x warns ``past_key_values is deprecated`` (a ``FutureWarning``) each time the eager model runs with a
cache. Both are noise to a user building an engine. :func:`quiet_third_party` hides them while the logger
``transformers`` does not emit warnings: the ``trtinfer`` CLI sets it to ERROR unless ``-v``; an application that
leaves transformers' logging at its default keeps seeing both.
"""
from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: transformers' deprecation of the ``past_key_values`` argument (the message starts with the quoted name)
PAST_KEY_VALUES_WARNING = r"`?past_key_values`? is deprecated"
#: modules that draw a bar with plain tqdm, bypassing ``transformers.utils.logging.disable_progress_bar``
_PLAIN_TQDM_MODULES = ("transformers.modeling_gguf_pytorch_utils",)


def third_party_verbose() -> bool:
    """True when the logging setup shows other libraries' warnings (the logger ``transformers`` emits WARNING)."""
    return logging.getLogger("transformers").isEnabledFor(logging.WARNING)


@contextmanager
def quiet_third_party() -> Iterator[None]:
    """Inside the block, without :func:`third_party_verbose`: no GGUF conversion bar, no ``past_key_values``
    FutureWarning. Everything changed is restored on exit."""
    if third_party_verbose():
        yield
        return
    patched: list[tuple[Any, Any]] = []
    for name in _PLAIN_TQDM_MODULES:
        module: Any = sys.modules.get(name)
        if module is None:  # import it now so the patch is in place before transformers uses it
            try:
                module = __import__(name, fromlist=["tqdm"])
            except ImportError:
                continue
        original = getattr(module, "tqdm", None)
        if original is not None:
            patched.append((module, original))
            module.tqdm = functools.partial(original, disable=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=PAST_KEY_VALUES_WARNING, category=FutureWarning)
            yield
    finally:
        for module, original in patched:
            module.tqdm = original
