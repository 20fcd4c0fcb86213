"""Streamed export (trtinfer/export/checkpoint.py, streamed.py) on checkpoints in real model shapes.

The checkpoints come from ``benchmarks/make_checkpoint.py``: seeded random weights drawn in bf16, 2-layer slices of
Llama 3.2 1B (tied LM head) and Qwen3 8B (untied head, q/k norms) at their real widths and a 512-token vocabulary,
written as hub-style shards or one file, in bf16, fp16 or fp32. Checked here: the export agrees with transformers eager (its own recorded validation, and an
independent prefill + decode in ONNX Runtime); every initializer is a checkpoint tensor (as is or transposed), the
same bytes whatever the shard layout or the source dtype (fp16 within its rounding); a tied head reads the
embedding; a damaged checkpoint is one clear error from the API and one stderr line from the CLI; and the peak
memory of a full-vocabulary slice's export.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper
from safetensors import safe_open

from trtinfer._outputs import lock_dir
from trtinfer.artifact import DATA_NAME, ONNX_NAME, StageDir
from trtinfer.errors import ModelSourceError
from trtinfer.export import ExportConfig, export
from trtinfer.stage_weights import CHECKPOINT_KEY, load_graph, materialized_file, save_graph

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 512
SEED = 11
SHARD_MB = 30  # a 2-layer slice then spans 9 (Llama bf16), 11 (Llama fp32) or 17 (Qwen3 8B bf16) shards
TEXT = "The licence grants you the freedom to share and change all versions of a program."
GB = 2**30


def _load_make_checkpoint() -> Any:
    spec = importlib.util.spec_from_file_location("make_checkpoint", ROOT / "benchmarks" / "make_checkpoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_checkpoint"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


mc = _load_make_checkpoint()


# --- reading what was written, independently of trtinfer's readers ----------------------------------------------

def whole(stage: Path) -> Path:
    """A whole copy of the stage's graph, every weight read from the checkpoint and written out (made once)."""
    out = stage.parent / f"{stage.name}-whole"
    if not out.exists():
        out.mkdir()
        save_graph(load_graph(stage / ONNX_NAME), out / ONNX_NAME, keep_references=False)
    return out


def initializers(stage: Path) -> dict[str, np.ndarray]:
    """Every weight of the stage's graph as a whole copy holds it: external ones memory-mapped from its data."""
    stage = whole(stage)
    model = onnx.load(str(stage / ONNX_NAME), load_external_data=False)
    out: dict[str, np.ndarray] = {}
    for t in model.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            out[t.name] = numpy_helper.to_array(t)
            continue
        ext = {e.key: e.value for e in t.external_data}
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
        n = int(np.prod(t.dims, dtype=np.int64))
        assert int(ext["length"]) == n * dtype.itemsize, t.name
        out[t.name] = np.memmap(stage / ext["location"], dtype=dtype, mode="r", offset=int(ext["offset"]),
                                shape=(n,)).reshape(tuple(t.dims))
    return out


def onnx_props(stage: Path) -> dict[str, str]:
    """The metadata of the stage's graph."""
    return {p.key: p.value for p in onnx.load(str(stage / ONNX_NAME), load_external_data=False).metadata_props}


