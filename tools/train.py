"""Train a model: ``python tools/train.py --config-file CFG [--num-gpus N] [--options k=v ...]``."""

import os
import sys

# Idle OpenMP threads sleep instead of spinning: with spinning, a 2-thread run
# slows down several-fold as soon as anything else uses a core. Must be set
# before torch is imported; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Run from a source checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pimm.cli import train_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(train_main())
