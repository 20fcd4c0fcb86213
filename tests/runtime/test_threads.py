"""A process allowed fewer CPUs than the machine has (``taskset``, a container's cpuset) gets one ONNX Runtime thread
per allowed CPU by default, not one per physical core of the machine (which would oversubscribe the allowed CPUs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CHILD = r"""
import json, os, sys
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
import trtinfer
from trtinfer.runtime.ort_env import default_intra_op_threads
kw = json.loads(sys.argv[2])
with trtinfer.load(sys.argv[1], **kw) as eng:
    text = eng.generate(["Hello there"], max_new_tokens=3, do_sample=False)[0].text
    threads = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("Threads:")))
print(json.dumps({"allowed": default_intra_op_threads(), "threads": threads, "text": text}))
"""


def _child(engine, **kw) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(engine), json.dumps(kw)], check=True, capture_output=True,
                         text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 allowed CPUs to restrict a process to fewer")
def test_default_threads_follow_the_allowed_cpus(tiny_engine):
    engine = tiny_engine("llama")
    default = _child(engine)
    explicit = _child(engine, intra_op_threads=1)
    assert default["allowed"] == 1
    assert default["threads"] == explicit["threads"]  # the same pool as asking for one thread
    assert default["text"] == explicit["text"]
