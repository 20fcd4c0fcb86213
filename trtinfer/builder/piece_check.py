"""The check of an engine whose model is too large to run whole in fp32: the same build on a reduced model.

A 14B model's fp32 graph (59 GB) fits neither memory nor disk here, so neither eager validation nor the engine
check's reference can run on it. What can: the model cut to its first :data:`LAYERS` decoder layers and the first
:data:`VOCAB` rows of its embedding table and LM head (whole, at a 150k vocabulary those two alone are 6.2 GB of
fp32 at 14B), read from the same checkpoint tensors, with its final norm, built with the same settings through the
same stages. That build runs every check a small model gets: the export against
PyTorch eager, the engine against the export, a quantized engine's held-out perplexity against fp32. It vouches for
the pipeline on these weights and shapes, not for the deeper layers' numbers; the manifest says so
(``reduced_depth_check.scope``). Its stages go to a temporary cache, removed after: nothing of it stays on disk.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trtinfer._outputs import scratch_dir
from trtinfer.builder.config import BuildConfig
from trtinfer.errors import BuildError, TrtInferError

log = logging.getLogger(__name__)

LAYERS = 2  # the reduced depth: two layers, so a layer's output feeds another through the KV cache and norms
#: the reduced vocabulary: the embedding table's and LM head's first rows (a 150k-token head is most of a slice's
#: fp32 bytes: 6.2 GB at the Qwen3-14B shape); each kept row is quantized exactly as in the whole head
VOCAB = 8192


@contextlib.contextmanager
def _cache_at(root: Path) -> Iterator[None]:
    """``TRTINFER_CACHE`` pointed at ``root`` for the duration (the builds of one process run one at a time)."""
    old = os.environ.get("TRTINFER_CACHE")
    os.environ["TRTINFER_CACHE"] = str(root)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRTINFER_CACHE", None)
        else:
            os.environ["TRTINFER_CACHE"] = old


def reduced_depth_check(resolved: Any, config: BuildConfig, geometry: dict[str, Any], near: Path) -> dict[str, Any]:
    """Build ``resolved`` (a :class:`~trtinfer.export.sources.ResolvedModel`) cut to :data:`LAYERS` layers and
    :data:`VOCAB` tokens with ``config`` in a scratch folder beside ``near`` (the engine's output path: a leftover
    of a killed build goes with the next build's sweep); returns its checks. A failed check fails this build."""
    from trtinfer.artifact import read_manifest
    from trtinfer.builder.engine_builder import build

    num_layers, vocab = int(geometry["num_layers"]), min(VOCAB, int(geometry["vocab_size"]))
    layers = min(LAYERS, num_layers - 1)
    cut = dataclasses.replace(config, export=dataclasses.replace(config.export, layers=layers, vocab=vocab))
    log.info("checking the pipeline on the model's first %d of %d layers (the whole model does not fit in fp32)",
             layers, num_layers)
    with scratch_dir(near.parent, near.name) as tmp, _cache_at(tmp / "cache"):
        try:
            engine = build(resolved, Path(tmp) / "engine", cut, progress=False)
        except TrtInferError as e:
            raise BuildError(f"the reduced-depth check ({layers} of {num_layers} layers) failed: {e}") from e
        m = read_manifest(engine).to_dict()
    return {"scope": f"reduced model: the first {layers} of {num_layers} decoder layers and the first {vocab} of "
                     f"{geometry['vocab_size']} rows of the embedding table and LM head, read from the same checkpoint "
                     "tensors, built with the same settings; the deeper layers and other rows are not compared with "
                     "eager", "layers": layers, "vocab": vocab, "export_validation": m["export"]["validation"], "engine_check": m.get("engine_check"),
            "accuracy_check": m.get("accuracy_check")}
