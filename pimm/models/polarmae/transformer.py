"""PoLAr-MAE's token encoder pieces: masked norms, a ViT with optional cross
attention, the masked mini-PointNet that embeds a group, positional encoders.

Every module takes padded tensors with a boolean mask of the real tokens or
points. Module and parameter names are upstream's (``encoder.blocks.3.attn.qkv``,
``embedding.first_conv.0``, ...), so upstream PoLAr-MAE checkpoints load by name.
Upstream's masked layer norm takes its statistics over *all* real tokens of
the batch (one mean and one deviation), not per token; that is kept.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["VIT_CONFIGS", "MaskedLayerNorm", "MaskedBatchNorm1d", "Transformer", "make_transformer",
           "MaskedMiniPointNet", "LearnedPositionalEncoder", "masked_layer_norm"]

VIT_CONFIGS = {"vit_tiny": dict(embed_dim=192, depth=12, num_heads=6),
               "vit_small": dict(embed_dim=384, depth=12, num_heads=6),
               "vit_base": dict(embed_dim=768, depth=12, num_heads=12)}
_TINY = 1e-13


def masked_layer_norm(x: torch.Tensor, mask: torch.Tensor, gamma=1.0, beta=0.0) -> torch.Tensor:
    keep = mask.unsqueeze(-1).to(x.dtype)
    n = keep.sum() * x.shape[-1]
    mean = (x * keep).sum() / n
    std = torch.sqrt((((x - mean) * keep) ** 2).sum() / n + _TINY)
    return (gamma * (x - mean) / (std + _TINY) + beta) * keep


class MaskedLayerNorm(nn.Module):
    def __init__(self, size: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(1, 1, size))
        self.beta = nn.Parameter(torch.zeros(1, 1, size))

    def forward(self, x, mask):
        return masked_layer_norm(x, mask, self.gamma, self.beta)


class MaskedBatchNorm1d(nn.Module):
    """Batch norm of ``(B, C, L)`` over the positions where ``mask`` (B, 1, L) is set."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        self.register_buffer("running_mean", torch.zeros(num_features))
        self.register_buffer("running_var", torch.ones(num_features))

    def forward(self, x, mask=None):
        mask = x.new_ones(x.shape[0], 1, x.shape[2]) if mask is None else mask.to(x.dtype)
        if self.training:
            count = mask.sum().clamp(min=1)
            mean = (x * mask).sum((0, 2)) / count
            var = (((x - mean[None, :, None]) * mask) ** 2).sum((0, 2)) / count
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var, self.momentum)
        else:
            mean, var = self.running_mean, self.running_var
        x = (x - mean[None, :, None]) / torch.sqrt(var + self.eps)[None, :, None] * mask
        return x * self.weight[None, :, None] + self.bias[None, :, None]


class _MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _Attention(nn.Module):
    """Multi-head attention through SDPA; with ``kv``, queries from ``x`` and
    keys/values from ``kv`` (the decoder's cross attention), one qkv weight."""

    def __init__(self, dim, heads, qkv_bias=True, attn_drop=0.0, proj_drop=0.0):
        super().__init__()
        self.heads, self.attn_drop = heads, attn_drop
        self.qkv, self.proj, self.proj_drop = nn.Linear(dim, 3 * dim, bias=qkv_bias), nn.Linear(dim, dim), \
            nn.Dropout(proj_drop)

    def forward(self, x, attn_mask, kv=None):
        b, n, c = x.shape
        split = lambda t: t.reshape(b, t.shape[1], self.heads, c // self.heads).transpose(1, 2)  # noqa: E731
        if kv is None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            w, bias = self.qkv.weight, self.qkv.bias
            q = F.linear(x, w[:c], None if bias is None else bias[:c])
            k, v = F.linear(kv, w[c:], None if bias is None else bias[c:]).chunk(2, dim=-1)
        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=attn_mask,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, n, c)))


class _DropPath(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.p = p

    def forward(self, x, mask):
        if not self.training or self.p == 0:
            return x
        keep = x.new_empty(x.shape[0], x.shape[1], 1).bernoulli_(1 - self.p) / (1 - self.p)
        return x * keep * mask.unsqueeze(-1).to(x.dtype)


class _Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, qkv_bias, drop, attn_drop, drop_path, use_kv):
        super().__init__()
        self.norm1 = MaskedLayerNorm(dim)
        self.norm1_kv = MaskedLayerNorm(dim) if use_kv else None
        self.attn = _Attention(dim, heads, qkv_bias, attn_drop, drop)
        self.drop_path = _DropPath(drop_path)
        self.norm2 = MaskedLayerNorm(dim)
        self.mlp = _MLP(dim, int(dim * mlp_ratio))

    def forward(self, q, q_mask, attn_mask, kv=None, kv_mask=None):
        kv = self.norm1_kv(kv, kv_mask) if self.norm1_kv is not None and kv is not None else None
        q = q + self.drop_path(self.attn(self.norm1(q, q_mask), attn_mask, kv=kv), q_mask)
        return q + self.drop_path(self.mlp(self.norm2(q, q_mask)) * q_mask.unsqueeze(-1), q_mask)


