"""The decoder block of both detectors (``detector-v5`` and ``detector-v4``)
under upstream's module and parameter names (``self_attn.q`` / ``self_attn.kv``,
``cross_attn.q_proj`` / ``k_proj`` / ``v_proj``, ``mask_mlp``, the
``anneal_progress`` buffer), so upstream's checkpoints of either load as they
are: masked cross-attention to the points, self-attention among the queries
and a feed-forward, and every query's point-mask prediction.

Queries are (B, Q, C): every event has the same learned query bank. Points
are padded to (B, P, C) with a validity mask, so one batched attention serves
the batch and no query sees a padded point (an additive bias of ``_PAD``) nor
another event's points (they are in another row). Upstream packs the batch
and gives another event's points the same -1e4 bias instead: the same numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.models.ptv3.blocks import DropPath, LayerScale

__all__ = ["MLP", "SelfAttentionLayer", "CrossAttentionLayer", "Block"]

_PAD = -1e4  # additive bias of a padded point: exp(-1e4) is exactly 0 in float32


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


def _attend(q, k, v, num_heads: int, scale: float, bias, dropout: float, upcast: bool) -> torch.Tensor:
    """Multi-head SDPA of (B, Lq, C) over (B, Lk, C) with an additive (B, Lq, Lk) bias."""
    b, lq, c = q.shape
    heads = [x.reshape(b, x.shape[1], num_heads, c // num_heads).transpose(1, 2) for x in (q, k, v)]
    dtype = q.dtype
    if upcast:
        heads = [x.float() for x in heads]
    mask = None if bias is None else bias.unsqueeze(1).to(heads[0].dtype)
    out = F.scaled_dot_product_attention(*heads, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out.to(dtype).transpose(1, 2).reshape(b, lq, c)


class SelfAttentionLayer(nn.Module):
    """Self-attention among one event's queries: ``q`` and a fused ``kv``
    projection. Positions are added to queries and keys, not to values.

    Upstream rounds q, k and v to bfloat16 before this attention (its flash
    kernel's input type, and on the fallback path too); pimm computes it in
    the input dtype (docs/models.md)."""

    def __init__(self, channels: int, num_heads: int = 8, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, upcast_attention: bool = True):
        super().__init__()
        self.channels, self.num_heads = channels, num_heads
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.q = nn.Linear(channels, channels, bias=qkv_bias)
        self.kv = nn.Linear(channels, channels * 2, bias=qkv_bias)
        self.attn_drop, self.proj = nn.Dropout(attn_drop), nn.Linear(channels, channels)
        self.proj_drop, self.upcast_attention = nn.Dropout(proj_drop), upcast_attention
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def _half(self, x: torch.Tensor, second: bool) -> torch.Tensor:
        part = slice(self.channels, None) if second else slice(0, self.channels)
        bias = None if self.kv.bias is None else self.kv.bias[part]
        return F.linear(x, self.kv.weight[part], bias)

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        with_pos = x if pos is None else x + pos
        out = _attend(self.q(with_pos), self._half(with_pos, False), self._half(x, True), self.num_heads, self.scale,
                      None, self.attn_drop.p if self.training else 0.0, self.upcast_attention)
        return self.proj_drop(self.proj(out))


class CrossAttentionLayer(nn.Module):
    """Queries attending to the points: ``q_proj``, ``k_proj``, ``v_proj``, ``proj``."""

    def __init__(self, channels: int, num_heads: int = 8, qkv_bias: bool = False, qk_scale: float | None = None,
                 attn_drop: float = 0.0, proj_drop: float = 0.0, upcast_attention: bool = True):
        super().__init__()
        self.channels, self.num_heads = channels, num_heads
        self.scale = qk_scale or (channels // num_heads) ** -0.5
        self.q_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.k_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.v_proj = nn.Linear(channels, channels, bias=qkv_bias)
        self.attn_drop, self.proj = nn.Dropout(attn_drop), nn.Linear(channels, channels)
        self.proj_drop, self.upcast_attention = nn.Dropout(proj_drop), upcast_attention
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, q, k, v, bias: torch.Tensor) -> torch.Tensor:
        out = _attend(self.q_proj(q), self.k_proj(k), self.v_proj(v), self.num_heads, self.scale, bias,
                      self.attn_drop.p if self.training else 0.0, self.upcast_attention)
        return self.proj_drop(self.proj(out))


class Block(nn.Module):
    """Masked cross-attention -> self-attention -> feed-forward (pre- or
    post-norm), with the block's own mask prediction ``z = norm_kv(points) .
    mask_mlp(queries)`` from the queries it receives.

    With ``supervise_attn_mask`` the (detached) ``log(sigmoid(z) + eps)``
    biases the cross-attention, times the annealing factor when annealing is
    on: 1 through ``attn_mask_warmup_steps``, then ``0.5 (1 + cos(pi t))``
    with t going 0 -> 1 over ``attn_mask_anneal_steps`` (``anneal_progress``).
    Without it only the last block predicts masks, and none biases attention."""

    def __init__(self, channels: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = False,
                 qk_scale: float | None = None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale: float | None = None, norm_layer=nn.LayerNorm,
                 act_layer=nn.GELU, pre_norm: bool = True, upcast_attention: bool = False,
                 attn_mask_eps: float = 1e-6, attn_mask_anneal: bool = False, attn_mask_anneal_steps: int = 10000,
                 attn_mask_warmup_steps: int = 0, supervise_attn_mask: bool = True, is_last_block: bool = False):
        super().__init__()
        self.pre_norm, self.attn_mask_eps, self.supervise_attn_mask = pre_norm, attn_mask_eps, supervise_attn_mask
        self.attn_mask_anneal, self.attn_mask_anneal_steps = attn_mask_anneal, attn_mask_anneal_steps
        self.attn_mask_warmup_steps, self._current_step = attn_mask_warmup_steps, 0
        self.register_buffer("anneal_progress", torch.tensor(0.0))  # 0: full mask bias, 1: none
        attention = dict(qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop, proj_drop=proj_drop,
                         upcast_attention=upcast_attention)
        scale = (lambda: LayerScale(channels, layer_scale)) if layer_scale is not None else nn.Identity
        self.norm1, self.ls1, self.norm_kv = norm_layer(channels), scale(), norm_layer(channels)
        self.self_attn = SelfAttentionLayer(channels, num_heads, **attention)
        self.norm2, self.ls2 = norm_layer(channels), scale()
        self.cross_attn = CrossAttentionLayer(channels, num_heads, **attention)
        self.norm3, self.ls3 = norm_layer(channels), scale()
        self.mlp = MLP(channels, int(channels * mlp_ratio), channels, act_layer=act_layer, drop=proj_drop)
        self.drop_path = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        if supervise_attn_mask or is_last_block:
            self.mask_mlp = MLP(channels, channels, channels)

    # -- annealing ------------------------------------------------------------------
    def set_anneal_step(self, step: int) -> None:
        if self.attn_mask_anneal and self.attn_mask_anneal_steps > 0:
            self._current_step = step
            progress = 0.0 if step < self.attn_mask_warmup_steps else min(
                (step - self.attn_mask_warmup_steps) / self.attn_mask_anneal_steps, 1.0)
            self.anneal_progress.fill_(progress)

    def get_anneal_factor(self) -> float:
        if not self.attn_mask_anneal or self._current_step < self.attn_mask_warmup_steps:
            return 1.0
        # upstream's constant, kept so a resumed factor is bit-identical to upstream's
        return 0.5 * (1.0 + torch.cos(self.anneal_progress * 3.14159)).item()

    # -- forward --------------------------------------------------------------------
    @staticmethod
    def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return norm(x.float()).to(x.dtype)

    @staticmethod
    def _with(x, pos):
        return x if pos is None else x + pos

    def _residual(self, q: torch.Tensor, update: torch.Tensor, scale: nn.Module) -> torch.Tensor:
        b, n, c = update.shape  # stochastic depth per query, as upstream's packed (B*Q, C) rows
        return q + self.drop_path(scale(update).reshape(b * n, c)).reshape(b, n, c)

    def forward(self, q, points, valid, pos_q=None, pos_k=None):
        """``q`` (B, Q, C), ``points`` (B, P, C), ``valid`` (B, P) -> (queries,
        mask logits (B, Q, P) or None)."""
        kv = self._norm(self.norm_kv, points)
        pad = (~valid).unsqueeze(1).to(kv.dtype) * _PAD  # (B, 1, P)
        mask_logits, bias = None, pad
        if hasattr(self, "mask_mlp"):
            mask_logits = torch.einsum("bpc,bqc->bqp", kv, self.mask_mlp(q))
            if self.supervise_attn_mask:
                bias = torch.log(mask_logits.detach().sigmoid() + self.attn_mask_eps)
                if self.attn_mask_anneal:
                    bias = bias * self.get_anneal_factor()
                bias = bias.masked_fill(~valid.unsqueeze(1), _PAD)
        bias = bias.expand(q.shape[0], q.shape[1], kv.shape[1])
        if self.pre_norm:
            qn = self._norm(self.norm1, q)
            q = self._residual(q, self.cross_attn(self._with(qn, pos_q), self._with(kv, pos_k), kv, bias), self.ls1)
            q = self._residual(q, self.self_attn(self._norm(self.norm2, q), pos_q), self.ls2)
            q = self._residual(q, self.mlp(self._norm(self.norm3, q)), self.ls3)
        else:
            q = self._residual(q, self.cross_attn(self._with(q, pos_q), self._with(kv, pos_k), kv, bias), self.ls1)
            q = self._norm(self.norm1, q)
            q = self._norm(self.norm2, self._residual(q, self.self_attn(q, pos_q), self.ls2))
            q = self._norm(self.norm3, self._residual(q, self.mlp(q), self.ls3))
        return q, mask_logits
