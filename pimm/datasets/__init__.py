"""Data sets, transforms and collate functions, plugged in through registries."""

from pimm.engines.registries import COLLATE_FNS, DATASETS, TRANSFORMS

from . import collate, jaxtpc, lartpc, multiview, pilarnet, pilarnet_parquet, rings, tracks, transforms  # noqa: F401  (register)
from . import concat, default_dataset, lucid, lucid_ssl  # noqa: F401  (register)

__all__ = ["DATASETS", "TRANSFORMS", "COLLATE_FNS"]
