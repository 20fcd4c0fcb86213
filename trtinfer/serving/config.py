"""``ServeConfig``: every setting of ``trtinfer serve`` in one frozen, validated dataclass."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from trtinfer.errors import ConfigError
from trtinfer.runtime.config import PROVIDERS, RuntimeConfig, describe, is_int

if TYPE_CHECKING:
    from trtinfer.runtime.engine import Engine
    from trtinfer.runtime.request import Finished
    from trtinfer.runtime.scheduler import Scheduler


@dataclass(frozen=True)
class ServeConfig:
    """How the OpenAI-compatible server listens, whom it lets in, and how much it takes at once.

    ``host``/``port``: where uvicorn binds (loopback unless told otherwise; port 0 picks a free one).
    ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer <api_key>`` (else 401).
    ``model_name``: the name ``/v1/models`` lists and requests must give as ``model`` (default: the engine
    directory's name). ``max_queue``: sequences waiting for a batch slot before new requests get 429 (every request
    waits there a moment before a slot takes it, so at least 1); a request's sequences (prompts x ``n``) queue
    together, so one arriving while fewer wait is taken whole, whatever its size.
    ``max_body_bytes``: larger request bodies get 413. ``prefill_chunk``: prompt tokens a step may prefill (long
    prompts go in chunks between decode steps; in one call while others decode). ``max_n``: the most choices
    (``n``) one request may ask for.
    ``provider``, ``intra_op_threads``, ``prefill_graph``, ``huge_pages`` and ``spinning`` go to the engine's
    :class:`~trtinfer.runtime.config.RuntimeConfig`.
    ``max_slots``: requests decoded at once (default: the engine's max batch size, at most 8); ``max_model_len``:
    positions per request, prompt + output (default: the engine's max sequence length, at most 2048). Both size the
    KV cache the server reserves when it starts (slots x positions; e.g. 754 MiB for SmolLM2-135M at 8 x 2048).
    ``prefix_caching``: a request reuses the KV of the longest prompt prefix a batch row holds (see
    :mod:`trtinfer.runtime.scheduler`); False prefills every prompt whole. ``speculative_ngram`` K > 0: every
    request drafts up to K tokens from its own n-grams (prompt lookup, vLLM's ``ngram`` speculative method) and
    verifies them in one pass; the tokens are the same, faster where the output copies its context.
    ``chat_template``: the chat route's template instead of the model's: a jinja file, or a built-in one
    (``chatml-tools``, ``gemma3-tools``: the model families' formats with function calling, for ``tools``).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    model_name: str | None = None
    max_queue: int = 64
    max_body_bytes: int = 1 << 20
    prefill_chunk: int = 256
    max_n: int = 16
    provider: str = "cpu"
    intra_op_threads: int = 0
    max_slots: int | None = None
    max_model_len: int | None = None
    prefix_caching: bool = True
    speculative_ngram: int = 0
    chat_template: str | None = None
    prefill_graph: bool = True
    huge_pages: bool = True
    spinning: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.host, str) and self.host):
            raise ConfigError(f"host must be a host name or address, got {describe(self.host)}", field="host")
        check_ints(self, {"port": 0, "max_queue": 1, "max_body_bytes": 1, "prefill_chunk": 1, "max_n": 1,
                          "intra_op_threads": 0, "speculative_ngram": 0, "max_slots": 1, "max_model_len": 2},
                   optional=("max_slots", "max_model_len"))
        for name in ("prefix_caching", "prefill_graph", "huge_pages"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {describe(getattr(self, name))}", field=name)
        if self.port > 65535:
            raise ConfigError(f"port must be within 0..65535 (0: a free one), got {self.port}", field="port")
        for name in ("api_key", "model_name", "chat_template"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip() and value.isprintable()):
                raise ConfigError(f"{name} must be a non-empty printable string or None, got {describe(value)}",
                                  field=name)
        key = self.api_key
        if key is not None and not (key.isascii() and " " not in key and key == key.strip()):
            # HTTP clients (httpx, so openai's) refuse to send a header with edge whitespace or non-ASCII bytes
            raise ConfigError("api_key must be printable ASCII without spaces (clients cannot send others in an "
                              "Authorization header); check for a trailing newline or space", field="api_key")
        if self.provider not in PROVIDERS:
            raise ConfigError(f"provider must be one of {PROVIDERS}, got {describe(self.provider)}", field="provider")

    def runtime(self) -> RuntimeConfig:
        return RuntimeConfig(provider=self.provider, intra_op_threads=self.intra_op_threads,
                             prefill_graph=self.prefill_graph, huge_pages=self.huge_pages, spinning=self.spinning)

    def scheduler(self, engine: Engine, on_finish: Callable[[Finished], None] | None = None) -> Scheduler:
        """The batcher ``trtinfer serve`` runs ``engine`` with (not started): this config's queue, prefill chunk,
        prefix caching, and KV rows and positions for the engine (:meth:`slots_for`, :meth:`model_len_for`)."""
        from trtinfer.runtime.scheduler import Scheduler  # the loop's modules load with the engine, not the config

        m = engine.manifest
        return Scheduler(engine, max_queue=self.max_queue, prefill_chunk=self.prefill_chunk,
                         max_slots=self.slots_for(int(m.max_batch_size)),
                         max_model_len=self.model_len_for(int(m.max_seq_len)), on_finish=on_finish,
                         prefix_caching=self.prefix_caching)

    def slots_for(self, max_batch_size: int) -> int:
        """Rows of the server's KV cache: ``max_slots``, which may not pass the engine's max batch size, or the
        default (at most 8)."""
        _within("max_slots (--max-slots)", self.max_slots, max_batch_size, "max batch size", "--max-batch-size")
        return min(self.max_slots or 8, max_batch_size)

    def model_len_for(self, max_seq_len: int) -> int:
        """Positions of a row: ``max_model_len``, which may not pass the engine's, or the default (at most 2048)."""
        _within("max_model_len (--max-model-len)", self.max_model_len, max_seq_len, "max sequence length",
                "--max-seq-len")
        return min(self.max_model_len or 2048, max_seq_len)


def check_ints(config: Any, lows: dict[str, int], optional: tuple[str, ...] = ()) -> None:
    """Raise :class:`ConfigError` for the first field of ``config`` named in ``lows`` that is not an integer at least
    its low (or None, where ``optional`` names it)."""
    for name, low in lows.items():
        value, may_be_none = getattr(config, name), name in optional
        if not (is_int(value) and value >= low or may_be_none and value is None):
            raise ConfigError(f"{name} must be an integer >= {low}{' or None' * may_be_none}, got {describe(value)}",
                              field=name)


def _within(name: str, value: int | None, limit: int, what: str, flag: str) -> None:
    if value is not None and value > limit:
        raise ConfigError(f"{name} {value} exceeds the engine's {what} {limit}; ask for at most {limit}, or rebuild the "
                          f"engine with a larger {flag}", field=name.partition(" ")[0])
