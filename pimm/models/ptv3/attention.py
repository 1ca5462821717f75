"""Serialized patch attention (PT-v3) on ``scaled_dot_product_attention``.

Each event's points, in curve order, are cut into patches of ``K`` points.
An event whose length is not a multiple of ``K`` gets its last patch filled
up with the points at the same places of the patch before it (upstream's
rule: the duplicates are real keys, their outputs are dropped), so every
patch is full and the whole batch is one ``(patches, heads, K, dim)``
tensor: one SDPA call, memory ``O(N K)``, never ``O(N^2)``. On a GPU, SDPA
picks a flash / memory-efficient kernel; nothing needs flash-attn.

Upstream's two modes:

* ``enable_flash=True``: ``K`` is the configured patch size; an event
  shorter than ``K`` is one patch of its own length (upstream's variable
  length sequence), here a padded patch whose pads are masked out as keys.
  ``K`` is capped at the batch's longest event: a patch longer than every
  event pads every event to the same length, so the cap changes no output,
  only what the padding would cost (upstream's varlen call pads nothing).
* ``enable_flash=False``: ``K = min(patch_size, shortest event)``, so every
  event fills at least one patch; RPE and up-casting are allowed.

``patch_size=-1`` (flash mode) attends over whole events.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.errors import ConfigError

from .linear import Linear
from .rows import PatchRows

__all__ = ["patch_layout", "RPE", "SerializedAttention"]


@torch.no_grad()
def patch_layout(counts: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Padding of events of ``counts`` points into patches of ``k``.

    Returns ``(pad, unpad, key_mask)``: ``pad`` (P*k,) is the (curve-order)
    point read into every patch slot, ``unpad`` (N,) the slot of every point,
    ``key_mask`` (P, k) True at real keys, or ``None`` when every slot is
    real (no event shorter than ``k``).
    """
    device = counts.device
    patches = torch.div(counts + k - 1, k, rounding_mode="floor").clamp_min(1)
    padded = patches * k
    start = torch.cumsum(counts, 0) - counts
    pstart = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    event = torch.repeat_interleave(torch.arange(counts.numel(), device=device), padded, output_size=total)
    local = torch.arange(total, device=device) - pstart.index_select(0, event)
    n = counts.index_select(0, event)
    # Slots past the end: copy the slot one patch back (events longer than k),
    # or any point of the event, masked out as a key (events shorter than k).
    src = torch.where(local < n, local, torch.where(n >= k, local - k, torch.zeros_like(local)))
    pad = start.index_select(0, event) + src
    num = int(counts.sum())
    point_event = torch.repeat_interleave(torch.arange(counts.numel(), device=device), counts, output_size=num)
    unpad = torch.arange(num, device=device) + (pstart - start).index_select(0, point_event)
    short = bool((counts < k).any())
    key_mask = ((local < n) | (n >= k)).view(-1, k) if short else None
    return pad, unpad, key_mask


class RPE(nn.Module):
    """Relative position bias: one learned table per axis over grid offsets
    clamped to ``+-pos_bnd``, summed over the axes, per head."""

    def __init__(self, patch_size: int, num_heads: int):
        super().__init__()
        self.pos_bnd = int((4 * patch_size) ** (1 / 3) * 2)
        self.rpe_num = 2 * self.pos_bnd + 1
        self.rpe_table = nn.Parameter(torch.zeros(3 * self.rpe_num, num_heads))
        nn.init.trunc_normal_(self.rpe_table, std=0.02)

    def forward(self, rel: torch.Tensor) -> torch.Tensor:
        """(P, K, K, 3) integer offsets -> (P, H, K, K) bias."""
        idx = rel.clamp(-self.pos_bnd, self.pos_bnd) + self.pos_bnd
        idx = idx + torch.arange(3, device=rel.device) * self.rpe_num
        out = self.rpe_table.index_select(0, idx.reshape(-1)).view(*idx.shape, -1).sum(3)
        return out.permute(0, 3, 1, 2)


