"""Training as a module or a script: ``python -m pimm.train --config-file CFG
[--options k=v ...]`` and ``torchrun --nproc-per-node N pimm/train.py ...``
(upstream pimm's entry points). The arguments and behaviour are those of
``tools/train.py`` / ``pimm train``; ``pimm launch`` runs this module.
"""

import os
import sys

if __name__ == "__main__" and not __package__:
    # Run as a file (torchrun pimm/train.py): Python put pimm/ itself first on
    # sys.path, where its sub-packages (datasets, models, utils, ...) would shadow
    # top-level modules of those names; import pimm from the checkout instead.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
    sys.path.insert(0, os.path.dirname(_here))

# Idle OpenMP threads sleep instead of spinning (see tools/train.py); before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

EXIT_INTERRUPTED = 130


def main(argv=None) -> int:
    try:  # importing torch and the models takes seconds: Ctrl-C then is one line, not a traceback
        from pimm.cli import train_main
    except KeyboardInterrupt:
        print("error: interrupted during start-up (nothing was written)", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    return train_main(argv)


if __name__ == "__main__":
    sys.exit(main())
