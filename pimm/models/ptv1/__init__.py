"""Point Transformer v1 (``PointTransformer-Seg/PartSeg/Cls26/38/50``) in
plain PyTorch; see :mod:`pimm.models.ptv1.model`."""

from .model import VARIANTS, PointTransformerCls, PointTransformerPartSeg, PointTransformerSeg

__all__ = ["VARIANTS", "PointTransformerSeg", "PointTransformerPartSeg", "PointTransformerCls"]
