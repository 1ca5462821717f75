"""Evaluate weights on the test split: ``python tools/test.py --config-file CFG --options weight=PATH``."""

import os
import sys

# Idle OpenMP threads sleep instead of spinning: with spinning, a 2-thread run
# slows down several-fold as soon as anything else uses a core. Must be set
# before torch is imported; an explicit setting in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Run from a source checkout without installing.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXIT_INTERRUPTED = 130  # as pimm.engines.run.launch: Ctrl-C at any moment of start-up is one line, exit 130

try:  # importing pimm.cli is quick, but a Ctrl-C then is no traceback either (test_main covers the rest)
    from pimm.cli import test_main  # noqa: E402
except KeyboardInterrupt:
    if __name__ == "__main__":
        print("error: interrupted during start-up (nothing was written)", file=sys.stderr, flush=True)
        sys.exit(EXIT_INTERRUPTED)
    raise

if __name__ == "__main__":
    sys.exit(test_main())
