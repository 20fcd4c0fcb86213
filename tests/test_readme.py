"""README's quickstart runs as written: its Python block on the Gemma-3-270M engine its first command builds."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtinfer.builder import build

README = Path(__file__).parent.parent / "README.md"


def readme_python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_readme_names_the_engine_its_first_command_builds():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert first and "trtinfer build gemma-3-270m -o engines/gemma3" in first.group(1)
    assert 'trtinfer.load("engines/gemma3")' in readme_python_blocks()[0]


@pytest.mark.slow
def test_readme_python_quickstart_runs_on_the_default_engine(tmp_path, in_user_cache):
    with in_user_cache():
        build("gemma-3-270m", tmp_path / "engines" / "gemma3", progress=False)
    blocks = readme_python_blocks()
    forward = next(b for b in blocks if "engine.context(" in b)  # the Forward API example, on the same engine
    code = blocks[0] + forward + "\nprint('best candidate', tok.decode(best))\n"
    code += ("plain = engine.generate([f'Repeat this exactly: {passage}'], chat=True, max_new_tokens=40, "
             "do_sample=False)[0]\n"
             "print('beams ordered', top.score >= runner_up.score, 'lookup', plain.token_ids == r.token_ids)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(README.parent)}, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    # the two batched prompts' results print their finish reasons (chat and streaming ran without error too)
    assert p.stdout.count("'prompt_tokens'") >= 2 and ("stop" in p.stdout or "length" in p.stdout)
    assert "best candidate  Paris" in p.stdout  # the candidate-scoring example picks the right city
    assert "beams ordered True lookup True" in p.stdout  # beam search ranks; prompt lookup = plain greedy
