"""Point Transformer V3 (``PT-v3m1``, ``PT-v3m2``, ``PT-v3m8``) in plain
PyTorch; see :mod:`pimm.models.ptv3.model` and :mod:`pimm.models.ptv3.v3m8`."""

from .model import PointTransformerV3, PointTransformerV3m2
from .structure import Point
from .v3m8 import PointTransformerV3m8

__all__ = ["Point", "PointTransformerV3", "PointTransformerV3m2", "PointTransformerV3m8"]
