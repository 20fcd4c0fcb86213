"""A slot KV cache for continuous batching: one preallocated cache of a buffer KV layout whose rows are slots.

::

    buffers   [S, kv_heads, capacity, head_dim] per past/present pair, allocated once, bound as past AND present
    slot s    row s of every buffer: one request's KV, right-aligned at position 0, ``lengths[s]`` tokens
    prefill   new prompts in rows r..r+k-1 (contiguous, nothing in them yet): ONE call over that view
    chunk     the next tokens of one row after what it holds: a batch-1 call bound to row s alone
    decode    one call over rows 0..n-1 (a view of the first n rows), each row with its own length / position

Rows of a C-contiguous ``[S, ...]`` buffer are contiguous, so a row (or a run of rows) is a tensor of its own at
``base + row * row_bytes``: ONNX Runtime reads and writes it in place through IOBinding, on the CPU or on a CUDA
device alike. The layout (``shared_buffer`` or ``scatter_buffer``, :mod:`trtinfer.runtime.kv_layouts`) makes the
feeds; this class binds rows. A chunk after existing KV is batch 1 because ONNX Runtime's GroupQueryAttention refuses
batch > 1 when a call has several new tokens and past context; rows that start empty prefill together. A decode row
that has nothing to decode (a free slot, a request still prefilling) gets a dummy token at its own length: its KV
lands in the position its next write overwrites, and its logits are ignored.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.cuda import host_view
from trtinfer.runtime.prefix_cache import PrefixIndex


class SlotCache:
    """``slots`` rows of KV buffers of ``capacity`` positions on an :class:`OrtDecoderSession` with a buffer layout
    (a ``scatter_buffer`` graph fixes its own capacity, which then must hold ``capacity``).

    Not thread-safe: one thread (the scheduler's) drives it. :attr:`lengths` counts each row's tokens.
    """

    def __init__(self, session: Any, slots: int, capacity: int, reserve: bool = True) -> None:
        self.layout = layout = session.layout
        # a layout that returns new KV each pass (concat) keeps its slot rows in host memory, whatever the device:
        # each pass gathers the rows' past from them and writes the new KV back
        self.host_rows = not layout.in_place
        if self.host_rows and str(session.kv_dtype) == "bfloat16" and session.device != "cpu":
            raise EngineLoadError(f"the {layout.name} KV layout's rows are kept in host memory, where numpy has no "
                                  "bfloat16: rebuild the engine with the default passes (shared_buffer) or fp16")
        if session.scatter_capacity:
            if session.scatter_capacity < capacity:
                raise InputError(f"the engine's KV buffers hold {session.scatter_capacity} positions; {capacity} "
                                 "were asked for: lower max_model_len")
            capacity = session.scatter_capacity
        self.session = session
        self.slots, self.capacity = slots, capacity
        self._row_bytes = session.kv_row_bytes(capacity)
        # zeros: a row never read past its length still holds finite values (0 * x, never NaN)
        kvh, hd = session.kv_shape if self.host_rows else (0, 0)
        host = np.uint16 if str(session.kv_dtype) == "bfloat16" else np.dtype(str(session.kv_dtype))  # bf16: its bits
        self.values = ([np.zeros((slots, kvh, capacity, hd), host) for _ in session.past_names] if self.host_rows
                       else session.slot_values(slots, capacity))
        self.nbytes = self._row_bytes * slots * len(self.values)
        if reserve and session.device == "cpu" and not self.host_rows:
            # reserve the memory now: GroupQueryAttention touches a row's whole capacity on its first prefill, and
            # faulting in ~190 MB (SmolLM2, 4096 positions) mid-request stalled that step by 0.5-1 s
            for val in self.values:
                ctypes.memset(session.row_pointer(val), 0, self._row_bytes * slots)
        self.index = PrefixIndex(slots)  # the tokens each row's KV holds: the one record of each row's length
        self.staging = session.new_staging()  # this cache's host input buffers (CUDA), reused pass to pass
        self._bindings: dict[Any, Any] = {}  # the session's bindings of this cache's row ranges, reused pass to pass

    @property
    def lengths(self) -> np.ndarray:
        """Each row's token count (the length of what :attr:`index` says it holds)."""
        return np.array([len(t) for t in self.index.tokens], dtype=np.int64)

    def length(self, slot: int) -> int:
        """Row ``slot``'s token count."""
        return len(self.index.tokens[slot])

    def _rows(self, val: Any) -> np.ndarray:
        """A numpy view ``[S, kv_heads, capacity, bytes per position]`` of a host buffer's raw bytes."""
        if isinstance(val, np.ndarray):
            return val.view(np.uint8).reshape(self.slots, val.shape[1], self.capacity, -1)
        nbytes = self._row_bytes * self.slots
        return host_view(self.session.row_pointer(val), nbytes, (nbytes,), np.uint8).reshape(
            self.slots, self.session.kv_shape[0], self.capacity, -1)

    def _run(self, feeds: dict[str, np.ndarray], first_row: int, rows: int, positions: np.ndarray) -> np.ndarray:
        """One pass over buffer rows ``first_row .. first_row + rows - 1``; logits ``[rows, K, V]`` at ``positions``.
        A layout that returns new KV (concat, ONNX Runtime) gets each row's past gathered from the host rows onto the
        device, right-aligned in ``max(starts)`` columns (the columns before it masked, as left padding), and the
        pass's new KV written back at each row's start."""
        if self.layout.in_place:
            return self.session.run_rows(feeds, self.values, first_row, rows,  # type: ignore[no-any-return]
                                         self.capacity, positions, self.staging, self._bindings)
        s = self.session
        width = feeds["input_ids"].shape[1]
        past = feeds["attention_mask"].shape[1] - width
        starts = feeds["position_ids"][:, 0]
        views = [self._rows(v)[first_row:first_row + rows] for v in self.values]
        kv_in = []
        for v, val in zip(views, self.values):
            host = np.zeros((rows, v.shape[1], past, v.shape[3]), dtype=np.uint8)
            for r in range(rows):
                host[r, :, past - starts[r]:] = v[r, :, :starts[r]]
            kv_in.append(s.kv_value_from(host.view(val.dtype)))  # the host rows' dtype (bfloat16: its bits, uint16)
        logits, present = s.run_bound(feeds, kv_in, positions, self.staging)
        real = feeds["attention_mask"][:, past:].sum(axis=1)
        for view, val in zip(views, present):
            new = val.numpy().view(np.uint8)[:, :, past:]
            for r in range(rows):
                view[r, :, starts[r]:starts[r] + real[r]] = new[r, :, :real[r]]
        return logits  # type: ignore[no-any-return]

    def feed(self, slot: int, tokens: Sequence[int], want: Sequence[int], prompt: bool = False) -> np.ndarray:
        """The next ``tokens`` of slot ``slot``'s sequence (one batch-1 call bound to its row); logits
        ``[len(want), V]`` at the chunk's positions ``want`` (position ``j`` predicts the token after
        ``tokens[j]``). ``prompt``: a prompt's chunk (its KV reusable as a prefix, :class:`PrefixIndex`)."""
        start, n = self.length(slot), len(tokens)
        if n == 0 or start + n > self.capacity:
            raise InputError(f"slot {slot} holds {start} of {self.capacity} positions; {n} more tokens do not fit")
        logits = self._pass(slot, start, tokens, want)
        self.index.extend(slot, tokens, prompt)
        return logits

    def _pass(self, slot: int, start: int, tokens: Sequence[int], want: Sequence[int]) -> np.ndarray:
        """One batch-1 call writing ``tokens``' KV at positions ``start ..`` of row ``slot``; logits at ``want``."""
        feeds = self.layout.buffer_feeds(np.asarray(tokens, dtype=np.int64)[None, :], np.array([start], np.int64),
                                         np.array([len(tokens)], np.int64))
        return self._run(feeds, slot, 1, np.asarray(want, dtype=np.int64)[None, :])[0]  # type: ignore[no-any-return]

    def refill(self, slot: int, limit: int) -> None:
        """Recompute up to ``limit`` (at least 2) of row ``slot``'s tokens past its prefilled part (decoded one a
        pass) as one prompt chunk, which computes them as a prompt's prefill does: the row then offers them for reuse
        (:class:`PrefixIndex`). Its tokens stay the same; a chunk starts at most two tokens before the row's end (a
        position recomputed in a chunk gets the KV it had)."""
        held = self.index.tokens[slot]
        start = max(0, min(self.index.prefilled[slot], len(held) - 2))
        chunk = held[start:start + max(2, limit)]
        if len(chunk) < 2:
            return
        self._pass(slot, start, chunk, [len(chunk) - 1])
        self.index.prefilled[slot] = start + len(chunk)

    def prefill(self, slot: int, tokens: Sequence[int], every: bool = False) -> np.ndarray:
        """:meth:`feed`: logits ``[V]`` after the last token, or with ``every`` ``[len(tokens), V]`` after each (a
        draft's verification, scored on the decoder graph as the decode steps it stands for)."""
        if not every:
            return self.feed(slot, tokens, [len(tokens) - 1], prompt=True)[-1]
        with self.session.decoder_graph():
            return self.feed(slot, tokens, range(len(tokens)))

    def prefill_rows(self, first: int, prompts: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Prompts into the empty rows ``first .. first + len(prompts) - 1`` as ONE call (right-padded); each row's
        logits ``[V]`` after its last token. A graph that computes the last position only (:attr:`every_position`
        False) would read every row at the padded call's last column: its rows prefill one call each."""
        rows = range(first, first + len(prompts))
        if any(self.length(r) for r in rows) or max(len(p) for p in prompts) > self.capacity:
            raise InputError(f"rows {first}..{rows[-1]} must be empty and the prompts fit {self.capacity} positions")
        if not self.every_position:
            return [self.prefill(r, p) for r, p in zip(rows, prompts)]
        lengths = np.array([len(p) for p in prompts], dtype=np.int64)
        ids = np.zeros((len(prompts), int(lengths.max())), dtype=np.int64)
        for r, p in enumerate(prompts):
            ids[r, :len(p)] = p
        feeds = self.layout.buffer_feeds(ids, np.zeros_like(lengths), lengths)
        logits = self._run(feeds, first, len(prompts), (lengths - 1)[:, None])
        for r, p in zip(rows, prompts):
            self.index.extend(r, p, prompt=True)
        return [logits[i, -1] for i in range(len(prompts))]

    def decode(self, tokens: dict[int, int]) -> dict[int, np.ndarray]:
        """One token into each slot of ``tokens`` (slot -> token), as one batched call over rows 0..max slot.

        Returns each of those slots' next-token logits ``[V]``; other rows in the range are left as they were.
        """
        rows = max(tokens) + 1
        lengths = self.lengths[:rows]
        if int(lengths.max()) + 1 > self.capacity:  # a row not fed gets a dummy token at its length: it must fit too
            raise InputError(f"a slot would hold more than its {self.capacity} positions")
        ids = np.zeros((rows, 1), dtype=np.int64)
        for s, t in tokens.items():  # a loop: for a handful of rows, cheaper than numpy's fancy indexing
            ids[s, 0] = t
        feeds = self.layout.buffer_feeds(ids, lengths, np.ones(rows, dtype=np.int64))
        logits = self._run(feeds, 0, rows, np.zeros((rows, 1), dtype=np.int64))
        for s, t in tokens.items():
            self.index.extend(s, (t,))
        return {s: logits[s, -1] for s in tokens}

    def free(self, slot: int) -> None:
        """Forget slot ``slot``'s tokens (its buffers are overwritten by the next request, never cleared)."""
        self.keep(slot, 0)

    def keep(self, slot: int, n: int) -> None:
        """Slot ``slot`` keeps the KV of its first ``n`` tokens (a reused prefix); the next prefill writes after it."""
        held = self.length(slot)
        if not 0 <= n <= held:
            raise InputError(f"slot {slot} holds {held} tokens; it cannot keep {n}")
        self.index.cut(slot, n)

    @property
    def every_position(self) -> bool:
        """Whether a pass returns logits at any positions asked for: a draft's verification needs them, and so does
        a prefill of right-padded rows in one call (each row's logits at its own last token; a last-position-only
        graph reads the padded call's last column, so its rows prefill one by one)."""
        return bool(self.session.logits_every_position)

    def copy_prefix(self, src: int, dst: int, n: int, into: SlotCache | None = None) -> None:
        """Slot ``dst`` (of ``into``, default this cache; same session and capacity) gets the KV of slot ``src``'s
        first ``n`` tokens and holds nothing after them: in host memory where the rows are there (the CPU provider, or
        rows kept on the host), else by the session on its device."""
        target = self if into is None else into
        held = self.length(src)
        if (target is self and src == dst) or not 0 < n <= held or target.capacity != self.capacity:
            raise InputError(f"cannot copy {n} tokens of slot {src} (holding {held}) to slot {dst}")
        if self.host_rows or self.session.device == "cpu":
            for val, out in zip(self.values, target.values):  # the bytes, copied as they are
                target._rows(out)[dst, :, :n] = self._rows(val)[src, :, :n]
        else:
            self.session.copy_rows(self.values, src, target.values, dst, n, self.capacity)
        target.index.cut(dst, 0)
        done = min(n, self.index.prefilled[src])  # the copy is as reusable as the source row
        target.index.extend(dst, self.index.tokens[src][:done], prompt=True)
        target.index.extend(dst, self.index.tokens[src][done:n])

    def close(self) -> None:
        """Drop the buffers (and the host staging)."""
        self.values = []
        self._bindings.clear()
        if self.staging is not None:
            self.staging.release()
