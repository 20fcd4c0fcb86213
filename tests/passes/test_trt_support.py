"""TensorRT parser support: the op counter and per-node problems on hand-written graphs that must pass and must
fail for each reason, the check pass, and tiny exports built for TensorRT."""
from __future__ import annotations

import onnx.parser
import onnx_ir as ir
import pytest

from trtinfer.errors import BuildError
from trtinfer.passes import PassConfig, PassContext
from trtinfer.passes.trt_support import TENSORRT_ONNX_OPS, tensorrt_check, tensorrt_problems, unsupported_ops

from ._fusion_checks import ORT, TRT, export_once, run_passes

# an ORT-fused norm next to an op TensorRT lacks, one of them inside an If branch (5 nodes in all)
MIXED = """
<ir_version: 10, opset_import: ["" : {OPSET}, "com.microsoft" : 1]>
g (float[B,S,8] x, float[B,S,8] res, bool c) => (float[B,S,8] y, float[N] u)
<float[8] w = {1, 1, 1, 1, 1, 1, 1, 1}>
{
  y, mean, inv, h = com.microsoft.SkipSimplifiedLayerNormalization <epsilon = 1e-6> (x, res, w)
  u = If (c) <
    then_branch = t () => (float[N] ut) { ut = Unique (x) },
    else_branch = e () => (float[N] ue) { f = Flatten <axis = 0> (x)  ue = Unique (f) }
  >
}
"""
PLAIN = """
<ir_version: 10, opset_import: ["" : {OPSET}]>
g (float[B,S,8] x) => (float[B,S,8] y)
{
  s = Sigmoid(x)
  y = Mul(x, s)
}
"""


def _model(text: str, opset: int = 17) -> ir.Model:
    return ir.from_proto(onnx.parser.parse_model(text.replace("{OPSET}", str(opset))))


def test_unsupported_ops_counts_contrib_and_missing_ops_in_subgraphs() -> None:
    assert unsupported_ops(_model(MIXED)) == {"Unique": 2, "com.microsoft::SkipSimplifiedLayerNormalization": 1}


def test_unsupported_ops_empty_for_standard_graph() -> None:
    assert unsupported_ops(_model(PLAIN)) == {}


def test_op_list_has_what_the_passes_emit_for_tensorrt() -> None:
    assert {"RMSNormalization", "LayerNormalization", "Gelu", "MatMul", "Softmax"} <= TENSORRT_ONNX_OPS
    assert not {"SimplifiedLayerNormalization", "Unique", "FastGelu"} & TENSORRT_ONNX_OPS


def test_check_names_every_rejected_node() -> None:
    with pytest.raises(BuildError, match=r"reject 3 node\(s\): .*com.microsoft::SkipSimplifiedLayerNormalization\)"
                                         r".*\(Unique\): not in TensorRT 10.15's ONNX operator list"):
        tensorrt_check(_model(MIXED), PassContext(PassConfig(target=TRT), {}))


def test_check_lists_ten_problems_and_counts_the_rest() -> None:
    body = "\n".join(f"[t{i}] v{i}, i{i} = TopK<sorted = 0>(x, k)" for i in range(6))  # 2 problems each
    outs = ", ".join(f"float[4000] v{i}, int64[4000] i{i}" for i in range(6))
    model = _model(f'<ir_version: 10, opset_import: ["" : 17]>\ng (float[5000] x) => ({outs})\n'
                   f'<int64[1] k = {{4000}}>\n{{ {body} }}')
    with pytest.raises(BuildError, match=r"reject 6 node\(s\): t0 \(TopK\): sorted=0.*; t4 \(TopK\): K=4000[^;]*; "
                                         r"and 2 more\. "):
        tensorrt_check(model, PassContext(PassConfig(target=TRT), {}))


