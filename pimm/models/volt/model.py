"""``Volt-v1m1`` and ``Volt-v1m2``: upstream pimm's flat (one-resolution)
transformer encoders over sparse-convolution patch tokens, in plain PyTorch.

Both: a per-point stem into ``stem_channels`` (with an optional learned
mask token replacing the features of ``point.mask``), a strided sparse
convolution (``kernel_size``, ``stride``; default 5 and 5: one token per
occupied 5^3 patch), ``depth`` pre-norm transformer blocks attending over
each event's tokens with axial RoPE (:mod:`.layers`). Then:

* ``Volt-v1m1`` (``VoltBackbone``): a final LayerNorm (``final_norm``) and a
  token-resolution :class:`~pimm.models.ptv3.structure.Point` (tokens sorted
  by event and position, the mean ``coord`` / ``origin_coord`` of their
  points, ``grid_coord`` the token's, ``segment`` / ``segment_motif`` of
  each token's first point) whose ``pooling_parent`` is the input batch and
  ``pooling_inverse`` each point's token: Sonata reads it at
  ``up_cast_level=0``; ``DefaultSegmentorV2`` concatenates the input
  features with the token's (``out_channels = in_channels + embed_dim``).
* ``Volt-v1m2`` (``VoltBackboneV2``): a decoder (LayerNorm, GELU, Linear to
  ``decoder_dim``, LayerNorm, GELU, spconv's inverse convolution back onto
  the points, LayerNorm, GELU) and the input batch with those per-point
  features (``out_channels = decoder_dim``).

The stem of v1m1 is spconv's 1x1x1 ``SubMConv3d`` (its weight read as
spconv's matrix path reads it), v1m2's a Linear. Convolution weights keep
spconv's layout and run on pimm's kernel maps (:mod:`.tokens`). Constructor
arguments and defaults, module and parameter names are upstream's, so its
configs build and its state dicts load strictly.
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Int, NonNeg, Real, Rule, Seq, Size
from pimm.utils.errors import ConfigError

from ..point_ops import scatter_mean
from ..modules import PointModel
from ..ptv3.blocks import PointModule, PointSequential
from ..ptv3.linear import Linear
from ..ptv3.structure import Point
from ..sparse_layouts import SparseSequential, SpconvConv
from .layers import AxialRoPE, Block, TokenAttentionInput
from .tokens import event_sizes, strided_kernel_map

__all__ = ["VoltBackbone", "VoltBackboneV2"]


def _rope_fits_heads(a) -> bool:
    return a.embed_dim % a.num_heads == 0 and 2 * sum(a.rope_freq_split) == a.embed_dim // a.num_heads


class _Volt(PointModel):
    """What both versions share: the token transformer and its checks."""

    variant = ""
    domains = dict(in_channels=Size, stem_channels=Size, embed_dim=Size, depth=Int(0, 256), num_heads=Int(1, 1024),
                   mlp_ratio=Real(0, 64, lo_open=True), init_values=NonNeg | None,
                   drop_path=Real(0, 1, hi_open=True), stride=Int(1, 64), kernel_size=Int(1, 64),
                   rope_max_grid_size=Seq(Int(1, 1 << 24), length=3), rope_freq_split=Seq(Int(1, 4096), length=3))
    domain_rules = (Rule(_rope_fits_heads, "rope_freq_split",
                         "three counts of frequency pairs summing to embed_dim // num_heads / 2 (with num_heads "
                         "dividing embed_dim)"),)

    def _build_transformer(self, embed_dim, depth, num_heads, mlp_ratio, init_values, qk_norm, drop_path,
                           increase_drop_path, stride, kernel_size, rope_max_grid_size, rope_freq_split, container):
        if embed_dim % num_heads or 2 * sum(rope_freq_split) != embed_dim // num_heads:
            raise ConfigError(f"{self.variant}: rope_freq_split={tuple(rope_freq_split)} sums to "
                              f"{sum(rope_freq_split)}, but embed_dim={embed_dim} / num_heads={num_heads} needs "
                              f"{embed_dim // num_heads / 2:g} (and num_heads must divide embed_dim)")
        self.stride, self.kernel_size, self.embed_dim = stride, kernel_size, embed_dim
        self.pos_enc = AxialRoPE(freq_split=tuple(rope_freq_split), max_grid_size=tuple(rope_max_grid_size))
        dp = torch.linspace(0, drop_path, depth).tolist() if increase_drop_path else [drop_path] * depth
        self.blocks = container(*[Block(embed_dim, num_heads, mlp_ratio, init_values, qk_norm, dp[i])
                                  for i in range(depth)])

    @staticmethod
    def _point(data_dict) -> Point:
        point = data_dict if isinstance(data_dict, Point) else Point(data_dict)
        if "offset" not in point and "batch" not in point:
            raise ConfigError("Volt: the batch has no offset (the collate function adds it)")
        point["batch"] = point["batch"].to(point["feat"].device)
        point["offset"] = point["offset"].to(point["feat"].device)
        point.ensure_grid_coord()
        return point

    def _transform(self, tokens: torch.Tensor, token_grid: torch.Tensor, token_batch: torch.Tensor) -> torch.Tensor:
        ctx = TokenAttentionInput(event_sizes(token_batch), self.pos_enc.angles(token_grid))
        for block in self.blocks:
            tokens = block(tokens, ctx)
        return tokens

    @classmethod
    def masks_features(cls, args: dict) -> bool:
        """Whether this config replaces the features of a batch's masked points
        (``mask``) by a learned token (what Sonata's mask losses need)."""
        return bool(args.get("mask_token", True))


@MODELS.register_module("Volt-v1m1")
class VoltBackbone(_Volt):
    """Upstream's ``Volt-v1m1`` (see the module doc): a token-resolution Point."""

    variant = "Volt-v1m1"
    domain_rules = (Rule(lambda a: a.kernel_size >= a.stride, "kernel_size",
                         "a value >= stride (every point must lie in its token's kernel)"),)

    def __init__(self, in_channels: int = 4, stem_channels: int = 32, embed_dim: int = 384, depth: int = 12,
                 num_heads: int = 6, mlp_ratio: float = 4.0, init_values: float | None = None, qk_norm: bool = True,
                 drop_path: float = 0.3, increase_drop_path: bool = True, stride: int = 5, kernel_size: int = 5,
                 mask_token: bool = True, final_norm: bool = True, rope_max_grid_size: tuple = (1024, 1024, 1024),
                 rope_freq_split: tuple = (11, 11, 10)):
        super().__init__()
        if kernel_size < stride:
            raise ConfigError(f"Volt-v1m1: kernel_size={kernel_size} < stride={stride} leaves points outside every "
                              "token (upstream fails on them); use kernel_size >= stride")
        self.stem = SpconvConv(in_channels, stem_channels, 1, bias=True)
        self.point_mask_token = nn.Parameter(torch.zeros(stem_channels)) if mask_token else None
        self.tokenizer = SpconvConv(stem_channels, embed_dim, kernel_size, bias=True)
        self._build_transformer(embed_dim, depth, num_heads, mlp_ratio, init_values, qk_norm, drop_path,
                                increase_drop_path, stride, kernel_size, rope_max_grid_size, rope_freq_split,
                                nn.Sequential)
        self.norm = nn.LayerNorm(embed_dim) if final_norm else nn.Identity()
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        if self.point_mask_token is not None:
            nn.init.trunc_normal_(self.point_mask_token, std=0.02)
        self.out_channels = in_channels + embed_dim  # DefaultSegmentorV2: input features + the point's token

    @property
    def has_mask_token(self) -> bool:
        return self.point_mask_token is not None

    def forward(self, data_dict) -> Point:
        point = self._point(data_dict)
        grid, batch = point["grid_coord"], point["batch"]
        x = self.stem(point["feat"])
        if self.point_mask_token is not None and point.get("mask") is not None:
            x = torch.where(point["mask"].unsqueeze(-1), self.point_mask_token.to(x.dtype), x)
        kmap, token_grid, token_batch = strided_kernel_map(grid, batch, self.kernel_size, self.stride)
        tokens = self.norm(self._transform(self.tokenizer(x, kmap), token_grid, token_batch))
        return self._coarse_point(point, tokens, token_grid, token_batch)

    def _coarse_point(self, point: Point, tokens: torch.Tensor, token_grid: torch.Tensor,
                      token_batch: torch.Tensor) -> Point:
        num = tokens.shape[0]
        span = int(token_grid.max()) + 1 if num else 1
        token_keys = ((token_batch * span + token_grid[:, 0]) * span + token_grid[:, 1]) * span + token_grid[:, 2]
        parent = torch.div(point["grid_coord"], self.stride, rounding_mode="floor")
        keys = ((point["batch"] * span + parent[:, 0]) * span + parent[:, 1]) * span + parent[:, 2]
        to_token = torch.searchsorted(token_keys, keys)  # tokens are sorted by key (voxelize's order)
        coarse = Point(feat=tokens, grid_coord=token_grid, batch=token_batch, pooling_parent=point,
                       pooling_inverse=to_token)
        for key in ("coord", "origin_coord"):
            if key in point:
                coarse[key] = scatter_mean(point[key], to_token, num)
        if "grid_size" in point:
            coarse["grid_size"] = point["grid_size"] * self.stride
        labels = [key for key in ("segment_motif", "segment") if key in point]
        if labels:  # each token's first point, as upstream (point 0 for a token no point calls its own)
            first = torch.full((num,), point["feat"].shape[0], dtype=torch.long, device=tokens.device)
            first = first.scatter_reduce(0, to_token, torch.arange(to_token.numel(), device=tokens.device), "amin")
            first = first.masked_fill(first == to_token.numel(), 0)
            for key in labels:
                coarse[key] = point[key].index_select(0, first)
        return coarse


class _Stem(PointModule):
    """Volt-v1m2's per-point ``Linear`` (``stem.linear``) and mask token."""

    def __init__(self, in_channels: int, stem_channels: int, mask_token: bool = True):
        super().__init__()
        self.stem = PointSequential(linear=Linear(in_channels, stem_channels))
        self.mask_token = nn.Parameter(torch.zeros(1, stem_channels)) if mask_token else None

    def forward(self, point: Point) -> Point:
        point = self.stem(point)
        if self.mask_token is not None and point.get("mask") is not None:
            point["feat"] = torch.where(point["mask"].unsqueeze(-1), self.mask_token.to(point["feat"].dtype),
                                        point["feat"])
        return point


class _Tokenizer(nn.Module):
    """Volt-v1m2's strided convolution (``tokenizer.conv``)."""

    def __init__(self, in_channels: int, embed_dim: int, kernel_size: int = 5):
        super().__init__()
        self.conv = SpconvConv(in_channels, embed_dim, kernel_size, bias=True)


class _Decoder(nn.Module):
    """Volt-v1m2's ``decoder.up``: tokens back onto the points (module doc)."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int):
        super().__init__()
        self.up = SparseSequential(nn.LayerNorm(in_channels), nn.GELU(), Linear(in_channels, out_channels, bias=False),
                                   nn.LayerNorm(out_channels), nn.GELU(),
                                   SpconvConv(out_channels, out_channels, kernel_size, bias=False),
                                   nn.LayerNorm(out_channels), nn.GELU())


@MODELS.register_module("Volt-v1m2")
class VoltBackboneV2(_Volt):
    """Upstream's ``Volt-v1m2`` (see the module doc): per-point features."""

    variant = "Volt-v1m2"
    domains = dict(decoder_dim=Size)

    def __init__(self, in_channels: int = 4, stem_channels: int = 32, embed_dim: int = 384, depth: int = 12,
                 num_heads: int = 6, mlp_ratio: float = 4.0, init_values: float | None = None, qk_norm: bool = True,
                 drop_path: float = 0.3, increase_drop_path: bool = True, stride: int = 5, kernel_size: int = 5,
                 mask_token: bool = True, decoder_dim: int = 256, rope_max_grid_size: tuple = (1024, 1024, 1024),
                 rope_freq_split: tuple = (11, 11, 10)):
        super().__init__()
        self.decoder_dim = decoder_dim
        self.stem = _Stem(in_channels, stem_channels, mask_token)
        self.tokenizer = _Tokenizer(stem_channels, embed_dim, kernel_size)
        self._build_transformer(embed_dim, depth, num_heads, mlp_ratio, init_values, qk_norm, drop_path,
                                increase_drop_path, stride, kernel_size, rope_max_grid_size, rope_freq_split,
                                nn.Sequential)
        self.decoder = _Decoder(embed_dim, decoder_dim, kernel_size)
        for name, module in self.named_modules():  # upstream keeps PyTorch's init in the stem and decoder
            if isinstance(module, nn.Linear) and not name.startswith(("stem.", "decoder.")):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        self.out_channels = decoder_dim

    @property
    def has_mask_token(self) -> bool:
        return self.stem.mask_token is not None

    def forward(self, data_dict) -> Point:
        point = self.stem(self._point(data_dict))
        kmap, token_grid, token_batch = strided_kernel_map(point["grid_coord"], point["batch"], self.kernel_size,
                                                           self.stride)
        tokens = self._transform(self.tokenizer.conv(point["feat"], kmap), token_grid, token_batch)
        point["feat"] = self.decoder.up(tokens, kmap.transposed())
        return point
