"""``python -m pimm.cli.train ...``: ``tools/train.py`` as a module. ``pimm train --num-gpus N``
re-runs this module in each worker process (see :func:`pimm.cli._as_verb`)."""

import sys

from pimm.cli import train_main

if __name__ == "__main__":
    sys.exit(train_main())
