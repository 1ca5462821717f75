"""Patch attention with 3D rotary position embedding and QK-norm (PT-v3m8).

PT-v3m8 (upstream's "Utonia-style" PT-v3) tells the attention where the
points are by rotating queries and keys: each head's ``D`` channels are cut
into three chunks of ``D / 3``, one per axis, and each chunk gets 1D RoPE
(rotate-half convention: the chunk's two halves are rotated as pairs by the
angle ``coord_axis * inv_freq``, ``inv_freq = base^(-2i / (D/3))``). The
positions are the points' own ``coord`` (at pooled levels, the mean of the
pooled points' coordinates), not the integer grid. Because the score of a
query and a key then depends only on their coordinate difference, no RPE
table is needed.

Options, with upstream's meaning:

* ``qk_norm``: LayerNorm (eps 1e-6, over ``D``) on queries and keys before
  the rotation (parameters ``q_norm`` / ``k_norm``).
* ``rope_base``: the frequency base (default 10: positions here are
  normalized coordinates of order 1, not token indices).
* ``rope_jitter`` / ``rope_rescale`` (training only, off unless > 1): every
  attention call multiplies the coordinates it rotates by, per axis,
  ``exp(U(-log g, log g))`` (3 draws) and then, for all axes,
  ``exp(U(-log s, log s))`` (1 draw) -- DINOv3's position augmentation. The
  draws come from torch's global generator in that order, as upstream's.
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.utils.errors import ConfigError

from .attention import SerializedAttention
from .rows import PatchRows

__all__ = ["AxisRoPE", "RoPEAttention", "rotate_axes"]


class AxisRoPE(nn.Module):
    """1D RoPE per axis on three chunks of the head. ``inv_freq`` is a
    (persistent) buffer, as upstream's, so its state dicts load strictly."""

    def __init__(self, head_dim: int, base: float = 10, jitter: float | None = None,
                 rescale: float | None = None):
        super().__init__()
        if head_dim % 6:
            raise ConfigError(f"PT-v3m8: a head has {head_dim} channels; 3D RoPE needs a multiple of 6 "
                              "(3 axes x rotation pairs): choose enc/dec_channels and *_num_head so that "
                              "channels / num_head is")
        self.chunk = head_dim // 3
        self.jitter, self.rescale = jitter, rescale
        # Same float32 expression as upstream, so the frequencies are the same bits.
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, self.chunk, 2).float() / self.chunk))

    @torch.no_grad()
    def _augment(self, xyz: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return xyz
        for degree, draws in ((self.jitter, 3), (self.rescale, 1)):
            if degree is not None and degree > 1:
                # The bound in xyz's dtype first, as upstream, so the same draw gives the same factor.
                bound = float(torch.tensor(degree, dtype=xyz.dtype).log())
                xyz = xyz * torch.empty(draws, device=xyz.device, dtype=xyz.dtype).uniform_(-bound, bound).exp()
        return xyz

    def forward(self, q: torch.Tensor, key: torch.Tensor, xyz: torch.Tensor):
        """``q``, ``key`` (P, H, K, D), ``xyz`` (P, K, 3) -> rotated ``q``, ``key``."""
        return rotate_axes((q, key), self._augment(xyz), self.inv_freq)


def rotate_axes(tensors, xyz: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each of ``tensors`` (P, H, K, D) rotated by the positions ``xyz`` (P, K, 3)
    of its slots: head chunk ``a`` (of three, ``D / 3`` channels) by axis
    ``a``, its two halves as pairs turned by ``xyz[..., a] * inv_freq``
    (``inv_freq``: ``D / 6`` frequencies); angles in ``xyz``'s dtype, each
    result back in its tensor's dtype."""
    half = inv_freq.numel()
    angle = (xyz.unsqueeze(-1) * inv_freq).unsqueeze(1).unsqueeze(-2)  # (P, 1, K, 3, 1, D/6)
    cos, sin = angle.cos(), angle.sin()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.unflatten(-1, (3, 2, half))  # per axis: the two halves that rotate together
        turned = torch.stack((-pairs[..., 1, :], pairs[..., 0, :]), dim=-2)
        return (pairs * cos + turned * sin).flatten(-3).to(x.dtype)

    return tuple(rotate(x) for x in tensors)


class RoPEAttention(SerializedAttention):
    """:class:`SerializedAttention` whose queries and keys are (optionally
    normalized and) rotated by the coordinates of the points in their patch
    slots (see the module doc)."""

    def __init__(self, *args, qk_norm: bool = False, rope_base: float = 10, rope_jitter: float | None = None,
                 rope_rescale: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        head_dim = self.channels // self.num_heads
        self.q_norm = nn.LayerNorm(head_dim, eps=1e-6) if qk_norm else None
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6) if qk_norm else None
        self.rope = AxisRoPE(head_dim, rope_base, rope_jitter, rope_rescale)

    def position_qk(self, point, rows: PatchRows, k: int, q: torch.Tensor, key: torch.Tensor):
        if "coord" not in point:
            raise ConfigError("PT-v3m8 rotates queries and keys by coord: the batch needs coord "
                              "(Collect it with the model's input keys)")
        if self.q_norm is not None:  # normalize, then rotate (upstream's order)
            q, key = self.q_norm(q), self.k_norm(key)
        xyz = point["coord"].index_select(0, rows.gather).view(-1, k, 3)
        return self.rope(q, key, xyz)
