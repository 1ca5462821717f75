"""Data sets, transforms and collate functions, plugged in through registries."""

from pimm.engines.registries import COLLATE_FNS, DATASETS, TRANSFORMS

from . import collate, lartpc, multiview, pilarnet, rings, tracks, transforms  # noqa: F401  (register)
from . import concat, default_dataset, lucid, lucid_ssl  # noqa: F401  (register)

__all__ = ["DATASETS", "TRANSFORMS", "COLLATE_FNS"]
