"""Calibration data: texts -> token windows -> prefill and teacher-forced decode feeds with a real KV cache.

A calibration sample is a window of ``seq_len + decode_steps`` consecutive tokens of the text. Its first
``seq_len`` tokens are one prefill feed; each of the next ``decode_steps`` tokens is one decode feed whose KV cache
is what the graph itself produced for the tokens before it (teacher forcing), so the ranges seen include the
decode-time activations (one query row against a long cache), not only the prefill ones::

    text ── tokenize ── | t0 t1 ... t(S-1) | tS | tS+1 | ... |      (one window, S = seq_len)
                          └─ prefill feed ─┘  └ decode feeds ┘
                                 │ present.*  ─> past.* ─> present.* ─> ...

Feeds are built from the stage's recorded graph inputs (``StageDir.io``), so both KV contracts work:
``shared_buffer`` (``seqlens_k``, ``total_sequence_length``, one zeroed buffer of capacity ``S + decode_steps``),
``scatter_buffer`` (the tensorrt target: positions only, zeroed buffers of the graph's static slot count) and
``concat`` (``attention_mask``, growing ``past_key_values.*``). An optional ``position_ids`` or
``logits_positions`` input is fed when the graph has it.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer._files import read_text_file
from trtinfer.artifact import StageDir, TensorSpec
from trtinfer.errors import CalibrationError

log = logging.getLogger(__name__)

#: the shipped texts (see ``texts/README.md``): name -> file
BUILTIN_TEXTS = {"gfdl-1.3": "gfdl-1.3.txt", "gpl-3.0": "gpl-3.0.txt"}
#: the default calibration text (the GNU Free Documentation License 1.3)
DEFAULT_TEXT = "gfdl-1.3"
#: the held-out evaluation text (the GNU GPL v3), never used for calibration by default
EVAL_TEXT = "gpl-3.0"
#: bumps when windows are cut differently, so old dataset hashes no longer match
DATA_FORMAT = 1

_NUMPY = {"float32": np.float32, "float16": np.float16, "int32": np.int32, "int64": np.int64}


def builtin_text(name: str) -> str:
    """The shipped text ``name`` (one of :data:`BUILTIN_TEXTS`)."""
    if name not in BUILTIN_TEXTS:
        raise CalibrationError(f"no built-in text {name!r}; known: {', '.join(sorted(BUILTIN_TEXTS))}")
    return (resources.files("trtinfer.calibration") / "texts" / BUILTIN_TEXTS[name]).read_text(encoding="utf-8")


def load_texts(source: str | Path | None) -> list[str]:
    """Read calibration texts: ``None`` -> the default built-in text; ``builtin:NAME`` -> a shipped text;
    ``*.jsonl`` -> one JSON object per line with ``"text"`` or ``"prompt"`` (or a plain JSON string);
    any other path -> one UTF-8 text file.

    Raises :class:`CalibrationError` (one line) when the file is missing, unreadable, not UTF-8, a JSONL line is
    bad (the line number is given) or no text is found.
    """
    if source is None:
        return [builtin_text(DEFAULT_TEXT)]
    if isinstance(source, str) and source.startswith("builtin:"):
        return [builtin_text(source.split(":", 1)[1])]
    path = Path(source)
    text = read_text_file(path, "calibration data", "give a text or JSONL file, or none for the built-in text",
                          CalibrationError)
    texts = _parse_jsonl(path, text) if path.suffix.lower() == ".jsonl" else [text]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError(f"calibration data {path} is empty: it holds no text")
    return texts


def _parse_jsonl(path: Path, text: str) -> list[str]:
    """One text per non-blank line: ``{"text": ...}``, ``{"prompt": ...}`` or ``"..."``."""
    texts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{path} line {n} is not JSON ({e.msg}); each line must be "
                                   '{"text": "..."}, {"prompt": "..."} or a JSON string') from None
        if isinstance(obj, dict):
            obj = obj.get("text", obj.get("prompt"))
        if not isinstance(obj, str):
            raise CalibrationError(f'{path} line {n} has no "text" or "prompt" string; each line must be '
                                   '{"text": "..."}, {"prompt": "..."} or a JSON string')
        texts.append(obj)
    return texts


@dataclass(frozen=True)
class CalibrationSet:
    """Token windows for calibration: each holds ``seq_len`` prompt tokens then ``decode_steps`` decode tokens."""

    windows: tuple[tuple[int, ...], ...]
    seq_len: int
    decode_steps: int
    source: str
    dataset_hash: str = field(default="")

    def __post_init__(self) -> None:
        if not self.dataset_hash:
            object.__setattr__(self, "dataset_hash", hash_windows(self.windows, self.seq_len, self.decode_steps))

    def __len__(self) -> int:
        return len(self.windows)

    @property
    def num_feeds(self) -> int:
        """Graph runs the set makes: one prefill and ``decode_steps`` decodes per window."""
        return len(self.windows) * (1 + self.decode_steps)


def hash_windows(windows: Sequence[Sequence[int]], seq_len: int, decode_steps: int) -> str:
    """sha256 over the token ids and the settings that shaped them."""
    h = hashlib.sha256(json.dumps({"format": DATA_FORMAT, "seq_len": seq_len,
                                   "decode_steps": decode_steps}).encode())
    for w in windows:
        h.update(np.asarray(w, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def _special_prefix(tok: Any) -> list[int]:
    """Ids the tokenizer puts before a text when it adds special tokens (a BOS, or nothing)."""
    with_special = tok.encode("x", add_special_tokens=True).ids
    plain = tok.encode("x", add_special_tokens=False).ids
    for i in range(len(with_special) - len(plain) + 1):
        if with_special[i:i + len(plain)] == plain:
            return list(with_special[:i])
    return []


def calibration_set(tokenizer_json: str | Path, source: str | Path | None, *, num_samples: int, seq_len: int,
                    decode_steps: int) -> CalibrationSet:
    """Tokenize ``source`` (see :func:`load_texts`) into ``num_samples`` windows, spread evenly over the text.

    The texts are tokenized and joined into one token stream; each window is the tokenizer's special prefix (a
    BOS where ``tokenizer(text)`` adds one) followed by consecutive stream tokens, as ``tokenizer(window_text)``
    would give. Windows do not overlap. Raises :class:`CalibrationError` when the text is too short.
    """
    from tokenizers import Tokenizer

    if num_samples < 1 or seq_len < 1 or decode_steps < 0:
        raise CalibrationError(f"need num_samples >= 1, seq_len >= 1, decode_steps >= 0; got {num_samples}, "
                               f"{seq_len}, {decode_steps}")
    texts = load_texts(source)
    tok = Tokenizer.from_file(str(tokenizer_json))
    prefix = _special_prefix(tok)
    stream: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        stream.extend(enc.ids)
    width = seq_len + decode_steps - len(prefix)
    if width < 1:
        raise CalibrationError(f"seq_len + decode_steps = {seq_len + decode_steps} leaves no room for text after "
                               f"the tokenizer's {len(prefix)} special tokens")
    need = num_samples * width
    name = "the built-in text" if source is None else str(source)
    if len(stream) < need:
        raise CalibrationError(
            f"calibration data {name} is too short: {num_samples} samples of {seq_len}+{decode_steps} tokens need "
            f"{need} tokens, it has {len(stream)}; give a longer text or fewer/shorter samples")
    step = (len(stream) - width) // (num_samples - 1) if num_samples > 1 else 0
    windows = tuple(tuple(prefix + stream[i * step:i * step + width]) for i in range(num_samples))
    log.info("calibration set: %d windows of %d+%d tokens from %s (%d tokens)", num_samples, seq_len,
             decode_steps, name, len(stream))
    return CalibrationSet(windows, seq_len, decode_steps, name)


def stage_calibration_set(stage: StageDir, source: str | Path | None, *, num_samples: int, seq_len: int,
                          decode_steps: int) -> CalibrationSet:
    """:func:`calibration_set` with ``stage``'s tokenizer, its windows shortened to the longest sequence the stage's
    graph takes (its optimize config's ``max_seq_len``: the rotary tables end there), decode steps kept."""
    limit = stage.history.get("optimize", {}).get("config", {}).get("max_seq_len")
    if limit is not None and seq_len + decode_steps > int(limit):
        steps = min(decode_steps, int(limit) - 1)
        log.info("calibration windows of %d+%d tokens shortened to %d+%d: the graph takes %d tokens", seq_len,
                 decode_steps, int(limit) - steps, steps, int(limit))
        seq_len, decode_steps = int(limit) - steps, steps
    return calibration_set(stage.path / "tokenizer.json", source, num_samples=num_samples, seq_len=seq_len,
                           decode_steps=decode_steps)


# --- feeds --------------------------------------------------------------------------------------------------------

def _dtype(spec: TensorSpec) -> Any:
    name = spec.dtype
    if name not in _NUMPY:
        raise CalibrationError(f"graph input {spec.name} is {name}; calibration feeds float32/float16/int32/int64 "
                               f"inputs only: calibrate the fp32 (or fp16) graph")
    return _NUMPY[name]


def kv_names(stage: StageDir) -> tuple[list[str], list[str]]:
    """Past inputs and the matching present outputs, in graph order."""
    past = [t.name for t in stage.io.past]
    present = ["present." + p[len("past_key_values."):] for p in past]
    outs = set(stage.io.output_names)
    missing = [p for p in present if p not in outs]
    if missing:
        raise CalibrationError(f"{stage.onnx_path} has no output {missing[0]} for its input "
                               f"past_key_values.{missing[0][len('present.'):]}; not a trtinfer decoder graph")
    return past, present


def _step_feeds(stage: StageDir, ids: np.ndarray, done: int, capacity: int,
                all_logits: bool = False) -> dict[str, np.ndarray]:
    """Feeds other than the KV for one step of ``ids`` (batch 1) after ``done`` tokens already in the cache.

    ``all_logits``: ask for the logits of every position (``logits_positions``), so the LM head's input is seen
    at every token, not only the last one (GPTQ's LM-head statistics need the rows).
    """
    n = ids.shape[1]
    specs = {t.name: t for t in stage.io.inputs}
    known: dict[str, Callable[[], np.ndarray]] = {
        "input_ids": lambda: ids,
        "position_ids": lambda: np.arange(done, done + n)[None, :],
        "attention_mask": lambda: np.ones((1, done + n)),
        "seqlens_k": lambda: np.array([done + n - 1]),
        "total_sequence_length": lambda: np.array(done + n),
        "logits_positions": lambda: np.arange(n)[None, :] if all_logits else np.array([[n - 1]]),
    }
    feeds = {}
    for name, spec in specs.items():
        if name.startswith("past_key_values."):
            continue
        if name not in known:
            raise CalibrationError(f"{stage.onnx_path} has an input {name} calibration does not know how to feed; "
                                   f"known: {', '.join(known)}")
        value = np.asarray(known[name](), dtype=_dtype(spec))
        if len(spec.shape) == 1 and value.ndim == 0:  # a [1]-shaped scalar input
            value = value.reshape(1)
        feeds[name] = value
    return feeds


def iter_feeds(stage: StageDir, cset: CalibrationSet, session: Any = None,
               on_outputs: Callable[[dict[str, np.ndarray], dict[str, np.ndarray]], None] | None = None,
               all_logits: bool = False) -> Iterator[dict[str, np.ndarray]]:
    """Yield each window's prefill feed, then its ``decode_steps`` teacher-forced decode feeds.

    Every feed is run on ``session`` (an ``onnxruntime.InferenceSession`` over the stage's graph, or over that
    graph with extra outputs, or one piece of the graph (:mod:`trtinfer.calibration.pieces`: only its layers'
    ``present.*``); a CPU session on ``stage.onnx_path`` when None) because the next feed's KV cache is this one's
    ``present.*``. ``on_outputs(feed, outputs)`` receives every run's named outputs, so a caller that
    needs them (calibration, on a session with extra outputs) runs each feed once.
    """
    if session is None:
        from trtinfer.runtime.memory import stage_session_options
        from trtinfer.runtime.page_out import cpu_session
        from trtinfer.stage_weights import materialized_file

        with materialized_file(stage.onnx_path) as whole:  # the session keeps what it read after the copy is gone
            session = cpu_session(str(whole), stage_session_options(whole), whole.parent)
    past, present = kv_names(stage)
    specs = {t.name: t for t in stage.io.inputs}
    geo = stage.geometry
    out_names = [o.name for o in session.get_outputs()]
    shared = stage.kv_layout == "shared_buffer"
    fixed = int(specs[past[0]].shape[2]) if stage.kv_layout == "scatter_buffer" and past else 0  # static slots
    if fixed and cset.seq_len + cset.decode_steps > fixed:
        raise CalibrationError(f"calibration windows of {cset.seq_len + cset.decode_steps} tokens do not fit the "
                               f"graph's {fixed} KV slots; use a shorter sequence length or fewer decode steps")
    for window in cset.windows:
        ids = np.asarray(window, dtype=np.int64)[None, :]
        capacity = fixed or (ids.shape[1] if shared else 0)
        kv = {p: np.zeros((1, geo["num_kv_heads"], capacity, geo["head_dim"]), _dtype(specs[p])) for p in past}
        done = 0
        steps = [(0, cset.seq_len)] + [(cset.seq_len + k, cset.seq_len + k + 1) for k in range(cset.decode_steps)]
        for start, stop in steps:
            feed = {**_step_feeds(stage, ids[:, start:stop], done, capacity, all_logits), **kv}
            yield feed
            outputs = dict(zip(out_names, session.run(None, feed)))
            if on_outputs is not None:
                on_outputs(feed, outputs)
            kv = {p: outputs.get(q, kv[p]) for p, q in zip(past, present)}
            done = stop


@dataclass(frozen=True)
class StageFeeds:
    """The feeds of ``cset`` on ``stage``'s graph, as an iterable; :func:`~trtinfer.calibration.collect` runs them
    on its own augmented session (one run per feed) instead of running the graph twice."""

    stage: StageDir
    cset: CalibrationSet
    all_logits: bool = False

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return iter_feeds(self.stage, self.cset, all_logits=self.all_logits)

    def __len__(self) -> int:
        return self.cset.num_feeds
