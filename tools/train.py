"""Train a model: ``python tools/train.py --config-file CFG [--num-gpus N] [--options k=v ...]``."""

import os
import sys

# Idle OpenMP threads sleep instead of spinning: with spinning, a 2-thread run
# slows down several-fold as soon as anything else uses a core. Must be set
# before torch is imported; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Run from a source checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_INTERRUPTED = 130  # as pimm.engines.run.launch: Ctrl-C at any moment of start-up is one line, exit 130


def _interrupted() -> int:
    print("error: interrupted during start-up (nothing was written)", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


try:  # importing torch and the models takes seconds: a Ctrl-C then is no traceback either
    from pimm.cli import train_main  # noqa: E402
except KeyboardInterrupt:
    if __name__ == "__main__":
        sys.exit(_interrupted())
    raise

if __name__ == "__main__":
    try:
        code = train_main()
    except KeyboardInterrupt:  # while registering the models and data sets (the launcher catches its own)
        code = _interrupted()
    sys.exit(code)