def test_check_rejects_opset_outside_tensorrt_range() -> None:
    with pytest.raises(BuildError, match=r"\(model\) \(opset_import\): default opset 8 is outside TensorRT 10.15's 9..24"):
        tensorrt_check(_model(PLAIN, opset=8), PassContext(PassConfig(target=TRT), {}))


def test_check_passes_standard_graph_and_ignores_ort_targets() -> None:
    assert tensorrt_check(_model(PLAIN), PassContext(PassConfig(target=TRT), {})) == 0
    assert tensorrt_check(_model(MIXED), PassContext(PassConfig(target=ORT), {})) == 0


# --- per-node problems on hand-written graphs -----------------------------------------------------------------------

def _graph(opset: int, signature: str, nodes: str, inits: str = "", functions: str = "") -> ir.Model:
    """A model from its signature, nodes and initializers (com.microsoft, custom and local domains imported)."""
    head = f'<ir_version: 10, opset_import: ["" : {opset}, "com.microsoft" : 1, "custom" : 1, "local" : 1]>'
    return ir.from_proto(onnx.parser.parse_model(f"{head}\ng {signature}\n<{inits}>\n{{\n{nodes}\n}}\n{functions}"))


# graphs TensorRT's parser takes whole: the forms the tensorrt pipeline and quantizer emit, and their neighbours
# (opset, signature, nodes, initializers, local functions)
PASSING = [
    pytest.param(18, "(float[2,8] x, double[2,8] d) => (float[2,1] y, float[2,4] v, int64[2,4] i, float[2,8] e)", """
        [pow] p = Pow(x, two)
        [mean] m = ReduceMean<keepdims = 1>(p, axes)
        [sqrt] y = Sqrt(m)
        [ax] ax1 = Constant<value_ints = [0]>()
        [unsq] u = Unsqueeze(x, ax1)
        [sq] q = Squeeze(u, ax1)
        [topk] v, i = TopK(q, k)
        [cast] dc = Cast<to = 1>(d)
        [add] e = Add(dc, x)""", "float two = {2.0}, int64[1] axes = {-1}, int64[1] k = {4}", "", id="llm ops, double"),
    pytest.param(21, "(float[2,128] x, int4[128,8] w, float[2,8] ws) => (float[2,8] y)", """
        [q] xq = QuantizeLinear(x, s, zp)
        [dq] xd = DequantizeLinear(xq, s, zp)
        [wdq] wf = DequantizeLinear<axis = 0, block_size = 64>(w, ws)
        [mm] h = MatMul(xd, wf)
        [ln] y = LayerNormalization(h, g)""", "float s = {0.1}, int8 zp = {0}, float[8] g = {1, 1, 1, 1, 1, 1, 1, 1}",
                 "", id="int8 and int4 Q/DQ"),
    pytest.param(19, "(float[1,2,4,4] x) => (float[1,2,8,8] y, float[1,2,4,4] z)", """
        [rs] y = Resize<mode = "linear", coordinate_transformation_mode = "pytorch_half_pixel">(x, "", sc)
        [pool] pl = MaxPool<kernel_shape = [2, 2], dilations = [1, 1]>(x)
        [drop] z = Dropout(x, ratio, off)""", "float[4] sc = {1, 1, 2, 2}, float ratio = {0.1}, bool off = {0}", "",
                 id="resize, pool, dropout"),
    pytest.param(20, "(float[2,8] x) => (float[2,8] y)", "[call] y = local.Gelu2(x)", "",
                 '<domain: "local", opset_import: ["" : 20]>\nGelu2 (a) => (b) { [in_fn] b = Gelu(a) }',
                 id="local function"),
]


@pytest.mark.parametrize("opset,signature,nodes,inits,functions", PASSING)
def test_graph_tensorrt_takes_has_no_problems(opset: int, signature: str, nodes: str, inits: str,
                                              functions: str) -> None:
    assert tensorrt_problems(_graph(opset, signature, nodes, inits, functions)) == []


