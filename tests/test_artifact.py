"""One typed record of an artifact's facts: stage.json and manifest.json read through trtinfer.artifact; nothing
outside the manifest module indexes a manifest's raw dict."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from trtinfer.artifact import KV_LAYOUTS, GraphIO, KVLayoutKind, Manifest, read_manifest

ROOT = Path(__file__).resolve().parent.parent / "trtinfer"


def test_engine_and_stage_share_the_record(tiny_engine, tiny_model_dir):
    from trtinfer.export import ExportConfig
    from trtinfer.export.onnx_export import export_cached

    m = read_manifest(tiny_engine("llama"))
    assert m.kind == "decoder" and m.kv_layout == KVLayoutKind.SHARED_BUFFER.value
    assert GraphIO.from_dict(m.io.to_dict()) == m.io and "input_ids" in m.io.input_names
    assert m.io.kv_dtype == "float32" and m.precision == "fp32" and m.pooling["mode"] == "mean"
    stage = export_cached(tiny_model_dir("llama"), ExportConfig())
    assert stage.kind == "decoder" and stage.kv_layout in KV_LAYOUTS and stage.io.past
    as_engine = Manifest.of_stage(stage, "model.onnx", 64)
    assert as_engine.io == stage.io and as_engine.geometry == stage.geometry and as_engine.max_seq_len == 64


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="ring_buffer"):
        _ = Manifest({"kv_layout": "ring_buffer"}).kv_layout


def test_no_raw_manifest_lookups_outside_the_manifest_module():
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "artifact.py" and path.parent == ROOT:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"manifest\w*\.raw\b|\.raw\[|\.raw\.get\(", line):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


def test_a_stage_record_of_the_wrong_shape_is_one_line(tiny_model_dir, tmp_path):
    import json
    import shutil

    from trtinfer.artifact import STAGE_FILE, read_stage
    from trtinfer.errors import ModelSourceError
    from trtinfer.export import ExportConfig
    from trtinfer.export.onnx_export import export_cached

    stage = export_cached(tiny_model_dir("llama"), ExportConfig())
    for field, value, named in (("kv_layout", "ring_buffer", "kv_layout"), ("io", {"inputs": [{"name": "x"}]}, "io")):
        bad = tmp_path / field
        shutil.copytree(stage.path, bad)
        info = json.loads((bad / STAGE_FILE).read_text())
        info[field] = value
        (bad / STAGE_FILE).write_text(json.dumps(info))
        with pytest.raises(ModelSourceError, match=f"lacks or mistypes .*{named}.*; produce"):
            read_stage(bad, verify=False)


def test_a_stage_made_again_keys_the_next_stage_the_same(tiny_model_dir, tmp_path):
    """The next stage's cache key is the stage's content: made again from the same input (a damaged or cleaned
    entry), it must key the same, or an 8B model's GPTQ (55 minutes) would run again for a pass that took 0.42 s
    instead of 0.46. What the stage did still counts: another pass config keys differently."""
    import json

    from trtinfer.artifact import STAGE_FILE
    from trtinfer.export.onnx_export import export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage
    from trtinfer.stages import read_stage

    exp = export(tiny_model_dir("llama"), tmp_path / "export")
    config = PassConfig(target="onnxruntime-cpu", max_seq_len=64)
    one, two = (optimize_stage(exp, tmp_path / n, config) for n in ("one", "two"))
    info = json.loads((two.path / STAGE_FILE).read_text())
    for fusion in info["history"]["optimize"]["fusion_report"]["fusions"].values():  # timings differ run to run
        fusion["seconds"] = fusion.get("seconds", 0) + 1.0
    info["history"]["optimize"]["seconds"] += 1.0
    (two.path / STAGE_FILE).write_text(json.dumps(info))
    assert read_stage(two.path).content_key() == one.content_key()
    import onnx

    from trtinfer.passes.optimizer import REPORT_KEY

    props = {p.key: p.value for p in onnx.load(str(one.onnx_path), load_external_data=False).metadata_props}
    assert json.loads(props[REPORT_KEY])["fusions"]["attention"] == {"kind": "fusion", "fired": 2, "expected": 2}
    other = optimize_stage(exp, tmp_path / "other", PassConfig(target="onnxruntime-cpu", max_seq_len=32))
    assert other.content_key() != one.content_key()


def test_the_cached_export_links_the_model_folders_tokenizer(tiny_model_dir, tmp_path, monkeypatch):
    """The cached export names the model folder's tokenizer files without a second copy (a hard link: Qwen3's
    tokenizer.json is 11 MB, the whole of what a 14B build's cache held past one copy of the weights), a file whose
    mode the cache would change is copied, and an export the user asked for gets copies they may edit. Edited in
    place in the model folder, the tokenizer reaches the next build, its cached entry made again."""
    import os
    import shutil
    import stat

    from trtinfer._outputs import current_umask
    from trtinfer.export.onnx_export import export, export_cached
    from trtinfer.stages import read_stage

    monkeypatch.setenv("TRTINFER_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), src)
    blob = tmp_path / "blobs" / "0f3a"  # a hub snapshot: the folder's files are symbolic links to blobs
    blob.parent.mkdir()
    (src / "tokenizer.json").rename(blob)
    (src / "tokenizer.json").symlink_to(blob)
    os.chmod(blob, 0o666 & ~current_umask())
    os.chmod(src / "tokenizer_config.json", 0o400)
    cached = export_cached(src)
    assert (cached.path / "tokenizer.json").samefile(blob) and not (cached.path / "tokenizer.json").is_symlink()
    assert not (cached.path / "tokenizer_config.json").samefile(src / "tokenizer_config.json")
    assert stat.S_IMODE((src / "tokenizer_config.json").stat().st_mode) == 0o400
    assert (cached.path / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    mine = export(src, tmp_path / "mine")
    assert not (mine.path / "tokenizer.json").samefile(src / "tokenizer.json")
    with open(blob, "ab") as f:  # in place: the cached entry's file changes with it
        f.write(b" ")
    again = export_cached(src)
    assert read_stage(again.path).info["files"]["tokenizer.json"]["size"] == (src / "tokenizer.json").stat().st_size


def test_stages_share_their_tokenizer_files_and_engines_copy_them(tiny_model_dir, tmp_path):
    """A chain of stages keeps one copy of each carried file on disk (hard links): a 14B build's cache held 11 MB
    of tokenizer per stage. The engine's files stay copies: editing an engine's chat template must not change the
    cache. A stage whose linked file is edited in place is refused when read, like any changed file."""
    from trtinfer.builder import build
    from trtinfer.errors import ModelSourceError
    from trtinfer.export.onnx_export import export
    from trtinfer.passes import PassConfig
    from trtinfer.passes.optimizer import optimize_stage
    from trtinfer.stages import read_stage

    exp = export(tiny_model_dir("llama"), tmp_path / "export")
    opt = optimize_stage(exp, tmp_path / "opt", PassConfig(target="onnxruntime-cpu", max_seq_len=64))
    carried = [n for n in ("tokenizer.json", "reference.npz") if n in exp.info["files"]]
    assert carried == ["tokenizer.json", "reference.npz"]
    for name in carried:
        assert (opt.path / name).samefile(exp.path / name) and (opt.path / name).stat().st_nlink == 2
    engine = build(opt.path, tmp_path / "engine", progress=False)
    assert not (engine / "tokenizer.json").samefile(opt.path / "tokenizer.json")
    assert (engine / "tokenizer.json").read_bytes() == (opt.path / "tokenizer.json").read_bytes()
    with open(opt.path / "tokenizer.json", "ab") as f:  # an in-place edit reaches both stages: both are refused
        f.write(b" ")
    for stage in (exp.path, opt.path):
        with pytest.raises(ModelSourceError, match="tokenizer.json"):
            read_stage(stage)


def test_a_manifest_holds_json_integers_only(tiny_engine):
    """The structure check takes what JSON can write: a numpy integer in a manifest made in memory is refused in the
    manifest's words (not later by json.dump), while configs (runtime.config's is_int) take numpy integers."""
    import json

    import numpy as np

    from trtinfer.artifact import KINDS
    from trtinfer.errors import EngineLoadError
    from trtinfer.manifest_check import check_manifest
    from trtinfer.runtime.config import is_int

    raw = json.loads((tiny_engine("llama") / "manifest.json").read_text())
    check_manifest(Path("manifest.json"), raw, KINDS, KV_LAYOUTS)  # as built
    raw["limits"]["max_seq_len"] = np.int64(raw["limits"]["max_seq_len"])
    with pytest.raises(EngineLoadError, match=r"limits\.max_seq_len should be a positive integer"):
        check_manifest(Path("manifest.json"), raw, KINDS, KV_LAYOUTS)
    assert is_int(np.int64(3)) and not is_int(True)
