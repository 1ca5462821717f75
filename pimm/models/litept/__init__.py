"""``LitePT`` (upstream pimm's lightweight point transformer) in plain
PyTorch; see :mod:`pimm.models.litept.model`."""

from .attention import PointRoPE, PointRoPEAttention
from .model import LitePT

__all__ = ["LitePT", "PointRoPE", "PointRoPEAttention"]
