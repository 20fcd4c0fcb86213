"""The runtime stands alone: ``pip install trtinfer`` (no torch, transformers, onnx, onnxscript) runs the runtime
and its CLI verbs, and the verbs that need the export stack say what to install.

Each check runs in a fresh interpreter in which the export stack cannot be imported (a meta-path blocker raises
ModuleNotFoundError for it, as in an install without it) and asserts that none of it was loaded. ``.ci/run`` checks
the same in a real virtual environment without the stack.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "gguf", "ml_dtypes", "sentence_transformers")

# a fresh interpreter where the export stack is absent; the check code runs after it, then nothing heavy is loaded
_PRELUDE = f"""
import importlib.abc, sys
HEAVY = {HEAVY!r}
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, _Absent())
"""
_EPILOGUE = """
loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
assert not loaded, f"imported without need: {loaded}"
"""


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    script = _PRELUDE + textwrap.dedent(code) + _EPILOGUE
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          check=False)


def test_runtime_and_serving_import_without_the_export_stack() -> None:
    p = _run("""
        import pkgutil
        import trtinfer, trtinfer.runtime, trtinfer.serving
        trtinfer.load
        skip = {"trtinfer.serving.triton_model"}  # runs inside Triton only (imports triton_python_backend_utils)
        for m in pkgutil.iter_modules(trtinfer.serving.__path__, "trtinfer.serving."):
            if m.name not in skip:
                try:
                    __import__(m.name)
                except ModuleNotFoundError as e:  # an optional server stack ([serve], [ray], [triton]) is fine
                    if e.name.split(".")[0] in HEAVY:
                        raise
        import trtinfer.cli
        trtinfer.cli.parser()  # every verb registers its flags without the stack
    """)
    assert p.returncode == 0, p.stderr[-3000:]


def test_runtime_verbs_run_without_the_export_stack(tiny_engine) -> None:
    engine = str(tiny_engine("llama"))
    p = _run("""
        from trtinfer.cli import main
        engine = sys.argv[1]
        assert main(["generate", engine, "-p", "hi", "-n", "3", "--json"]) == 0
        assert main(["generate", engine, "-p", "hi", "-n", "3", "--stream"]) == 0
        assert main(["inspect", engine]) == 0
        assert main(["embed", engine, "--text", "hi"]) == 2  # the encoder path loads, then refuses a decoder
    """, engine)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "decoder engine" in p.stderr


@pytest.mark.parametrize("verb", ["export", "optimize", "quantize", "build"])
def test_export_verbs_say_what_to_install(verb: str, tmp_path: Path) -> None:
    args = {"quantize": ["--precision", "int4"]}.get(verb, [])
    p = _run(f"""
        from trtinfer.cli import main
        sys.exit_code = main([{verb!r}, "some-model", "-o", {str(tmp_path / 'out')!r}, *{args!r}])
        assert sys.exit_code == 2, sys.exit_code
    """)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == f"trtinfer {verb} needs the export stack: pip install 'trtinfer[export]'"
    assert not (tmp_path / "out").exists()


def test_missing_module_met_while_running_says_what_to_install(tiny_engine) -> None:
    """A runtime verb that reaches for the stack on one of its paths (inspect --target: onnx-ir) gets the line."""
    p = _run("""
        from trtinfer.cli import main
        code = main(["inspect", sys.argv[1], "--target", "tensorrt"])
        assert code == 2, code
    """, str(tiny_engine("llama")))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.strip() == "trtinfer inspect needs the export stack: pip install 'trtinfer[export]'"
