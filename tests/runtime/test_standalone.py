"""The runtime loads and runs an engine without torch or transformers."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_runtime_without_torch_or_transformers(tiny_engine):
    eng = tiny_engine("llama")
    code = textwrap.dedent(f"""
        import sys
        for name in ("torch", "transformers", "onnx"):
            sys.modules[name] = None  # any import of them now fails
        import trtinfer
        with trtinfer.load({str(eng)!r}) as e:
            r = e.generate(["Hello"], max_new_tokens=4, ignore_eos=True)
        assert len(r[0].token_ids) == 4
        assert not any(m.startswith(("torch", "transformers")) and sys.modules[m] is not None
                       for m in sys.modules)
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "ok"
