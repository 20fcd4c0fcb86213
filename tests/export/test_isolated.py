"""trtinfer.export.isolated: the export's torch work runs in a child interpreter (results, log records and
exceptions come back as they were), and a build in a fresh process never loads torch or transformers itself."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest

from trtinfer.errors import ConfigError, ExportError
from trtinfer.export import isolated
from trtinfer.export.config import ExportConfig


def test_the_call_runs_in_another_process_and_returns_its_value():
    assert isolated.run(os.getpid, child=True) != os.getpid()
    assert isolated.run(sorted, [3, 1, 2], child=True) == [1, 2, 3]
    assert isolated.run(os.getpid, child=False) == os.getpid()


def test_log_records_reach_this_process_loggers_at_their_levels(caplog):
    caplog.set_level(logging.INFO, logger="trtinfer")
    isolated.run(logging.getLogger("trtinfer.child").info, "traced %s in %.1f s", "llama", 1.25, child=True)
    isolated.run(logging.getLogger("trtinfer.child").debug, "not sent", child=True)
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records if r.name == "trtinfer.child"]
    assert got == [("trtinfer.child", logging.INFO, "traced llama in 1.2 s")]


def test_exceptions_are_raised_here_as_they_were_raised_there():
    with pytest.raises(ConfigError, match="opset must be within") as err:
        isolated.run(ExportConfig, 3, child=True)  # ExportConfig(opset=3)
    assert type(err.value) is ConfigError
    with pytest.raises(ValueError, match="invalid literal"):
        isolated.run(int, "x", child=True)


def test_a_child_that_dies_without_answering_is_one_clear_error():
    with pytest.raises(ExportError, match=r"ended \(exit code 3\) before it answered"):
        isolated.run(os._exit, 3, child=True)


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(entry))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_the_child_dies_with_its_parent():
    """SIGTERM (or SIGKILL) to a build left its export child running to the end, holding its memory."""
    import signal
    import time

    program = "import time; from trtinfer.export import isolated; isolated.run(time.sleep, 600, child=True)"
    parent = subprocess.Popen([sys.executable, "-c", program], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 60
        while not (kids := _children(parent.pid)):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1)  # the child is past its start-up (and its prctl)
        parent.send_signal(signal.SIGTERM)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{kids[0]}") and _state(kids[0]) != "Z":
            assert time.monotonic() < deadline, "the export child outlived its parent"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_build_in_a_fresh_process_keeps_torch_out_of_it(tiny_model_dir, tmp_path):
    src = tiny_model_dir("llama")
    script = textwrap.dedent(f"""
        import sys
        from trtinfer.builder import BuildConfig, build
        build({str(src)!r}, {str(tmp_path / "engine")!r}, BuildConfig(), progress=False)
        print("torch" in sys.modules, "transformers" in sys.modules)
    """)
    env = {**os.environ, "TRTINFER_CACHE": str(tmp_path / "cache")}
    env.pop(isolated.IN_PROCESS_ENV, None)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["False", "False"]
    import json

    manifest = json.loads((tmp_path / "engine" / "manifest.json").read_text())
    assert manifest["export"]["validation"]["passed"]
    # the export's peak is the child's (torch and the model), recorded beside this process's own
    assert manifest["stages"]["export"]["children_peak_rss_mib"] > 200
