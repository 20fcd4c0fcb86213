"""``BlockWeight`` and ``MatMulNBits``' input layout: packing and reading back are inverses, and ONNX Runtime computes
``x @ dequantize()`` from the packed inputs."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trtinfer.quantization.blocks import BlockWeight, quantize_rtn


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_matmul_nbits_inputs_read_back(bits, symmetric):
    k, n, block = 96, 40, 32  # 3 blocks a column: an odd count, so 4-bit zero points end in a padding nibble
    rng = np.random.default_rng(0)
    w = rng.standard_normal((k, n)).astype(np.float32)
    q = quantize_rtn(w, bits, block, symmetric)
    zps = q.packed_zero_points()
    assert (zps is None) == symmetric
    back = BlockWeight.from_matmul_nbits(q.packed(), q.flat_scales(), zps, k, n, bits, block)
    np.testing.assert_array_equal(back.codes, q.codes)
    np.testing.assert_array_equal(back.scales, q.scales)
    if symmetric:
        assert back.zero_points is None
    else:
        np.testing.assert_array_equal(back.zero_points, q.zero_points)

    inputs = [numpy_helper.from_array(q.packed(), "b"), numpy_helper.from_array(q.flat_scales(), "scales")]
    if zps is not None:
        inputs.append(numpy_helper.from_array(zps, "zp"))
    node = helper.make_node("MatMulNBits", ["x", "b", "scales", *(["zp"] if zps is not None else [])], ["y"],
                            domain="com.microsoft", K=k, N=n, bits=bits, block_size=block)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])], inputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x @ back.dequantize(), rtol=1e-4, atol=1e-4 * np.abs(y).max())