@dataclass
class TransformerOutput:
    last_hidden_state: torch.Tensor
    hidden_states: list | None = None


class Transformer(nn.Module):
    """A stack of pre-norm blocks; ``add_pos_at_every_layer`` re-adds the
    positional encoding before each block; ``postnorm`` a final masked norm."""

    def __init__(self, embed_dim=384, depth=12, num_heads=6, mlp_ratio=4.0, qkv_bias=True, drop_rate=0.0,
                 attn_drop_rate=0.0, drop_path_rate=0.0, add_pos_at_every_layer=False, postnorm=True, use_kv=False):
        super().__init__()
        self.add_pos_at_every_layer = add_pos_at_every_layer
        rates = torch.linspace(0, drop_path_rate, depth).tolist()
        self.blocks = nn.ModuleList(_Block(embed_dim, num_heads, mlp_ratio, qkv_bias, drop_rate, attn_drop_rate,
                                           rate, use_kv) for rate in rates)
        self.norm = MaskedLayerNorm(embed_dim) if postnorm else None
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, q, pos_q, q_mask, kv=None, pos_kv=None, kv_mask=None, return_hidden_states=False,
                final_norm=True) -> TransformerOutput:
        if kv is not None:
            kv = kv + pos_kv
        attn_mask = q_mask[:, None, :, None] & (q_mask if kv_mask is None else kv_mask)[:, None, None, :]
        # A query row with no key at all (a padding token) would make SDPA's
        # softmax NaN; let such rows see everything, their output is masked.
        attn_mask = attn_mask | ~attn_mask.any(-1, keepdim=True)
        if not self.add_pos_at_every_layer:
            q = q + pos_q
        hidden = [] if return_hidden_states else None
        for block in self.blocks:
            if self.add_pos_at_every_layer:
                q = q + pos_q
            q = block(q, q_mask, attn_mask, kv, kv_mask)
            if hidden is not None:
                hidden.append(q)
        if final_norm and self.norm is not None:
            q = self.norm(q, q_mask)
        return TransformerOutput(q, hidden)


def make_transformer(arch: str, use_kv: bool = False, **kwargs) -> Transformer:
    return Transformer(use_kv=use_kv, **{**VIT_CONFIGS[arch], **kwargs})


class _PointOrderEncoder(nn.Module):
    """Sinusoidal code of a point's position in its group, then an MLP
    (``style="mlp"``) or one linear layer (``"original"``, PoLAr-MAE's)."""

    def __init__(self, dim, style="mlp"):
        super().__init__()
        self.dim, self.style = dim, style
        if style == "mlp":
            self.net = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))
        elif style == "original":
            self.time_embed = nn.Sequential(nn.Identity(), nn.Linear(dim, dim))
        else:
            raise ValueError(f"pos_enc_style must be 'mlp' or 'original', got {style!r}")

    def forward(self, count: int, device) -> torch.Tensor:
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, device=device).float() * -(math.log(10000) / (half - 1)))
        angle = torch.arange(count, device=device).float()[:, None] * freq[None]
        code = torch.cat([angle.sin(), angle.cos()], dim=-1)
        return (self.net(code) if self.style == "mlp" else self.time_embed(code)).unsqueeze(0)


class MaskedMiniPointNet(nn.Module):
    """A group's points -> one feature: shared MLP, max-pool, concatenate the
    pooled feature to every point, MLP, max-pool; batch norms over real points."""

    def __init__(self, channels, feature_dim, hidden1=128, hidden2=256, equivariant=False, pos_enc_style="mlp"):
        super().__init__()
        self.first_conv = nn.Sequential(nn.Conv1d(channels, hidden1, 1, bias=False), MaskedBatchNorm1d(hidden1),
                                        nn.ReLU(inplace=True), nn.Conv1d(hidden1, hidden2, 1))
        self.second_conv = nn.Sequential(nn.Conv1d(hidden2 * 2, hidden2 * 2, 1, bias=False),
                                         MaskedBatchNorm1d(hidden2 * 2), nn.ReLU(inplace=True),
                                         nn.Conv1d(hidden2 * 2, feature_dim, 1))
        self.pos_enc = _PointOrderEncoder(hidden2, pos_enc_style) if equivariant else None

    @staticmethod
    def _run(layers, x, mask):
        for layer in layers:
            x = layer(x, mask) if isinstance(layer, MaskedBatchNorm1d) else layer(x)
        return x

    def forward(self, points: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``points`` (T, S, C), ``mask`` (T, 1, S) -> (T, feature_dim)."""
        x = self._run(self.first_conv, points.transpose(1, 2), mask)
        if self.pos_enc is not None:
            x = x + self.pos_enc(points.shape[1], points.device).transpose(1, 2)
        x = torch.cat([x.max(2, keepdim=True).values.expand_as(x), x], dim=1)
        return self._run(self.second_conv, x, mask).max(2).values


class LearnedPositionalEncoder(nn.Module):
    def __init__(self, embed_dim):
        super().__init__()
        self.pos_enc = nn.Sequential(nn.Linear(3, 128), nn.GELU(), nn.Linear(128, embed_dim))

    def forward(self, centers):
        return self.pos_enc(centers[..., :3])
