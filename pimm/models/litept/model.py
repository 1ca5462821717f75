"""``LitePT``: upstream pimm's lightweight point transformer (a PT-v3 whose
stages choose convolution, attention or both), in plain PyTorch.

Pipeline (upstream's): a 5^3 submanifold-convolution stem (BatchNorm, GELU,
optional mask token) -> encoder stages (grid pooling with BatchNorm, then
blocks) -> decoder stages (un-pooling with the encoder skip, then blocks).
A block is an optional convolution (3^3 submanifold conv -> Linear ->
LayerNorm, residual; without it a LayerNorm) followed by optional attention
and MLP (pre- or post-norm, drop path). Attention is PT-v3's serialized
patch attention with 3D rotary embedding of the voxel coordinates
(:mod:`.attention`); a level is serialized only where it attends (stage 0
when ``enc_attn[0]``, a pooled stage when its ``enc_attn``), so a purely
convolutional stage never sorts. The default puts convolutions in the three
fine stages and attention in the two coarse ones, with empty decoder stages.

Everything is reused from PT-v3 (:mod:`pimm.models.ptv3`): the point batch,
serialization, patch attention, spconv-layout convolution, grid pooling and
un-pooling, MLP, drop path. Constructor arguments and defaults, module and
parameter names are upstream's, so its configs build and its state dicts
load strictly.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Bool, Choice, Int, Positive, Real, Rule, Seq, Size, same_length
from pimm.utils.errors import ConfigError

from ..point_ops import voxelize
from ..ptv3.blocks import MLP, DropPath, PointModule, PointSequential, SubMConv3d
from ..ptv3.linear import Linear
from ..ptv3.model import _PATCH_SIZES, Embedding as _ConvEmbedding
from ..ptv3.pooling import GridPooling as _GridPooling, GridUnpooling
from ..ptv3.rows import Groups
from ..ptv3.serialization import ORDERS
from ..ptv3.structure import Point
from .attention import PointRoPEAttention

__all__ = ["LitePT", "Block", "Embedding", "GridPooling"]


class Embedding(_ConvEmbedding):
    """PT-v3m1's stem (5^3 submanifold convolution, norm, activation) with
    upstream LitePT's optional mask token over ``point.mask``."""

    def __init__(self, in_channels: int, embed_channels: int, norm_layer=None, act_layer=None,
                 mask_token: bool = False):
        super().__init__(in_channels, embed_channels, norm_layer, act_layer)
        self.mask_token = nn.Parameter(torch.zeros(1, embed_channels)) if mask_token else None

    def forward(self, point: Point) -> Point:
        point = self.stem(point)
        if self.mask_token is not None and "mask" in point:
            point["feat"] = torch.where(point["mask"].unsqueeze(-1), self.mask_token.to(point["feat"].dtype),
                                        point["feat"])
        return point


class GridPooling(_GridPooling):
    """PT-v3m2's grid pooling; the coarse level is serialized only when
    ``re_serialization`` (its stage attends), on ``serialization_order``."""

    def __init__(self, in_channels, out_channels, stride=2, norm_layer=None, act_layer=None, reduce="max",
                 shuffle_orders=True, traceable=True, re_serialization=False, serialization_order="z"):
        super().__init__(in_channels, out_channels, stride, norm_layer, act_layer, reduce, shuffle_orders, traceable)
        self.re_serialization = re_serialization
        self.serialization_order = [serialization_order] if isinstance(serialization_order, str) \
            else list(serialization_order)

    def forward(self, point: Point) -> Point:
        grid = torch.div(point.ensure_grid_coord(), self.stride, rounding_mode="floor")
        vgrid, vbatch, cluster = voxelize(grid, point["batch"])
        groups = Groups(cluster, vgrid.shape[0])
        new = self._pooled(point, groups, grid_coord=vgrid, batch=vbatch)
        if self.re_serialization:
            shuffle = self.shuffle_orders and self.training  # eval stays deterministic
            if "serialized_code" in point and list(point["order"]) == self.serialization_order:
                new.coarsen_serialization(point, cluster, self.stride, shuffle_orders=shuffle)
            else:
                new.serialization(order=self.serialization_order, shuffle_orders=shuffle)
            new["_cache"]["pooling_groups"] = groups  # (the serialization starts a new cache)
        return new