def checkpoint_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors checkpoint as float32 (bf16 and fp16 widen exactly), read by ``safetensors``."""
    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k).float().numpy() for k in st.keys()})  # noqa: SIM118
    return out


def trace_sources(inits: dict[str, np.ndarray], tensors: dict[str, np.ndarray]) -> dict[str, tuple[str, bool]]:
    """Initializer name -> (checkpoint tensor, transposed) for each initializer equal to a tensor or its transpose."""
    found: dict[str, tuple[str, bool]] = {}
    for name, value in inits.items():
        if value.dtype != np.float32 or value.ndim == 0:
            continue
        for tname, t in tensors.items():
            for transposed in (False, True):
                if transposed and t.ndim != 2:
                    continue
                ref = t.T if transposed else t
                # the first row (or elements) first: a full comparison only for the one candidate that can match
                if value.shape == ref.shape and np.array_equal(value[:1], ref[:1]) and np.array_equal(value, ref):
                    found[name] = (tname, transposed)
                    break
            if name in found:
                break
    return found


def lm_head_weight(stage: Path) -> str:
    """The initializer read by the LM head: the MatMul the ``logits`` output comes from."""
    model = onnx.load(str(whole(stage) / ONNX_NAME), load_external_data=False)
    producer = {o: n for n in model.graph.node for o in n.output}
    node = producer["logits"]
    while node.op_type != "MatMul":  # through any reshape or cast after it
        node = producer[node.input[0]]
    names = {t.name for t in model.graph.initializer}
    (weight,) = [i for i in node.input if i in names]
    return weight


@pytest.mark.parametrize("shape", [(1000, 300), (3, 700), (513, 1)])
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_transposed_blocks_are_the_transpose(shape, dtype):
    """The tiled transpose (a tall table's column block, tile edges not multiples of the tile) equals ``W.T``."""
    from trtinfer.checkpoint import to_float32
    from trtinfer.stage_weights import TILE, transposed_block

    rng = np.random.default_rng(0)
    words = (rng.integers(0, 2**16, shape, dtype=np.uint16) if dtype == "BF16"
             else rng.standard_normal(shape, dtype=np.float32))
    full = to_float32(words, dtype)
    cols = shape[1]
    for start, stop in [(0, cols), (cols // 3, cols), (0, min(cols, TILE + 5))]:
        got = transposed_block(words, start, stop, dtype)
        assert got.flags.c_contiguous and np.array_equal(got, full[:, start:stop].T, equal_nan=True)


# --- fixtures ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """This module's checkpoints and exports (a few GB), removed at the end rather than left in pytest's temp."""
    root = tmp_path_factory.mktemp("streamed")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoint(workdir: Path) -> Callable[..., Path]:
    """``checkpoint(preset, dtype="bf16", single=False)`` -> the 2-layer, vocab-512 slice (written once)."""
    made: dict[tuple[str, str, bool], Path] = {}

    def get(preset: str, dtype: str = "bf16", single: bool = False) -> Path:
        key = (preset, dtype, single)
        if key not in made:
            folder = workdir / f"{preset}-{dtype}-{'single' if single else 'sharded'}"
            mc.make_checkpoint(folder, mc.CheckpointConfig(preset, layers=2, vocab=VOCAB, seed=SEED, dtype=dtype,
                                                           shard_mb=SHARD_MB, single_file=single))
            made[key] = folder
        return made[key]

    return get


@pytest.fixture(scope="module")
def exported(workdir: Path, checkpoint: Callable[..., Path]) -> Callable[..., StageDir]:
    """``exported(preset, dtype="bf16", single=False)`` -> its export stage (made once). The bf16 shards, as the
    hub ships them, are validated against eager; the other sources only feed the byte comparisons."""
    made: dict[tuple[str, str, bool], StageDir] = {}

    def get(preset: str, dtype: str = "bf16", single: bool = False) -> StageDir:
        key = (preset, dtype, single)
        if key not in made:
            validate = (dtype, single) == ("bf16", False)
            made[key] = export(checkpoint(preset, dtype, single), workdir / f"out-{'-'.join(map(str, key))}",
                               ExportConfig(validate=validate))
        return made[key]

    return get


# --- 1. agreement with eager -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", [
    "llama-3.2-1b",
    # Qwen3 14B is the 8B's architecture at 5120 wide: it passes too, but adds 50 s and no mechanism
    pytest.param("qwen3-8b", marks=pytest.mark.slow),
])
def test_slice_export_matches_transformers_eager(preset, checkpoint, exported):
    import onnxruntime as ort
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stage = exported(preset)
    record = json.loads((stage.path / "stage.json").read_text())
    v = record["history"]["export"]["validation"]
    assert v is not None and "validation_skipped" not in record["history"]["export"]
    assert v["passed"] and v["top1_agree"]
    assert max(v["prefill_logits_max_abs_diff"], v["decode_logits_max_abs_diff"]) <= v["tolerance"]
    assert record["geometry"]["num_layers"] == 2 and record["geometry"]["vocab_size"] == VOCAB

    # independently: a real prompt, prefill then decode one token at a time on the graph's KV cache, against one
    # cacheless eager forward over the whole prompt
    folder = checkpoint(preset)
    ids = AutoTokenizer.from_pretrained(folder)(TEXT).input_ids[:9]
    prefill = 5
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        eager = model(torch.tensor([ids]), use_cache=False).logits[0].numpy()  # [len(ids), vocab]
    del model
    g = record["geometry"]
    with materialized_file(stage.onnx_path) as whole:  # the export's weights are read from the checkpoint
        sess = ort.InferenceSession(str(whole), providers=["CPUExecutionProvider"])
        # the whole copy sits in a scratch dir named and locked as the stage's own temp dirs: a sweep (another
        # build, `trtinfer cache clean`) leaves it alone now and removes it if this process is killed
        assert whole.parent.name.startswith(f".{stage.path.name}.tmp-{os.getpid()}-")
        assert lock_dir(whole.parent) is None
    assert not whole.parent.exists()
    feed: dict[str, np.ndarray] = {
        "input_ids": np.array([ids[:prefill]]), "attention_mask": np.ones((1, prefill), np.int64),
        "position_ids": np.arange(prefill)[None]}
    feed.update({f"past_key_values.{i}.{k}": np.zeros((1, g["num_kv_heads"], 0, g["head_dim"]), np.float32)
                 for i in range(g["num_layers"]) for k in ("key", "value")})
    ours = []
    for n in range(prefill, len(ids) + 1):
        out = sess.run(None, feed)
        ours.append(out[0][0, -1])  # logits of position n - 1
        if n == len(ids):
            break
        feed = {"input_ids": np.array([[ids[n]]]), "attention_mask": np.ones((1, n + 1), np.int64),
                "position_ids": np.array([[n]])}
        feed.update({f"past_key_values.{i}.{k}": out[1 + 2 * i + j]
                     for i in range(g["num_layers"]) for j, k in enumerate(("key", "value"))})
    ref = eager[prefill - 1:]
    got = np.stack(ours)
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(got - ref).max() <= 1e-4 * scale, (np.abs(got - ref).max(), scale)
    assert (got.argmax(-1) == ref.argmax(-1)).all()
    assert 0.3 < float(ref.std()) < 5.0  # logits with a trained model's spread: the comparison is not of zeros


# --- 2./3./4. the weights written are the checkpoint's -----------------------------------------------------------

@pytest.mark.parametrize("preset", ["llama-3.2-1b", pytest.param("qwen3-8b", marks=pytest.mark.slow)])
def test_every_initializer_is_a_checkpoint_tensor_and_the_head_follows_the_tying(preset, checkpoint, exported):
    folder = checkpoint(preset)
    tensors = checkpoint_tensors(folder)
    tied = mc.PRESETS[preset].config["tie_word_embeddings"]
    assert ("lm_head.weight" in tensors) == (not tied)  # a tied checkpoint ships no head: the export must not need one
    inits = initializers(exported(preset).path)
    sources = trace_sources(inits, tensors)
    assert set(tensors) == {t for t, _ in sources.values()}  # every checkpoint tensor reaches the graph
    # what is not a checkpoint tensor is small: rotary tables, shape constants (no weight went missing or astray)
    others = {k: v.nbytes for k, v in inits.items() if k not in sources}
    assert sum(others.values()) < 2**20, others
    # Linear weights are read transposed (MatMul's [in, out]), norms and the embedding table as stored
    for name, (tensor, transposed) in sources.items():
        if tensor != "model.embed_tokens.weight":
            assert transposed == (tensor.endswith("proj.weight") or tensor == "lm_head.weight"), name
    embedding = {transposed for tensor, transposed in sources.values() if tensor == "model.embed_tokens.weight"}
    assert embedding == ({False, True} if tied else {False})  # the Gather's table, and a tied head's MatMul
    head = sources[lm_head_weight(exported(preset).path)]
    assert head == (("model.embed_tokens.weight" if tied else "lm_head.weight"), True)
    if not tied:
        assert not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    if preset.startswith("qwen3"):
        assert {f"model.layers.{i}.self_attn.{n}_norm.weight" for i in range(2) for n in "qk"} <= set(tensors)


def test_shards_and_single_file_export_the_same_bytes(checkpoint, exported):
    sharded, single = checkpoint("llama-3.2-1b"), checkpoint("llama-3.2-1b", single=True)
    shards = set(json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values())
    assert shards == {p.name for p in sharded.glob("*.safetensors")} and len(shards) >= 5
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    a, b = exported("llama-3.2-1b").path, exported("llama-3.2-1b", single=True).path
    # the graph and the weights it reads are byte-identical: layout, order, alignment and values do not depend on
    # how the checkpoint is split (the exports differ only in the checkpoint they name)
    assert (whole(a) / DATA_NAME).read_bytes() == (whole(b) / DATA_NAME).read_bytes()
    assert (whole(a) / ONNX_NAME).read_bytes() == (whole(b) / ONNX_NAME).read_bytes()
    ra, rb = (json.loads(onnx_props(x)[CHECKPOINT_KEY]) for x in (a, b))
    assert ra["weights"] == rb["weights"] and ra["folder"] != rb["folder"]


def test_fp32_source_exports_the_bf16_bytes_and_fp16_its_rounding(checkpoint, exported):
    bf16 = exported("llama-3.2-1b").path
    # make_checkpoint draws in bf16, so the fp32 checkpoint holds the same numbers: the same bytes come out
    fp32 = exported("llama-3.2-1b", "fp32").path
    assert (whole(fp32) / DATA_NAME).read_bytes() == (whole(bf16) / DATA_NAME).read_bytes()
    assert (whole(fp32) / ONNX_NAME).read_bytes() == (whole(bf16) / ONNX_NAME).read_bytes()
    # fp16 holds each bf16 value rounded to fp16: the export widens those exactly (no second rounding) and nothing
    # else moves
    fp16 = exported("llama-3.2-1b", "fp16", single=True).path
    ref, got = initializers(bf16), initializers(fp16)
    assert set(ref) == set(got)
    sources = trace_sources(got, checkpoint_tensors(checkpoint("llama-3.2-1b", "fp16", single=True)))
    moved = set()
    for name, want in ref.items():
        if name not in sources:
            assert np.array_equal(got[name], want), name  # not from the checkpoint: the same constant
            continue
        rounded = np.asarray(want).astype(np.float16).astype(np.float32)
        assert np.array_equal(got[name], rounded), name
        assert np.all(np.abs(got[name] - want) <= np.maximum(np.abs(want) * 2.0**-11, 2.0**-25)), name
        if not np.array_equal(got[name], want):
            moved.add(name)
    # not vacuous: every matrix went through fp16 rounding; the norms (1 + 0.02 N drawn in bf16, 8 significant bits
    # near 1) are exact in fp16
    assert moved == {n for n, (t, _) in sources.items() if not t.endswith("norm.weight")}


# --- 5. damaged checkpoints ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_sharded(workdir: Path) -> Path:
    """A 1-layer Llama slice at vocab 300 in 20 MB shards (6 of them)."""
    folder = workdir / "small"
    mc.make_checkpoint(folder, mc.CheckpointConfig("llama-3.2-1b", layers=1, vocab=300, seed=SEED, shard_mb=20))
    return folder


def _missing_shard(folder: Path) -> str:
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[1].unlink()
    return rf"misses 1 of the {len(shards)} shards its index names \({re.escape(shards[1].name)}\); re-download"


def _truncated_shard(folder: Path) -> str:
    shard = sorted(folder.glob("model-*.safetensors"))[2]
    os.truncate(shard, shard.stat().st_size * 3 // 5)  # an interrupted download
    return rf"in {re.escape(shard.name)} is truncated: it ends at byte \d+ but the file has \d+; re-download"


def _truncated_header(folder: Path) -> str:
    shard = min(folder.glob("model-*.safetensors"))
    os.truncate(shard, 100)
    return rf"{re.escape(shard.name)} has a damaged or truncated header .*; re-download"


def _no_safetensors(folder: Path) -> str:
    for p in folder.glob("model*"):
        p.unlink()
    return r"has no model\.safetensors nor model\.safetensors\.index\.json; give a folder with safetensors weights"


def _rewrite_header(folder: Path, change) -> Path:
    """Rewrite the first shard's JSON header in place (padded with spaces to its length, as safetensors allows)."""
    shard = min(folder.glob("model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack_from("<Q", data)
    text = json.dumps(change(json.loads(data[8:8 + n])), separators=(",", ":")).encode()
    assert len(text) <= n
    data[8:8 + n] = text.ljust(n)
    shard.write_bytes(bytes(data))
    return shard


def _header_not_an_object(folder: Path) -> str:
    shard = _rewrite_header(folder, lambda h: [])
    return rf"{re.escape(shard.name)}'s header is not a safetensors header"


def _entry_without_dtype(folder: Path) -> str:
    def drop(h):
        name = next(k for k in h if k != "__metadata__")
        del h[name]["dtype"]
        return h
    _rewrite_header(folder, drop)
    return r"has a damaged header entry .*KeyError 'dtype'.*; re-download the shard"


def _negative_offset(folder: Path) -> str:
    def move(h):
        name = next(k for k in h if k != "__metadata__")
        start, end = h[name]["data_offsets"]
        h[name]["data_offsets"] = [start - 4, end - 4]  # read 4 bytes of the header as weights
        return h
    _rewrite_header(folder, move)
    return r"has a damaged header entry .*; re-download the shard"


def _index_of(folder: Path, body: str) -> str:
    (folder / "model.safetensors.index.json").write_text(body)
    return r"model\.safetensors\.index\.json is not a safetensors index .*; re-download it"


def _index_a_list(folder: Path) -> str:
    return _index_of(folder, "[]")


def _weight_map_a_list(folder: Path) -> str:
    return _index_of(folder, '{"weight_map": ["x"]}')


def _weight_map_to_a_number(folder: Path) -> str:
    return _index_of(folder, '{"weight_map": {"x": 5}}')


def _shard_outside(folder: Path) -> str:
    index = folder / "model.safetensors.index.json"
    body = json.loads(index.read_text())
    first = next(iter(body["weight_map"]))
    body["weight_map"][first] = "../elsewhere.safetensors"
    index.write_text(json.dumps(body))
    return r"names a shard outside the checkpoint's folder \(\.\./elsewhere\.safetensors\)"


def _truncated_tokenizer(folder: Path) -> str:
    tok = folder / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:1000])
    return r"cannot read the tokenizer in .*\(.*Error: .*\); .*re-download them"


def _no_tokenizer(folder: Path) -> str:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).unlink(missing_ok=True)
    return r"cannot read the tokenizer in .*; .*re-download them"


@pytest.mark.parametrize("damage", [_truncated_tokenizer, _no_tokenizer, _missing_shard, _truncated_shard, _truncated_header, _no_safetensors,
                                    _header_not_an_object, _entry_without_dtype, _negative_offset, _index_a_list,
                                    _weight_map_a_list, _weight_map_to_a_number, _shard_outside],
                         ids=lambda f: f.__name__.strip("_"))
def test_damaged_checkpoint_is_one_clear_error(damage, small_sharded, tmp_path):
    folder = tmp_path / "ckpt"
    shutil.copytree(small_sharded, folder)
    message = damage(folder)
    out = tmp_path / "outputs" / "api"
    with pytest.raises(ModelSourceError, match=message):
        export(folder, out)
    assert not out.exists() and list(out.parent.iterdir()) == []  # no output and no temp folder left beside it
    cli_out = tmp_path / "outputs" / "cli"
    env = dict(os.environ)
    if "tokenizer" not in damage.__name__:  # the checkpoint is read before the export's torch child starts (its
        (tmp_path / "no_child").mkdir()  # seconds of imports): here a child would die at once, unheard
        (tmp_path / "no_child" / "sitecustomize.py").write_text(
            "import sys\nif any('child_main' in a for a in sys.orig_argv):\n    sys.exit(3)\n")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "no_child"), str(ROOT)])
    proc = subprocess.run([sys.executable, "-m", "trtinfer", "export", str(folder), "-o", str(cli_out)],
                          check=False, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == ModelSourceError.exit_code, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("trtinfer export: error: ") and "Traceback" not in proc.stderr
    assert re.search(message, lines[0]), lines[0]
    assert proc.stdout == ""
    assert not cli_out.exists() and list(cli_out.parent.iterdir()) == []
    shutil.rmtree(tmp_path)


# --- 6. memory -----------------------------------------------------------------------------------------------------

# VmHWM, not ru_maxrss: Linux carries the parent's peak over exec into a child's ru_maxrss (here, pytest's RSS)
_PEAK = "print([line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')][0])"
_BASELINE = "import torch, transformers\n" + _PEAK
_EXPORT = """
import sys, torch, transformers
from trtinfer.export import ExportConfig, export
export(sys.argv[1], sys.argv[2], ExportConfig(validate=False, logits=sys.argv[3]))
""" + _PEAK


@pytest.fixture(scope="module")
def full_vocab_peak(workdir: Path) -> dict[str, float]:
    """GiB figures of the export of a 2-layer Qwen3 8B slice at its full 151,936-token vocabulary (1.63 B parameters:
    a 3.3 GB bf16 checkpoint, 6.5 GB in fp32, of which the untied LM head is 2.5 GB), run in a subprocess with no
    eager validation and ``logits="all"`` (no reference run in ONNX Runtime, whose mapped weights would count in
    the RSS): its peak RSS over an ``import torch, transformers`` baseline (``over``), the model's fp32 size, the
    LM head's fp32 size, and the size of the external data written."""
    folder, out = workdir / "qwen3-8b-full-vocab", workdir / "qwen3-8b-full-vocab-out"
    summary = mc.make_checkpoint(folder, mc.CheckpointConfig("qwen3-8b", layers=2, seed=SEED))

    def kib(*args: str) -> int:
        proc = subprocess.run([sys.executable, "-c", *args], check=False, capture_output=True, text=True, cwd=ROOT,
                              timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return int(proc.stdout.split()[-1])

    try:
        base = kib(_BASELINE)
        peak = kib(_EXPORT, str(folder), str(out), "all")
        data = out / DATA_NAME
        return {"over": (peak - base) * 1024 / GB, "fp32": 4 * summary["params"] / GB,
                "head_fp32": 4 * 151936 * 4096 / GB, "data": data.stat().st_size / GB if data.exists() else 0.0}
    finally:  # 10 GB: gone before the next test
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.slow
def test_full_vocab_export_holds_one_fp32_weight_at_most(full_vocab_peak):
    m = full_vocab_peak
    assert m["data"] < 0.01, m  # no copy of the 6.1 GiB of fp32 weights is written: they stay in the checkpoint...
    # ...and the trace holds at most one weight in fp32 at a time (it makes each contiguous in turn, the LM head is
    # the largest). A whole fp32 copy would be 6.1 GiB, a bf16 one 3.0 GiB on top of the trace's
    assert m["over"] < m["head_fp32"] + 1.0, m
    assert m["over"] < 0.6 * m["fp32"], m
