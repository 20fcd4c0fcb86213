"""Feeds of the scatter_buffer KV layout (right padding, positions drive the in-graph mask and the KV writes)."""
from __future__ import annotations

import numpy as np
import pytest

from trtinfer.errors import InputError
from trtinfer.runtime.kv_feeds import chunk_feeds, decode_feeds, prefill_feeds


def test_prefill_right_pads_and_asks_for_each_rows_last_token():
    feeds, lengths = prefill_feeds([[5, 6, 7], [8]], pad_token_id=0, capacity=16)
    assert feeds["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert feeds["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]]
    assert feeds["logits_positions"].tolist() == [[2], [0]]
    assert lengths.tolist() == [3, 1]
    assert all(a.dtype == np.int64 for a in feeds.values())


def test_decode_writes_at_each_rows_length():
    feeds = decode_feeds(np.array([11, 12]), np.array([3, 1]), capacity=16)
    assert feeds["input_ids"].tolist() == [[11], [12]]
    assert feeds["position_ids"].tolist() == [[3], [1]]  # slot written = position = tokens already held
    assert feeds["logits_positions"].tolist() == [[0], [0]]


def test_limits_are_input_errors():
    with pytest.raises(InputError, match="KV buffers of 4 positions"):
        prefill_feeds([[1] * 5], 0, capacity=4)
    with pytest.raises(InputError, match="would need 5"):
        decode_feeds(np.array([1]), np.array([4]), capacity=4)
    with pytest.raises(InputError, match="2 tokens for a cache of 1 rows"):
        decode_feeds(np.array([1, 2]), np.array([3]), capacity=8)


def test_chunks_continue_a_sequence():
    feeds = chunk_feeds([4, 5, 6], start=10, positions=np.array([0, 2]), capacity=16)
    assert feeds["position_ids"].tolist() == [[10, 11, 12]]
    assert feeds["logits_positions"].tolist() == [[0, 2]]
    with pytest.raises(InputError, match="positions inside the chunk"):
        chunk_feeds([4, 5], start=0, positions=np.array([2]), capacity=16)
    with pytest.raises(InputError, match="would need 17"):
        chunk_feeds([4, 5], start=15, positions=np.array([0]), capacity=16)