class Block(PointModule):
    """Optional convolution (``conv``: 3^3 submanifold conv, Linear,
    LayerNorm, residual; else ``norm0``), then optional attention and MLP
    (``norm1``, ``attn``, ``norm2``, ``mlp``, each residual with drop path)."""

    def __init__(self, channels: int, num_heads: int, patch_size: int = 48, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, qk_scale=None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, norm_layer=nn.LayerNorm, pre_norm: bool = True, order_index: int = 0,
                 enable_conv: bool = True, enable_attn: bool = True, rope_freq: float = 100.0):
        super().__init__()
        self.pre_norm, self.enable_conv, self.enable_attn = pre_norm, enable_conv, enable_attn
        if enable_conv:
            self.conv = PointSequential(SubMConv3d(channels, channels, 3, bias=True), Linear(channels, channels),
                                        norm_layer(channels))
        else:
            self.norm0 = PointSequential(norm_layer(channels))
        if enable_attn:
            self.norm1 = PointSequential(norm_layer(channels))
            self.attn = PointRoPEAttention(channels, num_heads, patch_size, rope_freq, qkv_bias, qk_scale, attn_drop,
                                           proj_drop, order_index)
            self.norm2 = PointSequential(norm_layer(channels))
            self.mlp = PointSequential(MLP(channels, int(channels * mlp_ratio), channels, proj_drop))
            self.drop_path = PointSequential(DropPath(drop_path) if drop_path > 0.0 else nn.Identity())

    def forward(self, point: Point) -> Point:
        feat = point["feat"]
        if self.enable_conv:
            # Full precision, as PT-v3's CPE: the convolution's sums are long.
            with torch.autocast(device_type=feat.device.type, enabled=False):
                conv, linear, norm = self.conv[0], self.conv[1], self.conv[2]
                feat32 = feat.float()
                feat = (feat32 + norm(point.sparse_conv(conv, feat32, then=linear))).to(feat.dtype)
        else:
            feat = self.norm0.features(point, feat)
        if self.enable_attn:
            x = self.norm1.features(point, feat) if self.pre_norm else feat
            feat = feat + self.drop_path.features(point, self.attn(point, x))
            if not self.pre_norm:
                feat = self.norm1.features(point, feat)
            x = self.norm2.features(point, feat) if self.pre_norm else feat
            feat = feat + self.drop_path.features(point, self.mlp.features(point, x))
            if not self.pre_norm:
                feat = self.norm2.features(point, feat)
        point["feat"] = feat
        return point


def _enough(name: str, stages_of=lambda a: len(a.enc_depths), when=lambda a: True) -> Rule:
    """Per-stage flags and frequencies: upstream reads entry ``s`` for stage
    ``s``, so a longer list is fine and a shorter one is not."""
    return Rule(lambda a: not when(a) or len(getattr(a, name)) >= stages_of(a), name,
                "at least one entry per stage")


def _decoder(a) -> bool:
    return not a.enc_mode


def _attended_levels_are_serialized(a) -> bool:
    """A decoder stage attends on its level's encoder serialization, which
    exists only where the encoder stage attends too."""
    return a.enc_mode or all(not a.dec_attn[s] or a.enc_attn[s] for s in range(len(a.enc_depths) - 1))


