"""One name per reader of a shared weight: the file is unchanged, the outputs too, and ONNX Runtime no longer keeps the
whole mapped table resident beside the head's prepacked copy (measured in a fresh process)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from trtinfer.builder.weight_views import one_name_per_reader

# a 128 MiB fp32 table at a real hidden size (measured here: at H=128 both forms grew alike; from 256 up the split
# form grows less)
V, H = 32768, 1024


def _tied_model(folder: Path) -> Path:
    """ids -> Gather(E) and FusedMatMul(Gather(E), E, transB=1) -> logits, E stored outside the graph."""
    folder.mkdir()
    table = (np.random.default_rng(0).standard_normal((V, H), dtype=np.float32) * 0.02)
    (folder / "w.data").write_bytes(table.tobytes())
    init = TensorProto(name="E", data_type=TensorProto.FLOAT, dims=[V, H], data_location=TensorProto.EXTERNAL)
    for key, value in (("location", "w.data"), ("offset", "0"), ("length", str(table.nbytes))):
        init.external_data.add(key=key, value=value)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["x"], axis=0),
             helper.make_node("FusedMatMul", ["x", "E"], ["logits"], domain="com.microsoft", transB=1)]
    graph = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


_PROBE = """
import json, sys, numpy as np, onnxruntime as ort
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
so = ort.SessionOptions(); so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
before = rss()
s = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
y = s.run(None, {"ids": np.arange(0, int(sys.argv[2]), 4099, dtype=np.int64)[None, :]})[0]
print(json.dumps({"grew_mib": rss() - before, "logits": y[0, :, :4].tolist()}))
"""


def _probe(model: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, str(model), str(V)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_each_reader_gets_a_name_over_the_same_bytes(tmp_path):
    shared = _tied_model(tmp_path / "shared")
    split = _tied_model(tmp_path / "split")
    data = (split.parent / "w.data").read_bytes()
    assert one_name_per_reader(split) == 1
    assert (split.parent / "w.data").read_bytes() == data  # the weights are not rewritten
    m = onnx.load(str(split), load_external_data=False)
    places = {t.name: {e.key: e.value for e in t.external_data} for t in m.graph.initializer}
    assert len(places) == 2 and len({json.dumps(p, sort_keys=True) for p in places.values()}) == 1
    assert [n.input[i] for n, i in zip(m.graph.node, (0, 1))] == sorted(places)  # one name per reader
    assert one_name_per_reader(split) == 0  # nothing shared is left

    a, b = _probe(shared), _probe(split)
    np.testing.assert_array_equal(np.array(a["logits"]), np.array(b["logits"]))
    table_mib = V * H * 4 / 2**20
    # shared: the table stays mapped (all of it: the packing read it) beside the packed copy; split: the packed
    # copy plus the gathered rows
    assert a["grew_mib"] - b["grew_mib"] > 0.6 * table_mib, (a["grew_mib"], b["grew_mib"])


def test_a_weight_read_once_or_by_no_gemm_is_left_alone(tmp_path):
    model = _tied_model(tmp_path / "m")
    m = onnx.load(str(model), load_external_data=False)
    m.graph.node[1].op_type, m.graph.node[1].domain = "Gather", ""  # two gathers: nothing is prepacked
    del m.graph.node[1].attribute[:]
    onnx.save(m, str(model))
    assert one_name_per_reader(model) == 0
