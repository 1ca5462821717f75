"""Data sets, transforms and collate functions, plugged in through registries."""

from pimm.engines.registries import COLLATE_FNS, DATASETS, TRANSFORMS

from . import collate, jaxtpc, lartpc, multiview, pilarnet, pilarnet_parquet, rings, tracks, transforms  # noqa: F401  (register)
from . import concat, default_dataset, lucid, lucid_ssl  # noqa: F401  (register)
# Upstream's other transforms, one module per family (importing any module of
# this package runs this file first, so every transform name is registered).
from . import transforms_color, transforms_crop, transforms_energy  # noqa: F401,E402
from . import transforms_instance, transforms_spatial, multiview_extra, transforms_anchors  # noqa: F401,E402

__all__ = ["DATASETS", "TRANSFORMS", "COLLATE_FNS"]
