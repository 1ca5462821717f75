"""Point Transformer v2 (``PT-v2m1``, ``PT-v2m2``, ``PT-v2m3``) in plain
PyTorch; see :mod:`pimm.models.ptv2.model`."""

from .model import PointTransformerV2, PointTransformerV2m2, PointTransformerV2m3

__all__ = ["PointTransformerV2", "PointTransformerV2m2", "PointTransformerV2m3"]
