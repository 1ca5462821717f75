"""``python -m pimm.cli.test ...``: ``tools/test.py`` as a module. ``pimm test --num-gpus N``
re-runs this module in each worker process (see :func:`pimm.cli._as_verb`)."""

import sys

from pimm.cli import test_main

if __name__ == "__main__":
    sys.exit(test_main())
