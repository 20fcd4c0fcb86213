"""The TensorRT and CUDA modules type-check against NVIDIA's API as ``tensorrt-stubs`` describes it.

TensorRT cannot be installed here, so this is how its calls are verified in CI: mypy checks every ``tensorrt`` call
(method names, argument counts and types, return types) in the modules that use it. The stubs (``tensorrt-stubs``
10.13, installed with ``--no-deps`` by the README's test command: it would pull TensorRT itself) ship
``tensorrt/__init__.pyi`` without a ``py.typed`` marker and a few lines mypy cannot parse (parameters named ``in``, a
required argument after defaults, a module-level ``bool`` shadowing the builtin, re-exports without ``as``);
:func:`stub_dir` copies them with those lines mended. A second check proves the stubs are really in force: a misspelt method must fail.
mypy follows only the stubs' imports (``follow_imports = skip`` elsewhere: names from numpy or other trtinfer modules are
``Any`` here; ``mypy trtinfer`` checks those): following every import took 48 s of CI, this takes ~5.
"""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRT_MODULES = ["trtinfer/builder/trt_backend.py", "trtinfer/runtime/trt_plan.py", "trtinfer/runtime/trt_session.py",
               "trtinfer/runtime/cuda.py"]
MYPY_INI = """[mypy]
python_version = 3.10
ignore_missing_imports = True
follow_imports = skip
[mypy-tensorrt,tensorrt_bindings,tensorrt_bindings.*]
ignore_errors = True
follow_imports = normal
"""


def _stub_files() -> Path | None:
    spec = importlib.util.find_spec("tensorrt_stubs")
    if spec is None or spec.origin is None:
        return None
    site = Path(spec.origin).parent.parent
    return site if (site / "tensorrt" / "__init__.pyi").is_file() else None


@pytest.fixture(scope="module")
def stub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site = _stub_files()
    if site is None:
        pytest.skip("tensorrt-stubs is not installed (pip install --no-deps tensorrt-stubs)")
    out = tmp_path_factory.mktemp("trt-stubs")
    for pkg in ("tensorrt", "tensorrt_bindings"):
        (out / pkg).mkdir()
        for f in (site / pkg).glob("*.pyi"):
            text = f.read_text()
            text = re.sub(r"\bin: ", "in_: ", text)  # a parameter named after a keyword
            text = re.sub(r"(=\s*None, )(channel_axis: int)\)", r"\1\2 = ...)", text)  # required after defaults
            text = "\n".join(line for line in text.splitlines()
                             if "tensorrt_libs" not in line and not re.match(r"^bool\s*[:=]", line))
            # a stub re-exports only ``import X as X`` names (PEP 484); the package's __init__ means them all
            text = re.sub(r"^from (\S+) import (\w+)$", r"from \1 import \2 as \2", text, flags=re.MULTILINE)
            (out / pkg / f.name).write_text(text)
    (out / "mypy.ini").write_text(MYPY_INI)
    return out


def _mypy(stub_dir: Path, files: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[str, int]:
    from mypy import api

    monkeypatch.setenv("MYPYPATH", str(stub_dir))
    out, err, code = api.run(["--config-file", str(stub_dir / "mypy.ini"), "--no-incremental",
                              "--cache-dir", str(stub_dir / ".mypy_cache"), *files])
    return out + err, code


def test_tensorrt_modules_type_check(stub_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    out, code = _mypy(stub_dir, TRT_MODULES, monkeypatch)
    assert code == 0, out


def test_stubs_catch_a_wrong_tensorrt_call(stub_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import tensorrt as trt\n"
                   "builder = trt.Builder(trt.Logger(trt.Logger.WARNING))\n"
                   "network = builder.create_netwrk(0)\n"  # misspelt
                   "config = builder.create_builder_config()\n"
                   "config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE)\n")  # missing the size
    out, code = _mypy(stub_dir, [str(bad)], monkeypatch)
    assert code == 1
    assert 'has no attribute "create_netwrk"' in out
    assert "set_memory_pool_limit" in out
