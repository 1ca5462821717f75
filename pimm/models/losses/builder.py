"""The loss registry under upstream pimm's import path ``pimm.models.losses.builder``
(``from pimm.models.losses.builder import LOSSES, build_criteria``)."""

from .base import LOSSES, Criteria, build_criteria

__all__ = ["LOSSES", "Criteria", "build_criteria"]
