"""Upstream pimm's import path for the packed point batch: ``from
pimm.models.utils.structure import Point`` is :class:`pimm.models.ptv3.structure.Point`."""

from pimm.models.ptv3.structure import Point

__all__ = ["Point"]
