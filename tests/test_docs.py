"""The documentation site: `mkdocs build --strict` passes, the generated pages follow the code and the results (a
flag of the parsers, every error class, every result file), and the built site renders in headless Chromium."""
from __future__ import annotations

import functools
import http.server
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                       capture_output=True, text=True, check=False, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


def test_generated_pages_follow_the_code_and_results(site):
    from trtinfer import errors
    from trtinfer.cli import VERBS

    cli = (site / "reference" / "cli" / "index.html").read_text()
    for verb in VERBS:
        assert f'id="trtinfer-{verb}"' in cli
    assert "--chat-template" in cli and "--speculative-ngram" in cli  # flags as the parsers define them
    errs = (site / "reference" / "errors" / "index.html").read_text()
    for name in ("TrtInferError", "InputError", "QueueFullError", "EngineLoadError"):
        assert f"<code>{name}</code>" in errs and hasattr(errors, name)
    index = (site / "benchmarks" / "results" / "index.html").read_text()
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        assert f'href="{path.stem}/"' in index
        page = (site / "benchmarks" / "results" / path.stem / "index.html").read_text()
        machine = json.loads(path.read_text()).get("machine") if path.stat().st_size < 5_000_000 else None
        if isinstance(machine, dict) and machine.get("cpu"):
            assert str(machine["cpu"]).split()[0] in page
    api = (site / "reference" / "python-api" / "index.html").read_text()
    assert "max_new_tokens" in api and "Scheduler" in api  # the docstrings made it in


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
def test_site_renders_in_headless_chromium(site, tmp_path):
    """The home page and a benchmark page, served on loopback, rendered by Chromium: screenshots made, the pages'
    text present in the rendered DOM (Material's navigation included)."""
    browser = _chromium()
    if browser is None:
        pytest.skip("no Chromium here (Debian: apt-get install chromium)")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,900"]
    try:
        for page, words in (("", ["Getting started", "Benchmarks"]), ("benchmarks/cpu/", ["PyTorch eager", "trtinfer"])):
            shot = tmp_path / f"{page.strip('/').replace('/', '_') or 'home'}.png"
            subprocess.run([browser, *flags, f"--screenshot={shot}", f"{base}/{page}"], capture_output=True,
                           timeout=120, check=False)
            assert shot.is_file() and shot.stat().st_size > 20_000  # a rendered page, not a blank one
            dom = subprocess.run([browser, *flags, "--dump-dom", f"{base}/{page}"], capture_output=True, text=True,
                                 timeout=120, check=False).stdout
            assert all(w in dom for w in words) and "md-nav" in dom
    finally:
        server.shutdown()
