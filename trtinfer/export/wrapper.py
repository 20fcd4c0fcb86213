"""The traced module: flat KV tensors in, flat KV tensors out, masks built explicitly.

We build the 4D additive masks ourselves instead of letting transformers do it, because its mask code takes
shortcuts on the *values* of the traced mask (skipping it when nothing is padded), which a trace would freeze.
Every layer keeps its full KV history; sliding-window layers see only the last ``window`` positions through their
mask. That is exactly the attention transformers computes with its cropped sliding cache, at the cost of keeping
older positions around.

    input_ids [B,S] --> HF model (eager attention) --> logits [B,1|S,V]
    attention_mask [B,P+S] --> full / sliding 4D masks [B,1,S,P+S]
    past_key_values.i.key|value [B,KV,P,D] --> DynamicCache --> present.i.key|value [B,KV,P+S,D]
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache, DynamicLayer

from trtinfer.export.architectures import FULL, SLIDING


def build_masks(
    attention_mask: torch.Tensor, seq_len: torch.Tensor | int, window: int | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Additive 4D masks ``[B,1,S,T]`` (0 = attend, dtype-min = blocked) from a 2D padding mask ``[B,T]``.

    Query ``i`` sits at cache index ``T-S+i``. Sliding layers also block keys ``window`` or more positions back,
    matching transformers' ``sliding_window_overlay`` (``kv_idx > q_idx - window``).
    """
    total = attention_mask.shape[1]
    kv_idx = torch.arange(total, device=attention_mask.device)
    q_idx = torch.arange(seq_len, device=attention_mask.device) + (total - seq_len)  # type: ignore[arg-type]
    causal = kv_idx[None, :] <= q_idx[:, None]  # [S,T]
    keep = attention_mask[:, None, None, :].bool() & causal[None, None]  # [B,1,S,T]
    zero = torch.zeros((), dtype=dtype)
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    masks = {FULL: torch.where(keep, zero, blocked)}
    if window:
        in_window = (q_idx[:, None] - kv_idx[None, :]) < window
        masks[SLIDING] = torch.where(keep & in_window[None, None], zero, blocked)
    return masks


def gqa_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Eager attention without ``repeat_kv``: the G query heads sharing a KV head become G*S query rows.

    transformers' eager path copies every KV head G times per layer and step (``repeat_kv``); at batch 8 that is
    most of a decode step's memory traffic. Folding the group into the query rows reads K/V once:
    ``q [B,H,S,D] -> [B,KV,G*S,D]``, ``scores = q @ k^T -> [B,KV,G*S,T]``, mask broadcast over G.
    """
    b, h, s, d = query.shape
    kvh, t = key.shape[1], key.shape[2]
    g = h // kvh
    if scaling is None:
        scaling = d**-0.5
    q = query.reshape(b, kvh, g * s, d)
    scores = torch.matmul(q, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = (scores.view(b, kvh, g, s, t) + attention_mask[:, :, None, :, :t]).view(b, kvh, g * s, t)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(probs, value)  # [B,KV,G*S,D]
    return out.view(b, h, s, d).transpose(1, 2).contiguous(), None


GQA_ATTENTION = "trtinfer_gqa"
AttentionInterface.register(GQA_ATTENTION, gqa_attention)


@contextmanager
def traced_attention(model: Any) -> Iterator[None]:
    """Switch ``model`` to :func:`gqa_attention` for tracing; restore its attention implementation after."""
    before = model.config._attn_implementation
    model.set_attn_implementation(GQA_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def cache_from_flat(past: tuple[torch.Tensor, ...]) -> DynamicCache:
    """A DynamicCache of full (never cropped) layers holding the given key/value pairs."""
    cache = DynamicCache()
    for i in range(0, len(past), 2):
        layer = DynamicLayer()
        layer.device = past[i].device  # what lazy_initialization sets besides keys/values (transformers 5.x)
        layer.keys, layer.values = past[i], past[i + 1]
        layer.is_initialized = True
        cache.layers.append(layer)
    return cache


class DecoderWithPast(torch.nn.Module):
    """Wrap a HF causal LM into the flat signature the ONNX graph exposes."""

    def __init__(self, model: Any, geometry: dict[str, Any], mask_mapping: bool, last_logits_only: bool) -> None:
        super().__init__()
        self.model = model
        self.layer_types: list[str] = geometry["layer_types"]
        self.window: int | None = geometry["sliding_window"]
        self.mask_mapping = mask_mapping
        self.last_logits_only = last_logits_only

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, *past: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        dtype = past[0].dtype if past else torch.float32
        masks = build_masks(attention_mask, input_ids.shape[1], self.window, dtype)
        mask: Any = masks if self.mask_mapping else masks[self.layer_types[0]]
        cache = cache_from_flat(past)
        total = attention_mask.shape[1]
        cache_position = torch.arange(input_ids.shape[1]) + (total - input_ids.shape[1])
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=cache,
            cache_position=cache_position,
            use_cache=True,
            logits_to_keep=1 if self.last_logits_only else 0,
        )
        flat: list[torch.Tensor] = []
        for layer in out.past_key_values.layers:
            flat += [layer.keys, layer.values]
        return (out.logits, *flat)
