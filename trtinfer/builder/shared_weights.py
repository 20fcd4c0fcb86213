"""An engine whose weights are its stage's, byte for byte, stores them once: its data file is a hard link to the
stage's.

ONNX Runtime's offline optimization (the engine compile) writes every initializer of the stage's graph again, into
the engine's own data file, in its own order: for a quantized model that is the whole model a second time (9.2 GB at
the Qwen3-14B shape), so the cache's stage and the engine held two copies. Where every external initializer of the
engine graph is, byte for byte, the tensor of the same name in the stage's one data file (the optimizer left the
weights as they were: the case for every precision measured), and those tensors are nearly all of that file, the
engine's data file becomes a hard link to the stage's and the engine graph's offsets become the stage's (the few
small tensors the stage kept inside its graph, which ONNX Runtime wrote out, move into the engine graph). The engine
folder still holds all it needs: removing the cache leaves it whole. Where a link cannot be made (another file
system, one without links) or any byte differs, the engine keeps its own copy.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: the engine's tensors must be at least this share of the stage's data file's bytes (a link to a file mostly of
#: tensors the engine no longer reads would carry them along wherever the engine is copied)
MIN_SHARE = 0.99
#: engine tensors the stage holds in its graph, not its data file (small ones: scales of a small weight, rotary
#: tables) move into the engine graph, up to this many bytes; more, and the engine keeps its own copy
INLINE_MAX = 16 << 20
#: bytes compared at a time (two buffers of this size: the files are read, never mapped, so the build's resident
#: memory does not grow with them)
CHUNK = 64 << 20


def _external(graph: Any) -> dict[str, tuple[str, int, int]]:
    """``name -> (location, offset, length)`` of the graph's external initializers."""
    import onnx

    out = {}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            d = {e.key: e.value for e in t.external_data}
            out[t.name] = (d["location"], int(d.get("offset", 0)), int(d["length"]))
    return out


def _same_bytes(mine: Path, theirs: Path, spans: list[tuple[int, int, int]]) -> bool:
    """Whether ``mine[a:a+n] == theirs[b:b+n]`` for every ``(a, b, n)`` of ``spans``."""
    a_buf, b_buf = bytearray(CHUNK), bytearray(CHUNK)
    with open(mine, "rb", buffering=0) as fa, open(theirs, "rb", buffering=0) as fb:
        for a, b, n in spans:
            done = 0
            while done < n:
                size = min(CHUNK, n - done)
                va, vb = memoryview(a_buf)[:size], memoryview(b_buf)[:size]
                fa.seek(a + done)
                fb.seek(b + done)
                if fa.readinto(va) != size or fb.readinto(vb) != size or va != vb:
                    return False
                done += size
    return True


def share_stage_weights(engine_onnx: Path, stage_onnx: Path) -> int:
    """Point the engine graph ``engine_onnx`` at a hard link of the data file of ``stage_onnx`` (the graph it was
    compiled from) in place of its own copy, where the two hold the same tensors (module doc); returns the bytes
    no longer stored twice (0 where nothing changed)."""
    import onnx

    engine = onnx.load(str(engine_onnx), load_external_data=False)
    mine = _external(engine.graph)
    theirs = _external(onnx.load(str(stage_onnx), load_external_data=False).graph)
    files = {loc for loc, _, _ in mine.values()}
    sources = {loc for loc, _, _ in theirs.values()}
    if len(files) != 1 or len(sources) != 1:
        return 0
    own, src = engine_onnx.parent / files.pop(), stage_onnx.parent / sources.pop()
    shared = {n: v for n, v in mine.items() if n in theirs and theirs[n][2] == v[2]}
    inline = {n: v for n, v in mine.items() if n not in shared}  # small tensors the stage kept in its graph
    size = src.stat().st_size
    if sum(v[2] for v in inline.values()) > INLINE_MAX or sum(v[2] for v in shared.values()) < MIN_SHARE * size:
        return 0
    if not _same_bytes(own, src, [(v[1], theirs[n][1], v[2]) for n, v in shared.items()]):
        log.debug("%s: its weights differ from %s: it keeps its own copy", engine_onnx, src)
        return 0
    raw = {}
    with open(own, "rb") as f:
        for name, (_, offset, length) in inline.items():
            f.seek(offset)
            raw[name] = f.read(length)
    link = own.with_name(f".{own.name}.shared")
    try:
        link.unlink(missing_ok=True)
        os.link(src, link)
    except OSError as e:  # another file system, links not supported: the engine keeps its copy
        log.debug("%s: no hard link to %s (%s): it keeps its own copy", engine_onnx, src, e)
        return 0
    for t in engine.graph.initializer:
        if t.name in inline:
            del t.external_data[:]
            t.data_location, t.raw_data = onnx.TensorProto.DEFAULT, raw[t.name]
        elif t.name in shared:
            kept = [(e.key, e.value) for e in t.external_data if e.key != "offset"]
            del t.external_data[:]
            for key, value in [*kept, ("offset", str(theirs[t.name][1]))]:
                t.external_data.add(key=key, value=value)
    rewritten = engine_onnx.with_name(f".{engine_onnx.name}.shared")
    onnx.save(engine, str(rewritten))
    os.replace(link, own)  # the engine folder is a temporary one until the build succeeds: never seen half-done
    os.replace(rewritten, engine_onnx)
    log.debug("%s: its %d weights are %s's (hard link), not a second copy; %d small ones in its graph", engine_onnx,
              len(shared), src, len(inline))
    return size
