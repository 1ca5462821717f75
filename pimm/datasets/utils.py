"""Upstream pimm's import path for the collate functions: ``from pimm.datasets.utils
import collate_fn`` (and ``point_collate_fn``), from :mod:`pimm.datasets.collate`."""

from pimm.datasets.collate import collate_fn, point_collate_fn

__all__ = ["collate_fn", "point_collate_fn"]
