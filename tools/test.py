"""Evaluate weights on the test split: ``python tools/test.py --config-file CFG --options weight=PATH``."""

import os
import sys

# Run from a source checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pimm.cli import test_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(test_main())
