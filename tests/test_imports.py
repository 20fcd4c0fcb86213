"""The package's import rules, read from the source: the runtime stands alone, and no package reaches into another's
private names.

- ``trtinfer.runtime`` imports nothing of the build side or the serving side (export, passes, quantization,
  calibration, builder, serving, cli): a production app loads engines with onnxruntime + numpy + tokenizers only,
  and every other package may build on the runtime, never the reverse.
- A ``_private`` name (or module) is imported only from inside the package that defines it: ``trtinfer._cache`` by
  any module of ``trtinfer``, ``trtinfer.passes.layout._x`` by ``trtinfer.passes.*``, never
  ``trtinfer.runtime.sampling._x`` from ``trtinfer.serving``.

Every import is seen, including those inside functions (lazy imports count too).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "trtinfer"
RUNTIME_MUST_NOT_IMPORT = ("export", "passes", "quantization", "calibration", "builder", "serving", "cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, module, name)`` of every import in the file (``name`` None for ``import module``), relative imports
    resolved against the file's package."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            out += [(node.lineno, base, a.name) for a in node.names]
    return out


def _sources() -> list[Path]:
    return sorted(ROOT.rglob("*.py"))


def _private_owner(module: str, name: str | None) -> str | None:
    """The package that owns a private module or name reached by this import, or None when nothing private is."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:i]) or parts[0]  # a private module: its parent package owns it
    if name is not None and name.startswith("_") and not name.startswith("__"):
        return module.rpartition(".")[0] or module  # a private name of a module: that module's package owns it
    return None


def violations() -> tuple[list[str], list[str]]:
    """``(runtime -> build/serving imports, cross-package private imports)`` as ``file:line: what`` lines."""
    runtime_bad, private_bad = [], []
    for path in _sources():
        here = _module_name(path)
        rel = path.relative_to(ROOT.parent)
        for line, module, name in _imports(path):
            if not module.startswith("trtinfer"):
                continue
            target = module if name is None else f"{module}.{name}"
            if here.startswith("trtinfer.runtime") and any(
                    target == f"trtinfer.{p}" or target.startswith(f"trtinfer.{p}.") for p in RUNTIME_MUST_NOT_IMPORT):
                runtime_bad.append(f"{rel}:{line}: imports {target}")
            owner = _private_owner(module, name)
            if owner is not None and not (here == owner or here.startswith(owner + ".")):
                private_bad.append(f"{rel}:{line}: imports {target}, private to {owner}")
    return runtime_bad, private_bad


def test_rules_see_imports_inside_functions_and_relative_ones():
    """The checker itself: lazy and relative imports are resolved (a rule that saw nothing would pass vacuously)."""
    seen = {(m, n) for _, m, n in _imports(ROOT / "runtime" / "ort_env.py")}
    assert ("trtinfer._cache", "cache_path") in seen  # imported inside trt_cache_paths()
    assert _private_owner("trtinfer.runtime.sampling", "_x") == "trtinfer.runtime"
    assert _private_owner("trtinfer._cache", "key_of") == "trtinfer"
    assert _private_owner("trtinfer.runtime.sampling", "top_ids") is None
    assert len(_sources()) > 50


def test_runtime_imports_nothing_of_the_build_or_serving_side():
    runtime_bad, _ = violations()
    assert not runtime_bad, "the runtime must stand alone:\n" + "\n".join(runtime_bad)


def test_no_cross_package_private_imports():
    _, private_bad = violations()
    assert not private_bad, "make these names public leaf helpers:\n" + "\n".join(private_bad)


@pytest.mark.parametrize("module", ["trtinfer.runtime.session", "trtinfer.runtime.ort_session",
                                    "trtinfer.runtime.kv_layouts", "trtinfer.runtime.ort_env"])
def test_session_modules_stay_small(module):
    """The session split: interface, environment, ONNX Runtime session and KV layouts, each under ~500 lines."""
    path = ROOT.parent / (module.replace(".", "/") + ".py")
    assert len(path.read_text().splitlines()) < 400


def test_graph_passes_load_no_runtime():
    """Importing the passes, the export package or the stage records loads no part of the runtime (the package's
    top-level names come from it lazily)."""
    import subprocess
    import sys

    code = ("import sys, trtinfer, trtinfer.passes, trtinfer.passes.optimizer, trtinfer.export, trtinfer.stages\n"
            "print(sorted(m for m in sys.modules if m.startswith('trtinfer.runtime')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]"