# (opset, signature, nodes, initializers) -> the problems expected, in order: (node, op, part of the reason)
FAILING = [
    pytest.param(17, "(float[2,8] x) => (float[2,8] y)", "[fg] y = com.microsoft.FastGelu(x)", "",
                 [("fg", "com.microsoft::FastGelu", "ONNX Runtime contrib op")], id="contrib op"),
    pytest.param(17, "(float[2,8] x) => (float[2,8] y)", "[c] y = custom.Foo(x)", "",
                 [("c", "custom::Foo", "op of domain custom: TensorRT's parser takes default-domain ONNX ops")],
                 id="other domain"),
    pytest.param(17, "(float[8] x) => (float[N] y)", "[u] y = Unique(x)", "",
                 [("u", "Unique", "not in TensorRT 10.15's ONNX operator list")], id="op not in the list"),
    pytest.param(25, "(float[2,8] x) => (float[2,8] y)", "[r] y = Relu(x)", "",
                 [("(model)", "opset_import", "default opset 25 is outside TensorRT 10.15's 9..24")], id="opset 25"),
    pytest.param(17, "(uint16[4] x) => (bool[4] y)", "[eq] y = Equal(x, x)", "",
                 [("eq", "Equal", "'x' is UINT16, a type TensorRT lacks")], id="uint16 tensor"),
    pytest.param(17, "(string[4] x) => (string[4] y)", "[id] y = Identity(x)", "",
                 [("id", "Identity", "'x' is STRING"), ("id", "Identity", "'y' is STRING")], id="string tensor"),
    pytest.param(17, "(float[2] x) => (bool[2] y)", "[eq] y = Equal(x, x)\n[c] z = Identity(cplx)",
                 "complex64[1] cplx = {0, 0}", [("c", "Identity", "'cplx' is COMPLEX64")], id="complex initializer"),
    pytest.param(17, "(float[4] x) => (uint32[4] y)", "[c] t = Cast<to = 12>(x)\n[i] y = Identity(t)", "",
                 [("c", "Cast", "casts to UINT32"), ("i", "Identity", "'y' is UINT32")], id="cast to uint32"),
    pytest.param(18, "(float[2,8] x, int64[1] axes) => (float[2,1] y)", "[r] y = ReduceMean(x, axes)", "",
                 [("r", "ReduceMean", "`axes` must be an initializer, found graph input 'axes'")], id="reduce axes input"),
    pytest.param(13, "(float[2,8] x) => (float[2,1] y)", "[n] a = Neg(m)\n[r] y = ReduceSum(x, a)", "int64[1] m = {1}",
                 [("r", "ReduceSum", "`axes` must be an initializer, found computed tensor 'a'")], id="computed reduce axes"),
    pytest.param(17, "(float[2,8] x, int64 ax) => (float[2,8] y)", "[cs] y = CumSum(x, ax)", "",
                 [("cs", "CumSum", "`axis` must be an initializer")], id="cumsum axis"),
    pytest.param(17, "(int64[4] x, int64 d) => (float[4,N] y)", "[oh] y = OneHot(x, d, v)", "float[2] v = {0, 1}",
                 [("oh", "OneHot", "`depth` must be an initializer")], id="onehot depth"),
    pytest.param(17, "(float[2,1] x, int64[1] ax) => (float[2] y)", "[sq] y = Squeeze(x, ax)", "",
                 [("sq", "Squeeze", "`axes` must be a constant, found graph input 'ax'")], id="squeeze axes input"),
    pytest.param(17, "(float[2,8] x) => (float[2,8] y)", "[d] y = Dropout(x, r, t)", "float r = {0.1}, bool t = {1}",
                 [("d", "Dropout", "`training_mode` must be an initializer holding False")], id="dropout training"),
    pytest.param(17, "(float[2,5000] x) => (float[2,4000] v, int64[2,4000] i)", "[t] v, i = TopK<sorted = 0>(x, k)",
                 "int64[1] k = {4000}", [("t", "TopK", "sorted=0 is unsupported"),
                                         ("t", "TopK", "K=4000, TensorRT takes K < 3840")], id="topk"),
    pytest.param(18, "(float[1,2,4,4] x) => (float[1,2,8,8] y)",
                 '[rs] y = Resize<mode = "cubic", antialias = 1>(x, "", sc)', "float[4] sc = {1, 1, 2, 2}",
                 [("rs", "Resize", "mode='cubic' is unsupported (TensorRT takes 'nearest', 'linear')"),
                  ("rs", "Resize", "antialias=1")], id="resize cubic antialiased"),
    pytest.param(18, "(float[1,2,4,4] x, float[2] sc) => (float[1,2,8,8] y)",
                 '[rs] y = Resize<axes = [2, 3]>(x, "", sc)', "",
                 [("rs", "Resize", "with computed scales, axes must be [0, 1, 2, 3], found [2, 3]")],
                 id="resize computed scales on some axes"),
    pytest.param(17, "(float[2,8] x) => (float[2,8] y, float[2,1] m, float[2,1] r)",
                 "[ln] y, m, r = LayerNormalization(x, g)", "float[8] g = {1, 1, 1, 1, 1, 1, 1, 1}",
                 [("ln", "LayerNormalization", "only the first output `Y` is supported; the node declares 3")],
                 id="layernorm statistics"),
    pytest.param(17, "(float[1,2,8] x) => (float[1,2,4] y, int64[1,2,4] i)",
                 "[mp] y, i = MaxPool<kernel_shape = [2], strides = [2]>(x)", "",
                 [("mp", "MaxPool", "2D or 3D pooling only, found 1D"), ("mp", "MaxPool", "`Indices`")],
                 id="maxpool 1D with indices"),
    pytest.param(19, "(float[1,2,8,8] x) => (float[1,2,6,6] y)",
                 "[ap] y = AveragePool<kernel_shape = [2, 2], dilations = [2, 2]>(x)", "",
                 [("ap", "AveragePool", "dilations=[2, 2], TensorRT takes all ones")], id="dilated average pool"),
    pytest.param(17, "(float[2] x) => (float[2] y)", '[k] s = Constant<value_string = "a">()\n[r] y = Relu(x)', "",
                 [("k", "Constant", "attribute value_string unsupported")], id="string constant"),
    pytest.param(17, "(float[2,8] x) => (float[2,8] y)", """
        [q] xq = QuantizeLinear(x, s, zp)
        [dq] y = DequantizeLinear(xq, s, zp)""", "float s = {0.1}, int8 zp = {3}",
                 [("q", "QuantizeLinear", "zero point 'zp' must be an all-zero initializer"),
                  ("dq", "DequantizeLinear", "zero point 'zp' must be an all-zero")], id="asymmetric int8"),
    pytest.param(17, "(float[2,8] x) => (float[2,8] y)", """
        [q] xq = QuantizeLinear(x, s, zp)
        [dq] y = DequantizeLinear(xq, s, zp)""", "float s = {0.1}, uint8 zp = {0}",
                 [("q", "QuantizeLinear", "quantized type UINT8, TensorRT takes INT8, INT4, FLOAT8E4M3FN"),
                  ("dq", "DequantizeLinear", "quantized type UINT8")], id="uint8 quantization"),
    pytest.param(17, "(float[2,8] x, int8 zp) => (int8[2,8] y)", "[q] y = QuantizeLinear(x, s, zp)", "float s = {0.1}",
                 [("q", "QuantizeLinear", "zero point 'zp' must be an all-zero initializer")], id="computed zero point"),
    pytest.param(21, "(int4[128,8] w, float[4,8] s) => (float[128,8] y)",
                 "[dq] y = DequantizeLinear<axis = 0, block_size = 32>(w, s)", "",
                 [("dq", "DequantizeLinear", "INT4 needs blocks of 64 or 128, found block_size=32")], id="int4 block 32"),
    pytest.param(21, "(int4[128,8] w, float[8] s) => (float[128,8] y)", "[dq] y = DequantizeLinear<axis = 1>(w, s)", "",
                 [("dq", "DequantizeLinear", "found block_size=0")], id="int4 per channel"),
    pytest.param(21, "(int4[128,4,8] w, float[2,4,8] s) => (float[128,4,8] y)",
                 "[dq] y = DequantizeLinear<axis = 0, block_size = 64>(w, s)", "",
                 [("dq", "DequantizeLinear", "along one of the last two axes, found axis=0 of a 3D")],
                 id="int4 blocks on the first of 3 axes"),
    pytest.param(23, "(float[1,4,32] q, float[1,4,16] k, float[1,4,16] v, float[1,2,4,8] pk, float[1,2,4,8] pv) => "
                     "(float[1,4,32] y)",
                 '[at] y = Attention<q_num_heads = 4, kv_num_heads = 2, softcap = 30.0>(q, k, v, "", pk, pv)', "",
                 [("at", "Attention", "must be 4D: Q 3D, K 3D, V 3D"),
                  ("at", "Attention", "input past_key, past_value unsupported"),
                  ("at", "Attention", "softcap=30.0 is unsupported")], id="attention 3D with cache and softcap"),
    pytest.param(17, "(float[2,1,4] x, float[2,12,4] w, float[2,12,3] r) => (float[2,1,2,3] y)", """
        [ls] y = LSTM<hidden_size = 3, layout = 1, direction = "bidirectional",
                      activations = ["Sigmoid", "Tanh", "Tanh", "Sigmoid", "Relu", "Tanh"]>(x, w, r)""", "",
                 [("ls", "LSTM", "forward ['Sigmoid', 'Tanh', 'Tanh'], reverse ['Sigmoid', 'Relu', 'Tanh']"),
                  ("ls", "LSTM", "layout=1 is unsupported")], id="lstm"),
    pytest.param(17, "(float[2,8] x, bool c) => (float[N] z)", """
        [if] z = If(c) <then_branch = t () => (float[2,8] zt) { zt = Identity(x) },
                        else_branch = e () => (float[16] ze) { ze = Reshape(x, s) }>""", "int64[1] s = {16}",
                 [("if", "If", "same rank: 'zt' 2D, 'ze' 1D")], id="if branches of different rank"),
    pytest.param(17, "(float[8] x, int64[2,1] i, float[2] u) => (float[8] y)",
                 '[sc] y = ScatterND<reduction = "add">(x, i, u)', "",
                 [("sc", "ScatterND", "reduction='add' is unsupported")], id="scatternd add"),
    pytest.param(24, "(float[1,2,8,4] c, float[1,1,8,4] u) => (float[1,2,8,4] y)", "[ts] y = TensorScatter<axis = 1>(c, u)",
                 "", [("ts", "TensorScatter", "axis=1 is unsupported (TensorRT takes -2)")], id="tensorscatter axis"),
    pytest.param(24, "(float[1,2,8,4] c, float[1,1,8,4] u) => (float[1,2,8,4] y)",
                 "[c2] c2 = Relu(c)\n[ts] y = TensorScatter<axis = -2>(c2, u)", "",
                 [("ts", "TensorScatter", "past_cache 'c2' must be a graph input")], id="tensorscatter computed cache"),
    # invalid ONNX too (the spec asks INT64 as well): operators.md repeats the rule
    pytest.param(23, "(float[1,4,2,8] x, float[16,4] cos, float[16,4] sin, int32[1,4] p) => (float[1,4,2,8] y)",
                 "[rot] y = RotaryEmbedding(x, cos, sin, p)", "",
                 [("rot", "RotaryEmbedding", "`position_ids` must be INT64, found INT32")], id="rotary int32 positions"),
    pytest.param(20, "(float[1,2,4,4,4] x, float[1,4,4,4,3] g) => (float[1,2,4,4,4] y)", "[gs] y = GridSample(x, g)", "",
                 [("gs", "GridSample", "must be 4D: input 5D")], id="gridsample 5D"),
    pytest.param(17, "(float[N,4] x) => (float[N,4] y)", "[eye] y = EyeLike(x)", "",
                 [("eye", "EyeLike", "input shape [N,4] must be static")], id="eyelike dynamic"),
    pytest.param(17, "(float[2,M] x) => (float[2,M] y)", "[hm] y = Hardmax<axis = 1>(x)", "",
                 [("hm", "Hardmax", "input dimension 1 (M) must be static")], id="hardmax dynamic axis"),
    pytest.param(17, "(float[1,64,1] x, float[16] w) => (float[1,N,M,2] y)", "[st] y = STFT(x, step, w)",
                 "int64 step = {8}", [("st", "STFT", "`window` must be an initializer, found graph input 'w'")],
                 id="stft computed window"),
    pytest.param(19, "(float[1,2,8,8] x, float[2,2,3,3] w, float[1,18,7,7] o) => (float[1,2,7,7] y)",
                 "[dc] y = DeformConv<pads = [0, 0, 1, 1]>(x, w, o)", "",
                 [("dc", "DeformConv", "pads [0, 0, 1, 1]: begin and end must be equal")], id="deformconv uneven pads"),
    pytest.param(17, "(float[8] x, bool c) => (float[N] u, float[N] f)", """
        [if] u = If(c) <then_branch = t () => (float[N] ut) { [in_then] ut = Unique(x) },
                        else_branch = e () => (float[N] ue) { ue = Identity(x) }>
        [call] f = local.Uniq(x)""", "",
                 [("in_then", "Unique", "operator list"), ("in_fn", "Unique", "operator list")],
                 id="op not in the list in a branch and a called function"),
]
# a local function with an op TensorRT lacks: in every failing graph, reported only where a node calls it
UNIQ = '<domain: "local", opset_import: ["" : 17]>\nUniq (a) => (b) { [in_fn] b = Unique(a) }'


