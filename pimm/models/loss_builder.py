"""The loss registry under upstream pimm's import path ``pimm.models.losses.builder``.

pimm's losses are one module (:mod:`pimm.models.losses`), not a package, so
``pimm.models.losses.builder`` cannot be a file; :mod:`pimm.models` registers
this module under that name when it is imported (which any import below
``pimm.models`` does first), so ``from pimm.models.losses.builder import LOSSES,
build_criteria`` works unchanged.
"""

from pimm.models.losses import LOSSES, Criteria, build_criteria

__all__ = ["LOSSES", "Criteria", "build_criteria"]
