"""A GGUF file as a Hugging Face folder, written tensor by tensor, with each tensor's GGUF origin recorded.

transformers reads a GGUF's configuration and tokenizer; the weights are not loaded through it (its loader
dequantizes the whole model into memory, then ``save_pretrained`` copies it again). Here:

- names: transformers' own GGUF -> Hugging Face map (``get_gguf_hf_weights_map`` on a meta-device model, i.e. gguf-py's
  ``TensorNameMap``), so every tensor lands under the name transformers would give it;
- values: ggml's dequantization (gguf-py) of each tensor, passed through transformers' per-architecture tensor
  processor (Llama's rotary row order for q/k, Gemma's norm offsets). A 2-D tensor whose processing is a pure row
  reordering (checked on an index probe) is written a chunk of rows at a time: the export's peak is one chunk;
- origins: ``gguf.json`` beside the weights names, for every Hugging Face tensor, the GGUF tensor, its ggml type and
  the row order; the export copies it into ``stage.json`` so GGUF-exact quantization reads each weight's blocks by
  name (``trtinfer.quantization.gguf``).

The folder holds fp32 values, exactly what ggml computes (bf16 or fp16 would round ``d * scale * q``). A GGUF
whose fp32 copy would pass :data:`COPY_LIMIT` (a 1B model's is 5 GB, an 8B's 32 GB) is not copied: its 2-D tensors
(every one whose processing only reorders rows) stay in the GGUF, which the folder links to, and are dequantized
when read (:class:`trtinfer.checkpoint.Checkpoint`); only the small rest (norm gains) is written. The packaged
models stay whole fp32 folders, which any tool reads (transformers' ``from_pretrained``, the eager benchmarks).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trtinfer._outputs import link_into
from trtinfer.checkpoint import GGUF_LINK, GGUF_ORIGINS, SINGLE_NAME
from trtinfer.errors import ModelSourceError
from trtinfer.export.architectures import spec_for
from trtinfer.export.quiet import quiet_third_party
from trtinfer.gguf_file import GGUFFile, describe_rows

log = logging.getLogger(__name__)

#: fp32 bytes of weights above which a GGUF's 2-D tensors are read from it, not copied (the packaged models: 1 GB)
COPY_LIMIT = 2 << 30


def _load_config_and_tokenizer(gguf: Path) -> tuple[Any, Any]:
    """transformers' config and tokenizer of ``gguf``. Its config reader parses every metadata array through gguf-py
    (Gemma-3's 262k-token vocabulary: ~13 s, ~5 s inside :func:`_gguf_py_sped_up`), and ``AutoTokenizer`` parses
    them all again only to learn the model type, so the tokenizer is asked for by the type the config already gave
    (the same class and files: Gemma-3's tokenizer 18.8 -> 3.6 s), where transformers names a tokenizer for it."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    try:
        with quiet_third_party():
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            typed = {"tokenizer_type": config.model_type} if TOKENIZER_MAPPING_NAMES.get(config.model_type) else {}
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **typed)
    except Exception as e:  # transformers raises many types for unreadable files
        if isinstance(e, ImportError) or "accelerate" in str(e):  # a package its GGUF loader needs, not the file
            raise ModelSourceError(f"could not load GGUF {gguf}: {e}; install the export stack, which declares it: "
                                   "pip install 'trtinfer[export]'") from e
        raise ModelSourceError(f"could not load GGUF {gguf}: {e}; is it a complete GGUF of a supported model?") from e
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the folder's weights are plain fp32
    return config, tok


_GGUF_PY = threading.RLock()


@contextmanager
def _gguf_py_sped_up() -> Iterator[None]:
    """Inside the block, two of gguf-py's costs that transformers pays are not paid again and again.

    - ``GGUFReader`` slices its file's bytes as a plain ndarray, not as the ``np.memmap`` it maps (the same pages, no
      copy): it slices once per metadata item, and a memmap slice runs Python code of numpy's each time (Gemma-3's
      262,144-token vocabulary: transformers' config reader 13.2 -> 5.0 s, the same fields and tensors). While a
      block runs, ``gguf.GGUFReader`` is this subclass for every thread of the process (same values).
    - ``get_tensor_name_map`` builds each architecture's map once: transformers' ``get_gguf_hf_weights_map`` calls it
      for every submodule it recurses into (SmolLM2: 397 times, ~9 s of a conversion's 25), each building the same map.

    transformers reads both names from ``gguf`` at every call, so it gets these; ``gguf`` is left as it was after."""
    import gguf

    with _GGUF_PY:  # two conversions in threads: the second waits, so the first one's restore is the last word
        reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = _plain_array_reader(reader)  # type: ignore[misc, assignment]
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]


def _plain_array_reader(reader: type) -> type:
    """``reader`` (gguf-py's ``GGUFReader``) whose ``data``, the memmap of the file, is kept as a plain ndarray view."""

    class PlainArrayReader(reader):  # type: ignore[misc, valid-type]
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray)  # its base keeps the mapping open

    return PlainArrayReader


def _row_probe(processor: Any, name: str, n: int, key_map: dict[str, str], config: dict[str, Any]) -> np.ndarray | None:
    """The row order ``processor`` gives GGUF tensor ``name`` of ``n`` rows, if processing it only reorders rows."""
    probe = np.stack([np.arange(n, dtype=np.float64), np.arange(n, dtype=np.float64) * 2 + 0.5], axis=1)
    try:
        out = processor.process(weights=probe.copy(), name=name, tensor_key_mapping=key_map,
                                parsed_parameters={"config": dict(config), "tensors": {}}).weights
    except Exception:  # noqa: BLE001 - a processor that expects the real shape: process the whole tensor instead
        return None
    out = np.asarray(out)
    if out.shape != probe.shape or not np.array_equal(out[:, 1], out[:, 0] * 2 + 0.5):
        return None
    order = out[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(n)) else None


