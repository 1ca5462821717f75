"""Volt's transformer over patch tokens: axial RoPE, attention over each
event's tokens, and the pre-norm block (upstream's module and parameter
names: ``norm1``, ``attn.qkv``, ``attn.q_norm``, ``attn.k_norm``,
``attn.proj``, ``ls1.gamma``, ``norm2``, ``mlp.fc1``, ``mlp.fc2``,
``ls2.gamma``).

RoPE (upstream's ``RoPE`` / ``apply_rotary_emb``): a head's ``D`` channels
are ``D / 2`` interleaved pairs ``(2i, 2i+1)``; the first ``freq_split[0]``
pairs turn by the token's x coordinate, the next ``freq_split[1]`` by y,
the last ``freq_split[2]`` by z, pair ``j`` of an axis with ``n`` pairs at
frequency ``theta^(-j / (n - 1))`` (``linspace(0, 1, n)`` exponents;
``theta`` = 100). Coordinates are the tokens' integer grid positions,
which must stay below ``max_grid_size`` (upstream's cached table). Queries
and keys are optionally LayerNorm-ed per head first (``qk_norm``).

Upstream attends with flash-attn in float16 over one sequence per event;
here ``scaled_dot_product_attention`` over each event's tokens, in the
features' dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.errors import ConfigError

from ..ptv3.blocks import MLP, DropPath, LayerScale
from ..ptv3.linear import Linear

__all__ = ["AxialRoPE", "RoPEAttention", "Block", "TokenAttentionInput"]


class AxialRoPE(nn.Module):
    """Per-token rotation angles of upstream Volt's ``RoPE`` (no saved state)."""

    def __init__(self, theta: float = 100.0, freq_split=(12, 12, 8), max_grid_size=(1024, 1024, 512)):
        super().__init__()
        self.max_grid_size = tuple(int(m) for m in max_grid_size)
        freqs = torch.cat([1.0 / theta ** torch.linspace(0, 1, int(n)) for n in freq_split])
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor([int(n) for n in freq_split]))
        self.register_buffer("freqs", freqs, persistent=False)
        self.register_buffer("axis", axis, persistent=False)

    def angles(self, grid: torch.Tensor) -> torch.Tensor:
        """(T, 3) integer token coordinates -> (T, D / 2) angles (float32)."""
        if grid.numel():
            top = grid.max(0).values.tolist()
            for name, value, limit in zip("xyz", top, self.max_grid_size):
                if value >= limit:
                    raise ConfigError(f"Volt: a token sits at {name}={value}, beyond rope_max_grid_size="
                                      f"{list(self.max_grid_size)} (upstream's RoPE table); raise it, or use a "
                                      "coarser grid_size")
        return grid.index_select(1, self.axis).float() * self.freqs


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs of ``x`` (..., D) turned by angles with ``cos`` / ``sin``
    (..., D / 2) (broadcast), in float32, back in ``x``'s dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class TokenAttentionInput:
    """What every block of a forward shares: the tokens of each event (sorted
    by event, ``sizes`` per event) and their RoPE angles (computed once)."""

    def __init__(self, sizes: list[int], angles: torch.Tensor):
        self.sizes = sizes
        self.cos, self.sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)  # (T, 1, D/2)


class RoPEAttention(nn.Module):
    """Multi-head attention over each event's tokens with axial RoPE (upstream's ``RoPE_Attention``)."""

    def __init__(self, dim: int = 768, num_heads: int = 12, qk_norm: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ConfigError(f"Volt: embed_dim={dim} is not divisible by num_heads={num_heads}")
        self.num_heads, self.h_dim = num_heads, dim // num_heads
        self.qkv = Linear(dim, 3 * dim)
        self.proj = Linear(dim, dim)
        self.q_norm = nn.LayerNorm(self.h_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.h_dim) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor, ctx: TokenAttentionInput) -> torch.Tensor:
        n, c = x.shape
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.h_dim).unbind(1)
        q = rotate_pairs(self.q_norm(q), ctx.cos, ctx.sin)
        k = rotate_pairs(self.k_norm(k), ctx.cos, ctx.sin)
        # One call per event: events differ in length (400-750 tokens each on LArTPC batches); padding
        # them to the longest, one call for the batch, made a Volt-v1m2 step ~16 % slower (bench/model_zoo.py).
        out = [F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in qkv)).squeeze(0)
               for qkv in zip(q.split(ctx.sizes), k.split(ctx.sizes), v.split(ctx.sizes))]  # (H, L, D) each
        return self.proj(torch.cat([o.transpose(0, 1) for o in out]).reshape(n, c))


class Block(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with optional layer
    scale (``init_values``) and drop path (upstream's ``Block``)."""

    def __init__(self, dim: int = 768, num_heads: int = 12, mlp_ratio: float = 4.0, init_values: float | None = None,
                 qk_norm: bool = False, drop_path: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = RoPEAttention(dim, num_heads, qk_norm)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path1 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, int(dim * mlp_ratio), dim)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0.0 else nn.Identity()

    def forward(self, x: torch.Tensor, ctx: TokenAttentionInput) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), ctx)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))
