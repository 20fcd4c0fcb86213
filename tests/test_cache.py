"""The cache checks its entries, crash leftovers are swept, outputs follow the umask, unwritable outputs say where."""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import trtinfer._cache as cache
from trtinfer._cache import (
    ENTRY_NAME,
    cached_dir,
    check_files,
    clean_cache,
    list_entries,
    record_files,
    verify_cache,
)
from trtinfer._outputs import atomic_dir, sweep_stale
from trtinfer.errors import OutputError, OutputExistsError

DATA = bytes(range(256)) * (4 * 4096)  # 4 MiB, as a stand-in for model.onnx.data


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """TRTINFER_CACHE pointed at a fresh folder."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TRTINFER_CACHE", str(root))
    return root


class Maker:
    """A ``make`` for cached_dir that writes DATA and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, out: Path) -> None:
        self.calls += 1
        (out / "model.onnx.data").write_bytes(DATA)
        (out / "sub").mkdir()
        (out / "sub" / "model.onnx").write_text("graph")


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "trtinfer._cache"]


def overwrite_middle(path: Path, data: bytes = b"\x7f" * 1024) -> None:
    with open(path, "r+b") as f:
        f.seek(len(DATA) // 2)
        f.write(data)


# --- entries that verify themselves ---------------------------------------------------------------------------------

def test_entry_records_each_file(cache_dir):
    path = cached_dir("onnx", "k", Maker())
    entry = json.loads((path / ENTRY_NAME).read_text())
    assert set(entry["files"]) == {"model.onnx.data", "sub/model.onnx"}
    rec = entry["files"]["model.onnx.data"]
    assert rec["size"] == len(DATA) and len(rec["sha256"]) == 64
    assert {"mtime_ns", "ctime_ns", "inode"} <= set(rec)
    assert not (path / ".complete").exists()


def test_same_size_corruption_is_rebuilt_with_one_warning(cache_dir, caplog):
    caplog.set_level(logging.WARNING, logger="trtinfer._cache")
    make = Maker()
    path = cached_dir("onnx", "k", make)
    overwrite_middle(path / "model.onnx.data")  # other valid bytes, same size, fresh mtime
    assert cached_dir("onnx", "k", make) == path
    assert make.calls == 2
    assert (path / "model.onnx.data").read_bytes() == DATA
    assert warnings_of(caplog) == [
        "cache entry onnx/k is damaged (model.onnx.data: sha256 differs from the recorded one); rebuilding it"]
    caplog.clear()
    cached_dir("onnx", "k", make)  # whole again: reused silently
    assert make.calls == 2 and warnings_of(caplog) == []


def test_truncated_entry_is_rebuilt(cache_dir, caplog):
    caplog.set_level(logging.WARNING, logger="trtinfer._cache")
    make = Maker()
    path = cached_dir("onnx", "k", make)
    os.truncate(path / "model.onnx.data", 12)
    cached_dir("onnx", "k", make)
    assert make.calls == 2 and (path / "model.onnx.data").read_bytes() == DATA
    assert warnings_of(caplog) == [
        f"cache entry onnx/k is damaged (model.onnx.data: size 12 != {len(DATA)}); rebuilding it"]


def test_missing_file_and_incomplete_entry_are_rebuilt(cache_dir, caplog):
    caplog.set_level(logging.WARNING, logger="trtinfer._cache")
    make = Maker()
    path = cached_dir("onnx", "k", make)
    (path / "sub" / "model.onnx").unlink()
    cached_dir("onnx", "k", make)
    assert make.calls == 2 and "sub/model.onnx: missing" in warnings_of(caplog)[0]
    # an entry of the old format (``.complete``, no record) or a half-copied one cannot be checked: made again
    old = cache_dir / "onnx" / "old"
    old.mkdir()
    (old / ".complete").write_text("ok\n")
    (old / "model.onnx.data").write_bytes(b"half")
    cached_dir("onnx", "old", make)
    assert make.calls == 3 and (old / ENTRY_NAME).is_file() and not (old / ".complete").exists()
    assert "incomplete" in warnings_of(caplog)[-1]


def test_unchanged_entry_is_not_rehashed(cache_dir, monkeypatch):
    make = Maker()
    path = cached_dir("onnx", "k", make)
    hashed: list[str] = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p, *a: hashed.append(Path(p).name) or real(p, *a))
    cached_dir("onnx", "k", make)
    assert hashed == []  # stamps match: sizes checked, nothing hashed
    os.utime(path / "model.onnx.data")  # touched, bytes unchanged: hashed once, then the new stamp is kept
    cached_dir("onnx", "k", make)
    assert hashed == ["model.onnx.data"] and make.calls == 1
    cached_dir("onnx", "k", make)
    assert hashed == ["model.onnx.data"]
    cached_dir("onnx", "k", make, verify="full")
    assert sorted(hashed[1:]) == ["model.onnx", "model.onnx.data"] and make.calls == 1