def convert_gguf(gguf: Path, out: Path, views: bool | None = None) -> None:
    """Write ``gguf`` into the empty folder ``out`` as config, fp32 ``model.safetensors``, tokenizer and origins;
    ``views`` (default: above :data:`COPY_LIMIT`): the 2-D tensors stay in the GGUF, linked as ``model.gguf``."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    from trtinfer.export.sources import write_chat_template

    log.info("converting %s to a Hugging Face folder, tensor by tensor (once; cached)", gguf.name)
    file = GGUFFile(gguf)
    file.check_dequantizable()
    with _gguf_py_sped_up():
        config, tok = _load_config_and_tokenizer(gguf)
        spec_for(config)  # an architecture we do not export is refused before its conversion, not after
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        arch = str(file.metadata.get("general.architecture") or config.model_type)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
        try:
            key_map = get_gguf_hf_weights_map(model, processor)
        except NotImplementedError as e:
            raise ModelSourceError(f"{gguf}: {e}") from e
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    heads = [getattr(config, "num_attention_heads", 0) or 0, getattr(config, "num_key_value_heads", 0) or 0]

    plan: list[tuple[str, str, np.ndarray | None]] = []  # (gguf name, hf name, row order or None)
    origins: dict[str, dict[str, Any]] = {}
    for name, t in file.tensors.items():
        hf = key_map.get(name)
        if hf is None or hf in origins:
            continue
        if hf not in expected or int(np.prod(expected[hf])) != int(np.prod(t.shape)):
            raise ModelSourceError(f"{gguf}: tensor {name} {list(t.shape)} does not fit {hf} "
                                   f"{list(expected.get(hf, ()))} of a {config.model_type} model; is the GGUF damaged?")
        order = _row_probe(processor, name, t.shape[0], key_map, config.to_dict()) if len(t.shape) == 2 else None
        plan.append((name, hf, order))
        rows = describe_rows(order, heads) if order is not None else None
        origins[hf] = {"gguf": name, "type": t.qtype, "rows": rows, "shape": list(expected[hf])}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in expected if k not in origins and not (tied and k == "lm_head.weight")]
    if missing:
        raise ModelSourceError(f"{gguf} has no tensor for {len(missing)} of the model's weights ({missing[0]}, ...): "
                               "is it a complete GGUF of a supported model?")
    if views is None:
        views = 4 * sum(int(np.prod(expected[hf])) for _, hf, _ in plan) > COPY_LIMIT
    viewed = {hf for _, hf, order in plan if views and order is not None and origins[hf]["rows"] is not None}
    for hf in viewed:
        origins[hf]["view"] = True
    if viewed:
        _link(gguf, out / GGUF_LINK)
        log.info("%d of %d tensors are read from the GGUF when used, not copied", len(viewed), len(plan))
    copied = [p for p in plan if p[1] not in viewed]
    _write_weights(file, copied, expected, processor, key_map, config.to_dict(), out / SINGLE_NAME)
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]  # as save_pretrained of the loaded model writes it
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)
    write_chat_template(gguf, out, config.model_type)
    (out / GGUF_ORIGINS).write_text(json.dumps({"gguf": gguf.name, "tensors": origins}, indent=1) + "\n")


def _write_weights(file: GGUFFile, plan: list[tuple[str, str, np.ndarray | None]], expected: dict[str, tuple[int, ...]],
                   processor: Any, key_map: dict[str, str], config: dict[str, Any], path: Path) -> None:
    """Stream ``plan``'s tensors into one fp32 safetensors file (shapes known up front, so the header is too)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, hf, _ in plan:
        n = 4 * int(np.prod(expected[hf]))
        header[hf] = {"dtype": "F32", "shape": list(expected[hf]), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, hf, order in plan:
            if order is not None:  # a pure row reordering: a chunk of rows at a time, in the HF order
                f.writelines(np.ascontiguousarray(c, np.float32).data for c in file.rows_in_order(name, order))
                continue
            values = file.dequantize(name)
            values = processor.process(weights=values, name=name, tensor_key_mapping=key_map,
                                       parsed_parameters={"config": dict(config), "tensors": {}}).weights
            f.write(np.ascontiguousarray(np.asarray(values, np.float32).reshape(expected[hf])).data)


def _link(gguf: Path, link: Path) -> None:
    """``link`` names ``gguf``'s bytes: a hard link (the cache entry keeps them when the original moves), else a
    symbolic link (another file system, a file the user may not link, or one whose mode the cache would change)."""
    if not link_into(gguf, link):
        os.symlink(gguf.resolve(), link)
        log.info("the cached model folder links to %s (moved, it is converted again)", gguf)


def gguf_origins(folder: Path) -> dict[str, dict[str, Any]]:
    """Hugging Face tensor name -> ``{"gguf", "type", "rows", "shape"}`` (and ``"view": true`` for a tensor read from
    the GGUF) of a converted GGUF folder ({} for other folders)."""
    record = folder / GGUF_ORIGINS
    if not record.is_file():
        return {}
    return dict(json.loads(record.read_text())["tensors"])

