"""``python -m trtinfer``."""
import sys

from trtinfer.cli import main

sys.exit(main())