@pytest.mark.parametrize("opset,signature,nodes,inits,expected", FAILING)
def test_graph_tensorrt_rejects_lists_each_node_and_reason(opset: int, signature: str, nodes: str, inits: str,
                                                           expected: list[tuple[str, str, str]]) -> None:
    problems = tensorrt_problems(_graph(opset, signature, nodes, inits, UNIQ))
    assert [(p.node, p.op) for p in problems] == [(node, op) for node, op, _ in expected], problems
    for p, (_, _, reason) in zip(problems, expected):
        assert reason in p.reason, p


def test_unnamed_nodes_are_named_by_their_output() -> None:
    assert [p.node for p in tensorrt_problems(_model(MIXED))] == ["<y>", "<ut>", "<ue>"]


# --- tiny exports ---------------------------------------------------------------------------------------------------

CHAIN = ("rms_norm", "layer_norm", "skip_norm", "gelu", "matmul_bias")


@pytest.fixture(scope="module")
def exports(tiny_model_dir, tmp_path_factory):
    """``exports(arch)`` -> the tiny model's exported ``model.onnx`` (once per session)."""
    return lambda arch: export_once(arch, tiny_model_dir, tmp_path_factory)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_export_for_tensorrt_is_all_supported(arch: str, exports) -> None:
    model, counts = run_passes(exports(arch), TRT, (*CHAIN, "tensorrt_check"))
    assert counts["tensorrt_check"] == (0, None)
    assert unsupported_ops(model) == {}
    assert not any(n.domain == "com.microsoft" for n in model.graph)
    assert "com.microsoft" not in model.opset_imports


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tiny_export_fused_for_ort_fails_the_check(arch: str, exports) -> None:
    model, _ = run_passes(exports(arch), ORT, CHAIN)
    with pytest.raises(BuildError, match="com.microsoft::Skip"):
        tensorrt_check(model, PassContext(PassConfig(target=TRT), {}))
