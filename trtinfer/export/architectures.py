"""Registered export specs for decoder-only causal LMs.

Each architecture is a small declarative :class:`ArchSpec`; adding one is a ``register(ArchSpec(...))`` call.
The spec says how the model wants its attention masks (one 4D mask for all layers, or a mapping keyed by
``config.layer_types``) and where its KV geometry lives in the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trtinfer.errors import UnsupportedArchitectureError

FULL = "full_attention"
SLIDING = "sliding_attention"


@dataclass(frozen=True)
class ArchSpec:
    """How to export one architecture family.

    ``mask_mapping``: the model accepts ``attention_mask={"full_attention": m, "sliding_attention": m}`` (hybrid
    models); otherwise one 4D mask serves every layer. ``sliding_everywhere``: a set ``config.sliding_window``
    applies to all layers (Mistral, Phi-3).
    """

    name: str
    model_types: tuple[str, ...]
    mask_mapping: bool = False
    sliding_everywhere: bool = False
    norm: str = "rms"  # "rms" (RMSNorm) | "layer" (LayerNorm): what the norm fusions look for
    norms_per_layer: int = 2  # norms each decoder layer holds (q/k norms and post-norms included)
    rotary: bool = True  # rotary position embedding inside attention (GPT-2: learned positions instead)

    def geometry(self, config: Any) -> dict[str, Any]:
        """Number of layers, KV heads, head dim, vocab and per-layer attention type of ``config``."""
        n_layers = int(config.num_hidden_layers)
        n_heads = int(config.num_attention_heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or n_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // n_heads)
        window = getattr(config, "sliding_window", None)
        layer_types = list(getattr(config, "layer_types", None) or [])
        if not self.mask_mapping or not layer_types:
            sliding = bool(window) and self.sliding_everywhere
            layer_types = [SLIDING if sliding else FULL] * n_layers
        if SLIDING not in layer_types:
            window = None
        return {
            "num_layers": n_layers,
            "num_attention_heads": n_heads,
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_size": int(config.vocab_size),
            "layer_types": layer_types,
            "sliding_window": int(window) if window else None,
            "max_position_embeddings": int(getattr(config, "max_position_embeddings", 0) or 0) or None,
            # what the fusion passes should find: one final norm after the layers
            "norm": self.norm,
            "num_norms": n_layers * self.norms_per_layer + 1,
            "rotary": self.rotary,
            # the MLP activation as transformers names it (Gemma-3: hidden_activation, GPT-2: activation_function)
            "activation": (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
                           or getattr(config, "activation_function", None)),
        }


_REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    """Register ``spec`` under each of its ``model_types``."""
    for mt in spec.model_types:
        _REGISTRY[mt] = spec
    return spec


def supported_model_types() -> list[str]:
    """The ``config.model_type`` values that can be exported."""
    return sorted(_REGISTRY)


def spec_for(config: Any) -> ArchSpec:
    """Return the spec for ``config.model_type`` or raise listing the supported ones."""
    mt = getattr(config, "model_type", None)
    if mt not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"architecture '{mt}' is not supported for export; supported: {', '.join(supported_model_types())}"
        )
    return _REGISTRY[mt]


register(ArchSpec("llama", ("llama",)))
register(ArchSpec("mistral", ("mistral",), sliding_everywhere=True))
register(ArchSpec("phi3", ("phi3",), sliding_everywhere=True))
register(ArchSpec("qwen2", ("qwen2",), mask_mapping=True))
register(ArchSpec("qwen3", ("qwen3",), mask_mapping=True, norms_per_layer=4))
register(ArchSpec("gemma3", ("gemma3_text",), mask_mapping=True, norms_per_layer=6))
register(ArchSpec("gpt2", ("gpt2",), norm="layer", rotary=False))
