"""``python -m trtinfer.cli``."""
import sys

from trtinfer.cli import main

sys.exit(main())
