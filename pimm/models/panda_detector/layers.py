"""Building blocks of the detector's query decoder: multi-head attention over
padded per-event batches, a two-layer MLP and the Mask2Former-style decoder
block (masked cross-attention to the points, self-attention among the
queries, feed-forward), which also predicts every query's point mask.

Queries are (B, Q, C): every event has the same learned query bank. Points are
padded to (B, P, C) with a validity mask, so one batched attention call serves
the batch and padded points never receive attention (an additive bias of
``_PAD``), nor do points of another event (they are in another row).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pimm.models.ptv3.blocks import DropPath, LayerScale

__all__ = ["MLP", "Attention", "DecoderBlock"]

_PAD = -1e4  # additive attention bias of a padded point: exp(-1e4) is exactly 0 in float32


class MLP(nn.Module):
    """Linear -> activation -> dropout -> Linear -> dropout (xavier-initialised)."""

    def __init__(self, in_channels: int, hidden_channels: int | None = None, out_channels: int | None = None,
                 act_layer=nn.GELU, drop: float = 0.0):
        super().__init__()
        self.fc1 = nn.Linear(in_channels, hidden_channels or in_channels)
        self.act = act_layer()
        self.fc2 = nn.Linear(hidden_channels or in_channels, out_channels or in_channels)
        self.drop = nn.Dropout(drop)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Attention(nn.Module):
    """Multi-head attention of (B, Lq, C) queries over (B, Lk, C) keys/values,
    with an optional additive bias (B, Lq, Lk) shared by the heads.

    ``upcast_attention``: compute the attention in float32 whatever the
    autocast dtype (the products of long point sequences lose precision in
    bfloat16)."""

    def __init__(self, channels: int, num_heads: int, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, upcast_attention: bool = False):
        super().__init__()
        self.num_heads = num_heads
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.q = nn.Linear(channels, channels, bias=qkv_bias)
        self.k = nn.Linear(channels, channels, bias=qkv_bias)
        self.v = nn.Linear(channels, channels, bias=qkv_bias)
        self.proj = nn.Linear(channels, channels)
        self.attn_drop, self.proj_drop = attn_drop, nn.Dropout(proj_drop)
        self.upcast = upcast_attention
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        return x.reshape(b, n, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(self, query, key, value, bias: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._heads(self.q(query)), self._heads(self.k(key)), self._heads(self.v(value))
        dtype = q.dtype
        if self.upcast:
            q, k, v = q.float(), k.float(), v.float()
        mask = None if bias is None else bias.unsqueeze(1).to(q.dtype)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        out = out.to(dtype).transpose(1, 2).reshape(query.shape[0], query.shape[1], -1)
        return self.proj_drop(self.proj(out))


class DecoderBlock(nn.Module):
    """Masked cross-attention -> self-attention -> feed-forward, pre- or post-norm.

    With a mask head (``with_mask``) the block first predicts each query's
    mask logits over the points, ``z = norm(points) . mask_mlp(queries)``
    (B, Q, P), from the queries it receives. With ``use_mask_as_bias`` those
    (detached) probabilities bias the cross-attention, ``log(sigmoid(z) +
    eps)`` times the annealing factor: a query looks mostly at the points it
    already claims, and the bias never reaches -inf, so a query whose mask is
    empty still sees every point."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 qk_scale: float | None = None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale: float | None = None, norm_layer=nn.LayerNorm,
                 act_layer=nn.GELU, pre_norm: bool = True, upcast_attention: bool = False,
                 with_mask: bool = True, use_mask_as_bias: bool = True, mask_eps: float = 1e-6):
        super().__init__()
        if channels % num_heads:
            raise ValueError(f"hidden_channels={channels} must be divisible by num_heads={num_heads}")
        self.pre_norm, self.use_mask_as_bias, self.mask_eps = pre_norm, use_mask_as_bias, mask_eps
        attn = dict(qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop, proj_drop=proj_drop,
                    upcast_attention=upcast_attention)
        self.norm_kv = norm_layer(channels)
        self.norm1, self.norm2, self.norm3 = norm_layer(channels), norm_layer(channels), norm_layer(channels)
        self.cross_attn = Attention(channels, num_heads, **attn)
        self.self_attn = Attention(channels, num_heads, **attn)
        self.mlp = MLP(channels, int(channels * mlp_ratio), channels, act_layer=act_layer, drop=proj_drop)
        scale = (lambda: LayerScale(channels, layer_scale)) if layer_scale is not None else nn.Identity
        self.ls1, self.ls2, self.ls3 = scale(), scale(), scale()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.mask_mlp = MLP(channels, channels, channels) if with_mask else None
        # 1.0: the full mask bias; annealing (AttentionMaskAnnealingHook) may lower it toward 0.
        self.register_buffer("anneal_factor", torch.ones(()), persistent=True)

    @staticmethod
    def _with(x, pos):
        return x if pos is None else x + pos

    def _residual(self, q: torch.Tensor, update: torch.Tensor, scale: nn.Module) -> torch.Tensor:
        b, n, c = update.shape  # stochastic depth per query, as upstream's packed (B*Q, C) rows
        return q + self.drop_path(scale(update).reshape(b * n, c)).reshape(b, n, c)

    def forward(self, q, points, valid, pos_q=None, pos_k=None):
        """``q`` (B, Q, C), ``points`` (B, P, C), ``valid`` (B, P) bool ->
        (updated queries, mask logits (B, Q, P) or None)."""
        kv = self.norm_kv(points.float()).to(points.dtype)
        pad = (~valid).unsqueeze(1).to(kv.dtype) * _PAD  # (B, 1, P)
        mask_logits = None
        bias = pad
        if self.mask_mlp is not None:
            mask_logits = torch.einsum("bpc,bqc->bqp", kv, self.mask_mlp(q))
            if self.use_mask_as_bias:
                bias = torch.log(mask_logits.detach().float().sigmoid() + self.mask_eps) * self.anneal_factor
                bias = bias.to(kv.dtype) + pad
        bias = bias.expand(q.shape[0], q.shape[1], kv.shape[1])
        if self.pre_norm:
            qn = self.norm1(q)
            q = self._residual(q, self.cross_attn(self._with(qn, pos_q), self._with(kv, pos_k), kv, bias), self.ls1)
            qn = self.norm2(q)
            q = self._residual(q, self.self_attn(self._with(qn, pos_q), self._with(qn, pos_q), qn), self.ls2)
            q = self._residual(q, self.mlp(self.norm3(q)), self.ls3)
        else:
            q = self.norm1(self._residual(q, self.cross_attn(self._with(q, pos_q), self._with(kv, pos_k), kv, bias),
                                          self.ls1))
            q = self.norm2(self._residual(q, self.self_attn(self._with(q, pos_q), self._with(q, pos_q), q), self.ls2))
            q = self.norm3(self._residual(q, self.mlp(q), self.ls3))
        return q, mask_logits


def cosine_anneal(step: int, steps: int, warmup: int = 0) -> float:
    """Mask-bias factor at ``step``: 1 through ``warmup``, then a cosine from
    1 down to 0 over ``steps`` steps (upstream's annealing schedule)."""
    if steps <= 0 or step < warmup:
        return 1.0
    progress = min((step - warmup) / steps, 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))
