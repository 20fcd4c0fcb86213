"""Print the README's N-th set-up command (1: the main job, 2: the tests), exactly as written there.

The commands are the first two ```bash blocks of README.md's "Set up" section; CI runs them from here so that
what a newcomer copies is what CI ran.
"""
import re
import sys
from pathlib import Path

text = Path(__file__).resolve().parent.parent.joinpath("README.md").read_text(encoding="utf-8")
section = re.search(r"^## Set up.*?(?=^## )", text, flags=re.DOTALL | re.MULTILINE)
if section is None:
    sys.exit("README.md has no '## Set up' section")
blocks = re.findall(r"```bash\n(.*?)```", section.group(0), flags=re.DOTALL)
if len(blocks) < 2:
    sys.exit(f"README.md's Set up section has {len(blocks)} bash block(s); it needs 2 (main job, tests)")
print(blocks[int(sys.argv[1]) - 1].strip())
