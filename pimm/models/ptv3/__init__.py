"""Point Transformer V3 (``PT-v3m1``, ``PT-v3m2``) in plain PyTorch; see
:mod:`pimm.models.ptv3.model`."""

from .model import PointTransformerV3, PointTransformerV3m2
from .structure import Point

__all__ = ["Point", "PointTransformerV3", "PointTransformerV3m2"]
