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
