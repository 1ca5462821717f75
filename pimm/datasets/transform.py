"""Upstream pimm's import path for transforms: ``from pimm.datasets.transform import
TRANSFORMS, Compose``. pimm's transforms live in :mod:`pimm.datasets.transforms`."""

from pimm.engines.registries import TRANSFORMS
from pimm.datasets.transforms import Compose

__all__ = ["TRANSFORMS", "Compose"]
