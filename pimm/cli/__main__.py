"""``python -m pimm.cli <command> ...``: the ``pimm`` command without installing it."""

import sys

from pimm.cli import main

if __name__ == "__main__":
    sys.exit(main())