@MODELS.register_module("LitePT")
class LitePT(PointModule):
    """Upstream's ``LitePT`` (see the module doc). ``forward(data_dict)``
    takes ``feat``, ``offset`` and ``grid_coord`` (or ``coord`` +
    ``grid_size``) and returns the finest :class:`Point` (``enc_mode``: the
    coarsest, whose ``pooling_parent`` chain ``DefaultSegmentorV2`` walks
    back up); ``out_channels`` is the width ``DefaultSegmentorV2`` gets."""

    domains = dict(in_channels=Size, order=Choice(*ORDERS) | Seq(Choice(*ORDERS), min_len=1),
                   stride=Seq(Int(1, 16)), enc_depths=Seq(Int(0, 64), min_len=1), enc_channels=Seq(Size),
                   enc_num_head=Seq(Int(1, 1024)), enc_patch_size=_PATCH_SIZES, enc_conv=Seq(Bool),
                   enc_attn=Seq(Bool), enc_rope_freq=Seq(Positive), dec_depths=Seq(Int(0, 64)),
                   dec_channels=Seq(Size), dec_num_head=Seq(Int(1, 1024)), dec_patch_size=_PATCH_SIZES,
                   dec_conv=Seq(Bool), dec_attn=Seq(Bool), dec_rope_freq=Seq(Positive),
                   mlp_ratio=Real(0, 64, lo_open=True), qk_scale=Positive | None,
                   attn_drop=Real(0, 1, hi_open=True), proj_drop=Real(0, 1, hi_open=True),
                   drop_path=Real(0, 1, hi_open=True))
    domain_rules = (same_length("enc_depths", "enc_channels", "enc_num_head", "enc_patch_size", "stride",
                                offset=dict(stride=-1)),
                    same_length("enc_depths", "dec_depths", "dec_channels", "dec_num_head", "dec_patch_size",
                                offset=dict(dec_depths=-1, dec_channels=-1, dec_num_head=-1, dec_patch_size=-1),
                                when=_decoder),
                    *(_enough(name) for name in ("enc_conv", "enc_attn", "enc_rope_freq")),
                    *(_enough(name, lambda a: len(a.enc_depths) - 1, _decoder)
                      for name in ("dec_conv", "dec_attn", "dec_rope_freq")),
                    Rule(_attended_levels_are_serialized, "dec_attn",
                         "False at every stage whose enc_attn is False (a decoder stage attends on the "
                         "serialization its encoder stage made)"))

    def __init__(self, in_channels=4, order=("z", "z-trans", "hilbert", "hilbert-trans"), stride=(2, 2, 2, 2),
                 enc_depths=(2, 2, 2, 6, 2), enc_channels=(36, 72, 144, 252, 504), enc_num_head=(2, 4, 8, 14, 28),
                 enc_patch_size=(1024, 1024, 1024, 1024, 1024), enc_conv=(True, True, True, False, False),
                 enc_attn=(False, False, False, True, True), enc_rope_freq=(100.0, 100.0, 100.0, 100.0, 100.0),
                 dec_depths=(0, 0, 0, 0), dec_channels=(72, 72, 144, 252), dec_num_head=(4, 4, 8, 14),
                 dec_patch_size=(1024, 1024, 1024, 1024), dec_conv=(False, False, False, False),
                 dec_attn=(False, False, False, False), dec_rope_freq=(100.0, 100.0, 100.0, 100.0), mlp_ratio=4,
                 qkv_bias=True, qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.3, pre_norm=True,
                 shuffle_orders=True, mask_token=False, enc_mode=False, freeze_encoder=False, traceable=True):
        super().__init__()
        self.order = [order] if isinstance(order, str) else list(order)
        self.enc_mode, self.freeze_encoder, self.shuffle_orders = bool(enc_mode), bool(freeze_encoder), shuffle_orders
        self.enc_conv, self.enc_attn = list(enc_conv), list(enc_attn)
        self.dec_conv, self.dec_attn = list(dec_conv), list(dec_attn)
        self.num_stages = stages = len(enc_depths)
        self._check(stages, stride, enc_channels, enc_num_head, enc_patch_size, enc_conv, enc_attn, enc_rope_freq,
                    dec_depths, dec_channels, dec_num_head, dec_patch_size, dec_conv, dec_attn, dec_rope_freq)
        bn = partial(nn.BatchNorm1d, eps=1e-3, momentum=0.01)
        ln, act = nn.LayerNorm, nn.GELU
        self.embedding = Embedding(in_channels, enc_channels[0], bn, act, mask_token)
        block = partial(Block, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, qk_scale=qk_scale, attn_drop=attn_drop,
                        proj_drop=proj_drop, norm_layer=ln, pre_norm=pre_norm)

        enc_dp = [x.item() for x in torch.linspace(0, drop_path, sum(enc_depths))]
        self.enc = PointSequential()
        for s in range(stages):
            dp = enc_dp[sum(enc_depths[:s]):sum(enc_depths[:s + 1])]
            stage = PointSequential()
            if s > 0:
                stage.add(GridPooling(enc_channels[s - 1], enc_channels[s], stride=stride[s - 1], norm_layer=bn,
                                      act_layer=act, traceable=traceable, re_serialization=enc_attn[s],
                                      serialization_order=self.order, shuffle_orders=shuffle_orders), name="down")
            for i in range(enc_depths[s]):
                stage.add(block(enc_channels[s], enc_num_head[s], enc_patch_size[s], drop_path=dp[i],
                                order_index=i % len(self.order), enable_conv=enc_conv[s], enable_attn=enc_attn[s],
                                rope_freq=enc_rope_freq[s]), name=f"block{i}")
            if len(stage):
                self.enc.add(stage, name=f"enc{s}")
        if not self.enc_mode:
            dec_dp = [x.item() for x in torch.linspace(0, drop_path, sum(dec_depths))]
            self.dec = PointSequential()
            channels = list(dec_channels) + [enc_channels[-1]]
            for s in reversed(range(stages - 1)):
                dp = dec_dp[sum(dec_depths[:s]):sum(dec_depths[:s + 1])][::-1]
                stage = PointSequential()
                stage.add(GridUnpooling(channels[s + 1], enc_channels[s], channels[s], norm_layer=bn, act_layer=act,
                                        traceable=traceable), name="up")
                for i in range(dec_depths[s]):
                    stage.add(block(channels[s], dec_num_head[s], dec_patch_size[s], drop_path=dp[i],
                                    order_index=i % len(self.order), enable_conv=dec_conv[s],
                                    enable_attn=dec_attn[s], rope_freq=dec_rope_freq[s]), name=f"block{i}")
                self.dec.add(stage, name=f"dec{s}")
        if self.freeze_encoder:
            for p in list(self.embedding.parameters()) + list(self.enc.parameters()):
                p.requires_grad = False
        # enc_mode: DefaultSegmentorV2 concatenates every level's features back up.
        self.out_channels = sum(enc_channels) if self.enc_mode else (list(dec_channels) + [enc_channels[-1]])[0]

    def _check(self, stages, stride, enc_channels, enc_num_head, enc_patch_size, enc_conv, enc_attn, enc_rope_freq,
               dec_depths, dec_channels, dec_num_head, dec_patch_size, dec_conv, dec_attn, dec_rope_freq) -> None:
        """Upstream's asserts as one-line errors (a config passes the domains
        first; this covers a model built from Python)."""
        for o in self.order:
            if o not in ORDERS:
                raise ConfigError(f"LitePT: order={o!r} is not a serialization order; use one of {list(ORDERS)}")
        if not self.order:
            raise ConfigError(f"LitePT: order is empty; give at least one of {list(ORDERS)}")
        exact = [("stride", stride, stages - 1), ("enc_channels", enc_channels, stages),
                 ("enc_num_head", enc_num_head, stages), ("enc_patch_size", enc_patch_size, stages)]
        at_least = [("enc_conv", enc_conv, stages), ("enc_attn", enc_attn, stages),
                    ("enc_rope_freq", enc_rope_freq, stages)]
        if not self.enc_mode:
            exact += [(name, v, stages - 1) for name, v in (("dec_depths", dec_depths), ("dec_channels", dec_channels),
                                                            ("dec_num_head", dec_num_head),
                                                            ("dec_patch_size", dec_patch_size))]
            at_least += [(name, v, stages - 1) for name, v in (("dec_conv", dec_conv), ("dec_attn", dec_attn),
                                                               ("dec_rope_freq", dec_rope_freq))]
        for name, values, n in exact:
            if len(values) != n:
                raise ConfigError(f"LitePT: {name} has {len(values)} entries, enc_depths (len {stages}) needs {n}")
        for name, values, n in at_least:
            if len(values) < n:
                raise ConfigError(f"LitePT: {name} has {len(values)} entries, enc_depths (len {stages}) needs at "
                                  f"least {n}")
        widths = [("enc", s, enc_channels[s], enc_num_head[s], enc_patch_size[s]) for s in range(stages)
                  if enc_attn[s]]
        if not self.enc_mode:
            widths += [("dec", s, dec_channels[s], dec_num_head[s], dec_patch_size[s]) for s in range(stages - 1)
                       if dec_attn[s]]
            for s in range(stages - 1):
                if dec_attn[s] and not enc_attn[s]:
                    raise ConfigError(f"LitePT: dec_attn[{s}]=True but enc_attn[{s}]=False: a decoder stage attends "
                                      "on the serialization its encoder stage made; enable both or neither")
        for part, s, channels, heads, patch in widths:
            if channels % heads:
                raise ConfigError(f"LitePT: {part}_channels[{s}]={channels} is not divisible by "
                                  f"{part}_num_head[{s}]={heads}")
            if patch < 1 and patch != -1:
                raise ConfigError(f"LitePT: {part}_patch_size[{s}]={patch}; use >= 1 (or -1: whole events)")

    @classmethod
    def masks_features(cls, args: dict) -> bool:
        """Whether this config replaces the features of a batch's masked points
        (``mask``) by a learned token (what Sonata's mask losses need)."""
        return bool(args.get("mask_token", False))

    @property
    def has_mask_token(self) -> bool:
        return self.embedding.mask_token is not None

    def forward(self, data_dict) -> Point:
        point = data_dict if isinstance(data_dict, Point) else Point(data_dict)
        if "offset" not in point:
            raise ConfigError("LitePT: the batch has no offset (the collate function adds it)")
        point["offset"] = point["offset"].to(point["feat"].device)
        point["batch"] = point["batch"].to(point["feat"].device)
        point.ensure_grid_coord()
        if self.enc_attn[0]:
            point.serialization(order=self.order, shuffle_orders=self.shuffle_orders and self.training)
        point = self.embedding(point)
        point = self.enc(point)
        if not self.enc_mode:
            point = self.dec(point)
        return point