class SerializedAttention(nn.Module):
    """Multi-head self-attention within serialized patches (upstream's
    options and parameter names: ``qkv``, ``proj``, ``rpe.rpe_table``)."""

    def __init__(self, channels: int, num_heads: int, patch_size: int, qkv_bias: bool = True, qk_scale=None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, order_index: int = 0, enable_rpe: bool = False,
                 enable_flash: bool = True, upcast_attention: bool = True, upcast_softmax: bool = True):
        super().__init__()
        if channels % num_heads:
            raise ConfigError(f"PT-v3: channels={channels} is not divisible by num_head={num_heads}")
        if enable_flash and (enable_rpe or upcast_attention or upcast_softmax):
            name = "enable_rpe" if enable_rpe else "upcast_attention" if upcast_attention else "upcast_softmax"
            raise ConfigError(f"PT-v3: {name}=True needs enable_flash=False (as upstream)")
        if patch_size == -1 and not enable_flash:
            raise ConfigError("PT-v3: patch_size=-1 (whole-event attention) needs enable_flash=True")
        if patch_size < 1 and patch_size != -1:
            raise ConfigError(f"PT-v3: patch_size must be >= 1 (or -1 for whole events), got {patch_size}")
        self.channels, self.num_heads, self.patch_size = channels, num_heads, patch_size
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.order_index = order_index
        self.enable_rpe, self.enable_flash = enable_rpe, enable_flash
        self.upcast_attention, self.upcast_softmax = upcast_attention, upcast_softmax
        self.attn_drop = attn_drop
        self.qkv = Linear(channels, channels * 3, bias=qkv_bias)
        self.proj = Linear(channels, channels)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rpe = RPE(patch_size, num_heads) if enable_rpe else None

    def _patch_size(self, counts: torch.Tensor, patch_size: int | None = None) -> int:
        """Points per patch for events of ``counts`` points, from the configured
        ``patch_size`` (default: this block's)."""
        patch_size = self.patch_size if patch_size is None else patch_size
        longest = max(int(counts.max()), 1)
        if patch_size == -1:
            return longest
        if self.enable_flash:
            return min(patch_size, longest)
        return max(min(int(counts.min()), patch_size), 1)

    def level_patch_size(self, point) -> int:
        """The configured patch size this block cuts ``point``'s level with:
        its own (LitePT's blocks share the level's first, as upstream's)."""
        return self.patch_size

    def layout(self, point, k: int):
        """Gather/scatter indices of this block's curve at patch size ``k``,
        cached on the level (every block of a level with the same curve shares them)."""
        key = ("patch", self.order_index, k)
        cache = point["_cache"]
        if key not in cache:
            counts = torch.diff(point["offset"], prepend=point["offset"].new_zeros(1))
            pad, unpad, key_mask = patch_layout(counts, k)
            gather = point["serialized_order"][self.order_index].index_select(0, pad)
            scatter = unpad.index_select(0, point["serialized_inverse"][self.order_index])
            cache[key] = (PatchRows(gather, scatter), key_mask)
        return cache[key]

    def position_qk(self, point, rows: PatchRows, k: int, q: torch.Tensor, key: torch.Tensor):
        """Queries and keys (P, H, K, D) before the product: unchanged here
        (PT-v3's positions are its CPE and optional RPE); PT-v3m8 normalizes
        and rotates them by the points' coordinates."""
        return q, key

    def forward(self, point, feat: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output (N, C) of ``feat`` (default ``point.feat``) on the
        level's serialization."""
        feat = point["feat"] if feat is None else feat
        h, c = self.num_heads, self.channels
        counts = torch.diff(point["offset"], prepend=point["offset"].new_zeros(1))
        k = self._patch_size(counts, self.level_patch_size(point))
        rows, key_mask = self.layout(point, k)
        # (P, H, K, D) views of the qkv columns. Split along the channels (not a permute and unbind of
        # the whole): their gradients then come back into one (slots, 3C) buffer in one copy, not two.
        qkv = self.qkv(rows.to_slots(feat)).view(-1, k, 3 * c).split(c, dim=-1)
        q, key, v = (x.view(x.shape[0], k, h, c // h).transpose(1, 2) for x in qkv)
        q, key = self.position_qk(point, rows, k, q, key)
        dtype = q.dtype
        if self.upcast_attention or self.upcast_softmax:  # SDPA's softmax runs in its input dtype
            q, key, v = q.float(), key.float(), v.float()
        mask = None
        if self.rpe is not None:
            rel = point["grid_coord"].index_select(0, rows.gather).view(-1, k, 3)
            mask = self.rpe(rel.unsqueeze(2) - rel.unsqueeze(1)).to(q.dtype)
        if key_mask is not None:
            keys = key_mask[:, None, None, :]
            mask = keys if mask is None else mask.masked_fill(~keys, float("-inf"))
        out = F.scaled_dot_product_attention(q, key, v, attn_mask=mask, scale=self.scale,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        out = rows.from_slots(out.to(dtype).transpose(1, 2).reshape(-1, c))
        return self.proj_drop(self.proj(out))
