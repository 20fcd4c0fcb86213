"""The facts every artifact directory carries, typed once: a stage directory's ``stage.json`` and an engine's
``manifest.json`` both describe a graph by its kind, geometry, inputs/outputs, KV layout and tokenizer.

:class:`ArtifactRecord` is what :class:`trtinfer.stages.StageDir` and :class:`trtinfer.runtime.manifest.Manifest`
share: typed accessors over their JSON record, so no code outside them indexes the raw dicts. Stdlib only: the
runtime imports it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from typing import Any


class KVLayoutKind(str, Enum):
    """How a graph keeps its KV cache (the manifest's and stage.json's ``kv_layout``)."""

    #: past and present are separate, growing tensors; left padding + ``attention_mask``
    CONCAT = "concat"
    #: ONNX Runtime GroupQueryAttention: past and present share one preallocated buffer; right padding + ``seqlens_k``
    SHARED_BUFFER = "shared_buffer"
    #: the ``tensorrt`` target: TensorScatter writes each step into a preallocated buffer at ``position_ids[:, 0]``;
    #: right padding, masks from ``position_ids``
    SCATTER_BUFFER = "scatter_buffer"


#: the layout names a record may hold
KV_LAYOUTS = tuple(k.value for k in KVLayoutKind)
KINDS = ("decoder", "encoder")
PAST_PREFIX, PRESENT_PREFIX = "past_key_values.", "present."


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: its name, element type and shape (integers, or names of symbolic dimensions)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorSpec:
        return cls(str(d["name"]), str(d["dtype"]), tuple(d["shape"]))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphIO:
    """A graph's inputs and outputs, in graph order."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GraphIO:
        return cls(tuple(TensorSpec.from_dict(t) for t in d["inputs"]),
                   tuple(TensorSpec.from_dict(t) for t in d["outputs"]))

    def to_dict(self) -> dict[str, Any]:
        return {"inputs": [t.to_dict() for t in self.inputs], "outputs": [t.to_dict() for t in self.outputs]}

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def input(self, name: str) -> TensorSpec | None:
        """The input called ``name``, if the graph has one."""
        return next((t for t in self.inputs if t.name == name), None)

    def output(self, name: str) -> TensorSpec | None:
        """The output called ``name``, if the graph has one."""
        return next((t for t in self.outputs if t.name == name), None)

    @property
    def past(self) -> list[TensorSpec]:
        """The KV cache inputs (``past_key_values.*``), in graph order."""
        return [t for t in self.inputs if t.name.startswith(PAST_PREFIX)]

    @property
    def kv_dtype(self) -> str:
        """Element type of the KV cache (``float32``, ``float16`` or ``bfloat16``)."""
        past = self.past
        return past[0].dtype if past else "float32"


class ArtifactRecord(ABC):
    """Typed accessors over an artifact's JSON record (``stage.json`` or ``manifest.json``)."""

    @property
    @abstractmethod
    def record(self) -> dict[str, Any]:
        """The parsed JSON object."""

    @property
    def kind(self) -> str:
        """``decoder`` or ``encoder``."""
        return str(self.record.get("kind", "decoder"))

    @property
    def geometry(self) -> dict[str, Any]:
        """Layers, heads, head dim, vocabulary, layer types and windows, as the exporter read them."""
        return dict(self.record["geometry"])

    @property
    def io(self) -> GraphIO:
        """The graph's inputs and outputs."""
        return GraphIO.from_dict(self.record["io"])

    @property
    def kv_layout(self) -> str:
        """The KV layout's name (a :class:`KVLayoutKind` value; ``concat`` when the record names none)."""
        return KVLayoutKind(self.record.get("kv_layout", KVLayoutKind.CONCAT.value)).value

    @property
    def tokenizer_info(self) -> dict[str, Any]:
        """BOS/EOS/pad tokens and ids (empty when the record has none)."""
        return dict(self.record.get("tokenizer") or {})

    @property
    def pad_token_id(self) -> int:
        """The padding id (0 when the tokenizer has none)."""
        return int(self.tokenizer_info.get("pad_token_id") or 0)

    @property
    def source(self) -> dict[str, Any]:
        """Where the weights came from (``path``, ``sha256``, ...)."""
        return dict(self.record.get("source") or {})
