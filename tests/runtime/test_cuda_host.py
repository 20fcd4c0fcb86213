"""The host side of the CUDA helpers: numpy views over raw memory, and clean errors where no GPU is visible."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from trtinfer.errors import BackendUnavailableError
from trtinfer.runtime import cuda


def test_host_view_reads_and_writes_the_memory_in_place():
    raw = (ctypes.c_char * 64)()
    view = cuda.host_view(ctypes.addressof(raw), 64, (2, 3), np.int64)
    view[...] = np.arange(6).reshape(2, 3)
    assert np.frombuffer(bytes(raw)[:48], np.int64).tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="needs 72 bytes, the buffer holds 64"):
        cuda.host_view(ctypes.addressof(raw), 64, (9,), np.int64)


def test_no_gpu_is_one_clear_error():
    try:
        rt = cuda.cudart()
    except BackendUnavailableError as e:
        assert "cuda-python" in str(e)
        return
    err, count = rt.cudaGetDeviceCount()
    if err == rt.cudaError_t.cudaSuccess and count > 0:
        pytest.skip("a GPU is visible")
    with pytest.raises(cuda.CudaError, match="cudaGetDeviceProperties failed: "):
        cuda.device_info(0)
