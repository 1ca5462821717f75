"""Data sets, transforms and collate functions, plugged in through registries."""

from pimm.engines.registries import COLLATE_FNS, DATASETS, TRANSFORMS

from . import collate, lartpc, multiview, pilarnet, rings, tracks, transforms, upstream_hints  # noqa: F401  (register)

__all__ = ["DATASETS", "TRANSFORMS", "COLLATE_FNS"]
