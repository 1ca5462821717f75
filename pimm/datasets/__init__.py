"""Data sets, transforms and collate functions, plugged in through registries."""

from pimm.engines.registries import COLLATE_FNS, DATASETS, TRANSFORMS

from . import collate, jaxtpc, lartpc, multiview, pilarnet, pilarnet_parquet, rings, tracks, transforms  # noqa: F401  (register)
from . import concat, default_dataset, lucid, lucid_ssl  # noqa: F401  (register)
from . import upstream_hints  # noqa: F401,E402  (hints for upstream names not built; after the real ones)

__all__ = ["DATASETS", "TRANSFORMS", "COLLATE_FNS"]
