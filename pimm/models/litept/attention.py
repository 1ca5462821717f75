"""LitePT's attention: PT-v3's serialized patch attention whose queries and
keys are rotated by the points' voxel coordinates (upstream's ``pointrope``).

``pointrope`` is a CUDA extension upstream builds from ``libs/pointrope``;
its function, read off its CPU loop and CUDA kernel, is: a head of ``D``
channels (``D`` a multiple of 6) is cut into three chunks of ``D / 3``, one
per axis (x, y, z in that order); within a chunk, channel ``d`` and
channel ``d + D / 6`` rotate together by the angle ``p * F0 / freq^(6 d / D)``,
``p`` being the point's integer grid coordinate on that axis
(``u' = u cos - v sin``, ``v' = v cos + u sin``). That is the rotate-half
convention of PT-v3m8's RoPE (:func:`pimm.models.ptv3.rope.rotate_axes`) on
the grid instead of the coordinates, so it runs here as that function.
Upstream rounds q, k and v to float16 for its flash kernel; here the
attention runs in the features' dtype (float32 unless under autocast).
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.utils.errors import ConfigError

from ..ptv3.attention import SerializedAttention
from ..ptv3.rope import rotate_axes
from ..ptv3.rows import PatchRows

__all__ = ["PointRoPE", "PointRoPEAttention"]


class PointRoPE(nn.Module):
    """``pointrope.PointROPE(freq, F0)`` for heads of ``head_dim`` channels.
    Its frequencies are not saved (upstream's module has no state)."""

    def __init__(self, head_dim: int, freq: float = 100.0, F0: float = 1.0):
        super().__init__()
        if head_dim % 6:
            raise ConfigError(f"LitePT: an attention head has {head_dim} channels; pointrope rotates pairs on three "
                              "axes, so it needs a multiple of 6: choose enc/dec_channels and *_num_head so that "
                              "channels / num_head is")
        chunk = head_dim // 3
        self.register_buffer("inv_freq", F0 / freq ** (torch.arange(0, chunk, 2).float() / chunk), persistent=False)

    def forward(self, q: torch.Tensor, key: torch.Tensor, grid: torch.Tensor):
        """``q``, ``key`` (P, H, K, D), ``grid`` (P, K, 3) integer -> rotated ``q``, ``key``."""
        return rotate_axes((q, key), grid.float(), self.inv_freq)


class PointRoPEAttention(SerializedAttention):
    """Upstream's ``PointROPEAttention`` (parameters ``qkv``, ``proj``): patch
    attention as PT-v3's flash path (events shorter than a patch are one
    patch of their own; ``patch_size=-1``: whole events), q and k rotated by
    :class:`PointRoPE` on ``grid_coord``."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, rope_freq: float, qkv_bias: bool = True,
                 qk_scale=None, attn_drop: float = 0.0, proj_drop: float = 0.0, order_index: int = 0):
        super().__init__(channels, num_heads, patch_size, qkv_bias, qk_scale, attn_drop, proj_drop, order_index,
                         enable_rpe=False, enable_flash=True, upcast_attention=False, upcast_softmax=False)
        self.rope = PointRoPE(channels // num_heads, freq=rope_freq)

    def level_patch_size(self, point) -> int:
        # Upstream caches a level's patches under one name whatever the patch
        # size: the first block that attends on a level (the encoder's, when
        # its stage attends) sets them, and the decoder's blocks there reuse them.
        return point["_cache"].setdefault("litept_patch_size", self.patch_size)

    def position_qk(self, point, rows: PatchRows, k: int, q: torch.Tensor, key: torch.Tensor):
        grid = point["grid_coord"].index_select(0, rows.gather).view(-1, k, 3)
        return self.rope(q, key, grid)