def test_full_verify_catches_what_the_stamp_cannot_see(cache_dir):
    make = Maker()
    path = cached_dir("onnx", "k", make)
    data = path / "model.onnx.data"
    st = data.stat()
    overwrite_middle(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime restored
    # and a stamp made to match (as a corruption below the file system would leave it): the stamp check trusts it
    entry = json.loads((path / ENTRY_NAME).read_text())
    entry["files"]["model.onnx.data"].update(ctime_ns=data.stat().st_ctime_ns, mtime_ns=data.stat().st_mtime_ns)
    (path / ENTRY_NAME).write_text(json.dumps(entry))
    cached_dir("onnx", "k", make)
    assert make.calls == 1
    cached_dir("onnx", "k", make, verify="full")
    assert make.calls == 2 and data.read_bytes() == DATA


def test_record_and_check_files_on_a_stage_dir(tmp_path):
    (tmp_path / "model.onnx.data").write_bytes(DATA)
    (tmp_path / "stage.json").write_text("{}")
    rec = record_files(tmp_path, ["model.onnx.data"])
    assert list(rec) == ["model.onnx.data"] and rec["model.onnx.data"]["size"] == len(DATA)
    assert set(record_files(tmp_path)) == {"model.onnx.data", "stage.json"}
    assert check_files(tmp_path, rec) is None
    overwrite_middle(tmp_path / "model.onnx.data")
    assert check_files(tmp_path, rec) == "model.onnx.data: sha256 differs from the recorded one"
    os.truncate(tmp_path / "model.onnx.data", 34)
    assert check_files(tmp_path, rec) == f"model.onnx.data: size 34 != {len(DATA)}"
    (tmp_path / "model.onnx.data").unlink()
    assert check_files(tmp_path, rec) == "model.onnx.data: missing"
    # a record without stamps (or with stale ones) is checked by hash, and gets the stamps it lacked
    (tmp_path / "model.onnx.data").write_bytes(DATA)
    bare = {"model.onnx.data": {"size": len(DATA), "sha256": rec["model.onnx.data"]["sha256"]}}
    assert check_files(tmp_path, bare) is None and "inode" in bare["model.onnx.data"]
    assert check_files(tmp_path, bare, full=True) is None


def test_unknown_verify_mode_is_refused(cache_dir):
    with pytest.raises(ValueError, match="verify must be one of"):
        cached_dir("onnx", "k", Maker(), verify="quick")


# --- crash leftovers ------------------------------------------------------------------------------------------------

def hold_lock(path: Path) -> int:
    """Lock ``path`` as a live build does (a second open file description conflicts even within this process)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_atomic_dir_sweeps_stale_leftovers_but_not_a_live_build(tmp_path):
    stale = [tmp_path / ".engine.tmp-12345-abcdefgh", tmp_path / ".engine.tmp-k3j4h5", tmp_path / ".engine.old-999-x"]
    for d in stale:
        (d / "deep").mkdir(parents=True)
        (d / "deep" / "w.bin").write_bytes(b"x" * 1000)
    live = tmp_path / ".engine.tmp-777-livebuil"
    live.mkdir()
    other = tmp_path / ".other.tmp-1-aaaaaaaa"  # another output's leftover: its own atomic_dir sweeps it
    other.mkdir()
    fd = hold_lock(live)
    try:
        with atomic_dir(tmp_path / "engine") as tmp:
            assert tmp.name.startswith(f".engine.tmp-{os.getpid()}-")
            (tmp / "manifest.json").write_text("{}")
        assert not any(d.exists() for d in stale)
        assert live.is_dir() and other.is_dir()
        assert (tmp_path / "engine" / "manifest.json").is_file()
        assert sweep_stale(tmp_path) == [(other, 0)]  # no name: every unlocked .*.tmp-* / .*.old-*
        assert live.is_dir()
    finally:
        os.close(fd)
    assert sweep_stale(tmp_path, "engine") == [(live, 0)]


def test_atomic_dir_holds_its_lock_and_cleans_up_on_failure(tmp_path):
    with pytest.raises(RuntimeError, match="boom"), atomic_dir(tmp_path / "engine") as tmp:
        with pytest.raises(BlockingIOError):
            hold_lock(tmp)
        raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []
    with atomic_dir(tmp_path / "engine") as tmp:
        (tmp / "a").write_text("1")
    with (pytest.raises(OutputExistsError, match="engine already exists; choose another -o or pass --force"),
          atomic_dir(tmp_path / "engine")):  # refused before the block runs: no work is wasted
        raise AssertionError("the block must not run")
    with atomic_dir(tmp_path / "engine", overwrite=True) as tmp:
        (tmp / "a").write_text("3")
    assert (tmp_path / "engine" / "a").read_text() == "3" and os.listdir(tmp_path) == ["engine"]


def test_cached_dir_sweeps_its_kind_folder(cache_dir):
    kind = cache_dir / "onnx"
    stale = kind / ".otherkey.tmp-4242-zzzzzzzz"
    live = kind / ".thirdkey.tmp-4243-yyyyyyyy"
    for d in (stale, live):
        d.mkdir(parents=True)
    fd = hold_lock(live)
    try:
        cached_dir("onnx", "k", Maker())
        assert not stale.exists() and live.is_dir()
    finally:
        os.close(fd)


def _leftovers(*folders: Path) -> list[str]:
    found = []
    for folder in folders:
        for root, dirs, _ in os.walk(folder):
            found += [os.path.join(root, d) for d in dirs if d.startswith(".") and (".tmp-" in d or ".old-" in d)]
    return found


def _kill_once_a_temp_dir_appears(cmd: list[str], env: dict[str, str], *folders: Path) -> None:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while not _leftovers(*folders):
            assert proc.poll() is None, f"the build ended before a temp dir was seen: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "no temp dir appeared in 300 s"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    assert _leftovers(*folders), "killed after the temp dirs were gone: nothing was tested"


def test_sigkill_mid_build_leaves_nothing_after_the_next_build(tiny_model_dir, tmp_path):
    cache_root = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TRTINFER_CACHE": str(cache_root)}
    work = tmp_path / "work"
    work.mkdir()

    def build(out: Path) -> list[str]:
        return [sys.executable, "-m", "trtinfer", "-q", "build", str(tiny_model_dir("llama")), "-o", str(out)]

    # cold cache: killed while the export fills its cache entry (.KEY.tmp-* in cache/onnx)
    _kill_once_a_temp_dir_appears(build(work / "OUT"), env, work, cache_root)
    assert not (work / "OUT").exists()
    done = subprocess.run(build(work / "OUT"), check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (work / "OUT" / "manifest.json").is_file()
    assert _leftovers(work, cache_root) == []
    # warm cache: writing the engine now takes milliseconds, too short to aim a kill at; so a process that holds
    # OUT2's temp dir as atomic_dir does is killed instead, and the real build must sweep what it left
    holder = textwrap.dedent(f"""
        import time
        from trtinfer._outputs import atomic_dir
        with atomic_dir({str(work / 'OUT2')!r}) as tmp:
            (tmp / "engine.onnx").write_bytes(b"x" * 1000)
            time.sleep(600)
    """)
    _kill_once_a_temp_dir_appears([sys.executable, "-c", holder], env, work)
    done = subprocess.run(build(work / "OUT2"), check=False, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (work / "OUT2" / "manifest.json").is_file()
    assert _leftovers(work, cache_root) == []


def test_scratch_dirs_are_left_alone_while_live_and_swept_once_their_process_dies(cache_dir, tmp_path):
    """Whole-model copies, calibration pieces and the reduced-depth check were made in unlocked ``.materialized-*``
    / ``.piece-*`` / ``.reduced-depth-*`` dirs: `trtinfer cache clean` removed a live build's (which then failed),
    and a killed build left them (full fp32 copies) for good, invisible to every sweep."""
    work = tmp_path / "work"
    for d in (cache_dir / "onnx", work):
        d.mkdir(parents=True)
    holder = textwrap.dedent(f"""
        import time
        from trtinfer._outputs import scratch_dir
        with scratch_dir({str(cache_dir / 'onnx')!r}, "somekey") as a, scratch_dir({str(work)!r}, "exp") as b:
            (a / "model.onnx.data").write_bytes(b"x" * 1000)
            time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", holder], env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 60
        while not (_leftovers(cache_dir) and _leftovers(work)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.2)  # the holder writes its file inside the locked dir
        assert clean_cache() == [] and sweep_stale(work, "exp") == []
        assert len(_leftovers(cache_dir)) == 1 and len(_leftovers(work)) == 1
    finally:
        proc.kill()
        proc.wait()
    assert [e.status for e in clean_cache()] == ["stale temp dir"]
    with atomic_dir(work / "exp") as tmp:  # the next write of that output sweeps the dead one's scratch
        (tmp / "a").write_text("1")
    assert _leftovers(cache_dir) == [] and _leftovers(work) == []


# --- modes ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)])
def test_outputs_follow_the_umask(tmp_path, umask, dir_mode, file_mode):
    script = textwrap.dedent(f"""
        import json, os, stat, tempfile
        from pathlib import Path
        os.umask({umask})
        from trtinfer._cache import cached_dir
        from trtinfer._outputs import atomic_dir, current_umask
        assert current_umask() == {umask}
        with atomic_dir(Path({str(tmp_path / 'engine')!r})) as tmp:
            (tmp / "plain.json").write_text("{{}}")
            fd, name = tempfile.mkstemp(dir=tmp)  # 0o600
            os.close(fd)
            os.rename(name, tmp / "from_mkstemp.bin")
            (tmp / "run.sh").write_text("#!/bin/sh")
            os.chmod(tmp / "run.sh", 0o700)
            os.rename(tempfile.mkdtemp(dir=tmp), tmp / "sub")  # 0o700
            (tmp / "sub" / "f").write_text("x")
        os.environ["TRTINFER_CACHE"] = {str(tmp_path / 'cache')!r}
        entry = cached_dir("onnx", "k", lambda t: (t / "model.onnx").write_text("g"))
        paths = [Path({str(tmp_path / 'engine')!r}), entry, entry.parent]
        for p in list(paths[:2]):
            paths += sorted(p.rglob("*"))
        print(json.dumps({{str(p): stat.S_IMODE(p.stat().st_mode) for p in paths}}))
    """)
    p = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert p.returncode == 0, p.stderr
    modes = json.loads(p.stdout)
    for path, mode in modes.items():
        name = Path(path).name
        want = dir_mode if Path(path).is_dir() or name == "run.sh" else file_mode
        assert mode == want, f"{path}: {oct(mode)} != {oct(want)}"
    assert len(modes) == 10


def test_a_cache_entry_links_a_users_file_only_where_its_modes_never_reach_it(cache_dir, tmp_path):
    """A user's file a cache entry names (a GGUF, a model folder's tokenizer) is hard-linked only when it already has
    the mode the entry's files get: setting an entry's modes through a link would make a 0600 model world-readable
    or a read-only one writable. Otherwise no link (the caller copies, or links symbolically)."""
    import stat

    from trtinfer._outputs import current_umask, link_into

    plain, private, read_only = (tmp_path / n for n in ("plain.gguf", "private.gguf", "read_only.gguf"))
    for f, mode in ((plain, 0o666 & ~current_umask()), (private, 0o600), (read_only, 0o444)):
        f.write_bytes(b"GGUF")
        os.chmod(f, mode)
    modes = {f: stat.S_IMODE(f.stat().st_mode) for f in (plain, private, read_only)}
    assert modes[plain] not in (modes[private], modes[read_only])  # the test needs a umask other than 077 / 0222

    def make(out: Path) -> None:
        assert [link_into(f, out / f.name) for f in (plain, private, read_only)] == [True, False, False]
        for f in (private, read_only):
            shutil.copyfile(f, out / f.name)

    entry = cache.cached_dir("models", "k", make)
    assert (entry / plain.name).samefile(plain) and not (entry / private.name).samefile(private)
    assert {f: stat.S_IMODE(f.stat().st_mode) for f in modes} == modes  # the entry's modes left the user's alone
    assert not link_into(tmp_path / "missing.gguf", tmp_path / "l")


# --- unwritable and full outputs ------------------------------------------------------------------------------------

@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs mounted at a fresh folder (needs root); unmounted afterwards."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("mount/umount are not installed")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=False, capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_output_names_the_final_path(tmpfs):
    final = tmpfs / "engine"
    with pytest.raises(OutputError) as err, atomic_dir(final) as tmp:
        (tmp / "model.onnx.data").write_bytes(b"\0" * 2_000_000)
    msg = str(err.value)
    assert msg == f"no space left on the device holding {tmpfs} (writing {final}); free space or choose another -o"
    assert ".tmp-" not in msg and err.value.exit_code == 2 and err.value.path == str(final)
    assert isinstance(err.value.__cause__, OSError) and err.value.__cause__.errno == errno.ENOSPC
    assert os.listdir(tmpfs) == []  # the temp dir went with the failure
    # a nested stage written into our temp dir (as export into a cache entry) is reported under our path
    with pytest.raises(OutputError) as err, atomic_dir(final) as tmp, atomic_dir(tmp / "export") as inner:
        (inner / "w.bin").write_bytes(b"\0" * 2_000_000)
    assert str(err.value).startswith(f"no space left on the device holding {tmpfs} (writing {final});")
    assert os.listdir(tmpfs) == []


def test_read_only_output_names_the_final_path(tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    for final in (tmpfs / "engine", tmpfs / "a" / "b" / "engine"):  # the second fails making its folder
        with pytest.raises(OutputError) as err, atomic_dir(final):
            pass
        assert str(err.value) == f"cannot write {final}: read-only file system; choose another -o"


def test_library_errors_saying_no_space_are_mapped(tmp_path):
    with pytest.raises(OutputError, match="no space left on the device holding"), atomic_dir(tmp_path / "e"):
        raise RuntimeError("onnx save failed: [Errno 28] No space left on device")
    with pytest.raises(OutputError, match="no space left"), atomic_dir(tmp_path / "e"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # a write() error names no file


def test_other_os_errors_pass_through(tmp_path):
    outside = PermissionError(errno.EACCES, "Permission denied", "/somewhere/else/model.safetensors")
    with pytest.raises(PermissionError) as err, atomic_dir(tmp_path / "e"):
        raise outside
    assert err.value is outside
    with pytest.raises(FileNotFoundError), atomic_dir(tmp_path / "e") as tmp:
        (tmp / "no" / "such").read_text()
    assert os.listdir(tmp_path) == []


# --- trtinfer cache -------------------------------------------------------------------------------------------------

def cli(*args, root: Path):
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TRTINFER_CACHE": str(root)}
    p = subprocess.run([sys.executable, "-m", "trtinfer", *map(str, args)], check=False, capture_output=True, text=True,
                       env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_cache_cli_info_clean_verify(cache_dir):
    for key in ("good", "corrupt", "short"):
        cached_dir("onnx", key, Maker())
    cached_dir("models", "m1", Maker())
    overwrite_middle(cache_dir / "onnx" / "corrupt" / "model.onnx.data")  # same size: only hashing sees it
    os.truncate(cache_dir / "onnx" / "short" / "model.onnx.data", 100)
    (cache_dir / "onnx" / "incomplete").mkdir()
    (cache_dir / "onnx" / "incomplete" / "model.onnx").write_bytes(b"x" * 1000)
    stale = cache_dir / "onnx" / ".gone.tmp-1-abcdefgh"
    stale.mkdir()
    (stale / "w.bin").write_bytes(b"x" * 2_000_000)
    live = cache_dir / "onnx" / ".live.tmp-2-abcdefgh"
    live.mkdir()
    fd = hold_lock(live)
    try:
        info = json.loads(cli("cache", "info", "--json", root=cache_dir))
        assert info["root"] == str(cache_dir)
        status = {f"{e['kind']}/{e['key']}": e["status"] for e in info["entries"]}
        assert status == {"onnx/good": "ok", "onnx/corrupt": "ok", "onnx/short": "damaged", "onnx/incomplete":
                          "incomplete", "onnx/.gone.tmp-1-abcdefgh": "stale temp dir",
                          "onnx/.live.tmp-2-abcdefgh": "building", "models/m1": "ok"}
        assert info["total_bytes"] == sum(e["bytes"] for e in info["entries"]) > 3 * len(DATA)
        text = cli("cache", "info", root=cache_dir)
        assert str(cache_dir) in text and "stale temp dir" in text and "total  7 dirs" in text

        out = cli("cache", "clean", root=cache_dir)
        assert "removed onnx/.gone.tmp-1-abcdefgh (stale temp dir, 2.0 MB)" in out
        assert "removed onnx/incomplete" in out and "removed onnx/short" in out and "freed " in out
        assert sorted(p.name for p in (cache_dir / "onnx").iterdir()) == [".live.tmp-2-abcdefgh", "corrupt", "good"]

        out = cli("cache", "verify", root=cache_dir)
        assert "onnx/corrupt  removed: model.onnx.data: sha256 differs from the recorded one" in out
        assert "onnx/good  ok" in out and "models/m1  ok" in out and "3 entries: 2 ok, 1 removed" in out
        assert not (cache_dir / "onnx" / "corrupt").exists()

        out = cli("cache", "clean", "--all", "--kind", "onnx", root=cache_dir)
        assert "removed onnx/good" in out
        assert [p.name for p in (cache_dir / "onnx").iterdir()] == [".live.tmp-2-abcdefgh"]
        assert (cache_dir / "models" / "m1").is_dir()
    finally:
        os.close(fd)
    assert _leftovers(cache_dir) == [str(live)]


@pytest.mark.parametrize("verb", ["info", "clean", "verify"])
def test_cache_cli_takes_a_damaged_entry_record(cache_dir, verb):
    """An entry record with "created": null crashed all three verbs (the one meant to clean it up included)."""
    cached_dir("onnx", "good", Maker())
    bad = cache_dir / "onnx" / "bad"
    bad.mkdir()
    (bad / ".entry.json").write_text('{"files": {}, "created": null}')
    out = cli("cache", verb, root=cache_dir)
    if verb == "info":
        assert "damaged" in out
    else:
        assert not bad.exists() and (cache_dir / "onnx" / "good").is_dir()


@pytest.mark.parametrize("memo", ["[]", '"x"', '{"k": 5}'])
def test_a_damaged_hash_memo_is_started_again(tiny_model_dir, cache_dir, memo):
    """A hashes.json that was valid JSON but not the memo's object broke every export and build."""
    from trtinfer.export.sources import resolve_model

    cache_dir.mkdir()
    (cache_dir / "hashes.json").write_text(memo)
    first = resolve_model(tiny_model_dir("llama")).sha256
    assert json.loads((cache_dir / "hashes.json").read_text())  # written again, as an object
    assert resolve_model(tiny_model_dir("llama")).sha256 == first


def test_cache_functions_match_the_cli(cache_dir):
    cached_dir("onnx", "a", Maker())
    assert [(e.kind, e.key, e.status) for e in list_entries()] == [("onnx", "a", "ok")]
    assert [(e.key, p) for e, p in verify_cache()] == [("a", None)]
    assert [e.key for e in clean_cache()] == []
    assert [e.key for e in clean_cache(everything=True, kind="models")] == []
    assert [e.key for e in clean_cache(everything=True)] == ["a"] and list_entries() == []
