"""Train a model: ``python tools/train.py --config-file CFG [--num-gpus N] [--options k=v ...]``."""

import os
import sys

# Run from a source checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pimm.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
