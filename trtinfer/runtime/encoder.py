"""Sentence embeddings from an encoder engine: tokenize, run, pool (mean/CLS) and L2-normalize like
sentence-transformers. Torch-free: onnxruntime + numpy + tokenizers.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer.artifact import Manifest, read_manifest
from trtinfer.errors import EngineLoadError, InputError
from trtinfer.runtime.config import RuntimeConfig
from trtinfer.runtime.session import Closing
from trtinfer.runtime.tokenizer import check_text, read_tokenizer


class EncoderEngine(Closing):
    """A loaded encoder engine; :meth:`embed` turns texts into sentence embeddings ``[N, hidden]``."""

    def __init__(self, engine_dir: str | Path, config: RuntimeConfig | None = None) -> None:
        self.path = Path(engine_dir)
        self.manifest: Manifest = read_manifest(self.path)
        if self.manifest.kind != "encoder":
            raise EngineLoadError(f"{self.path} is not an encoder engine; load it with trtinfer.load()")
        self.config = config or RuntimeConfig()
        self.pooling: dict[str, Any] = self.manifest.pooling
        self.max_seq_len = self.manifest.max_seq_len
        self._tok = read_tokenizer(self.path)
        self._tok.enable_truncation(self.max_seq_len)
        self._tok.enable_padding(pad_id=self.manifest.pad_token_id)
        from trtinfer.runtime.ort_env import open_ort_session

        # the provider the config names (CPU, CUDA, TensorRT), with the same checks as decoder engines
        self.sess: Any = open_ort_session(self.path / self.manifest.files["encoder"], self.path, self.manifest,
                                          self.config)
        self._inputs = {i.name for i in self.sess.get_inputs()}

    def close(self) -> None:
        """Release the ONNX Runtime session; :meth:`embed` is refused afterwards."""
        self.sess = None

    def embed(self, texts: Sequence[str], batch_size: int = 32, normalize: bool | None = None) -> np.ndarray:
        """Embeddings of ``texts`` (float32 ``[N, hidden]``); ``normalize`` None follows the model's config."""
        if self.sess is None:
            raise EngineLoadError(f"the engine {self.path} is closed; load it again with trtinfer.load()")
        if isinstance(texts, str) or not isinstance(texts, Sequence) or not texts:
            raise InputError("embed() takes a non-empty list of strings")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise InputError(f"embed() takes strings; items {bad[:5]} are not")
        for i, t in enumerate(texts):
            check_text(t, f"text {i}")
        if batch_size < 1:
            raise InputError(f"batch_size must be >= 1, got {batch_size}")
        norm = bool(self.pooling.get("normalize", False) if normalize is None else normalize)
        return np.concatenate([self._embed_batch(list(texts[i:i + batch_size]), norm)
                               for i in range(0, len(texts), batch_size)], axis=0)

    def _embed_batch(self, texts: list[str], normalize: bool) -> np.ndarray:
        enc = self._tok.encode_batch(texts)
        ids = np.array([e.ids for e in enc], dtype=np.int64)
        mask = np.array([e.attention_mask for e in enc], dtype=np.int64)
        feeds = {"input_ids": ids, "attention_mask": mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.array([e.type_ids for e in enc], dtype=np.int64)
        hidden = self.sess.run(None, feeds)[0]
        if self.pooling.get("mode") == "cls":
            emb = hidden[:, 0]
        else:  # mean over real tokens, as sentence-transformers' Pooling does
            m = mask[:, :, None].astype(np.float32)
            emb = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
        if normalize:
            emb = emb / np.clip(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12, None)
        return emb.astype(np.float32)
