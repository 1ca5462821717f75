"""Point Transformer v2 under upstream pimm's names and arguments:

* ``PT-v2m1``: the paper's model, attention weights from a grouped linear
  layer (one weight per channel, summed per group);
* ``PT-v2m2`` (upstream's recommended one): the same with a plain Linear;
* ``PT-v2m3``: m2 with prompt-driven normalisation (PDNorm, Point Prompt
  Training) in its blocks, pooling and un-pooling, and a one-Linear head.

The network: a stem (Linear-norm-ReLU and ``patch_embed_depth`` blocks at
full resolution), then per stage grid pooling on cells of ``grid_sizes[i]``
(coordinate units, from each event's minimum corner) and ``enc_depths[i]``
blocks, and back up per stage un-pooling (``unpool_backend``: ``"map"``
copies a cell's features to its points, ``"interp"`` interpolates from the 3
nearest cells) plus the skip, and ``dec_depths[i]`` blocks. A block is
grouped vector attention over the ``*_neighbours`` nearest points.

``forward(data_dict)`` reads ``coord`` (N, 3), ``feat`` (N, in_channels) and
``offset`` and returns (N, num_classes) logits, or with ``num_classes=0``
the (N, dec_channels[0]) features (``out_channels`` says which width).
PT-v2m3 also reads ``condition`` (the batch's data set: a name, or one per
event, all the same) and, with ``norm_adaptive``, ``context``
((context_channels,) or (1, context_channels)).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import MAX_SIZE, Choice, Int, Length, Names, Prob, Real, Rule, Seq, Size, same_length
from pimm.utils.errors import ConfigError, UserError

from .blocks import Decoder, Encoder, GVAPatchEmbed, PointBatchNorm
from .pdnorm import PDBatchNorm

__all__ = ["PointTransformerV2", "PointTransformerV2m2", "PointTransformerV2m3"]

_STAGES = ("enc_depths", "enc_channels", "enc_groups", "enc_neighbours", "dec_depths", "dec_channels", "dec_groups",
           "dec_neighbours", "grid_sizes")


def _divides(channels: str, groups: str):
    return Rule(lambda a: all(int(c) % int(g) == 0 for c, g in zip(getattr(a, channels), getattr(a, groups))),
                groups, f"divisors of {channels}, one per stage")


@MODELS.register_module("PT-v2m1")
class PointTransformerV2(nn.Module):
    """``PT-v2m1`` (see the module doc)."""

    variant = "PT-v2m1"
    grouped_weight = True  # m1's GroupedLinear attention weights

    domains = dict(in_channels=Size, num_classes=Int(0, MAX_SIZE), patch_embed_depth=Int(0, 256),
                   patch_embed_channels=Size, patch_embed_groups=Size, patch_embed_neighbours=Int(1, 1024),
                   enc_depths=Seq(Int(0, 256), min_len=1), enc_channels=Seq(Size), enc_groups=Seq(Size),
                   enc_neighbours=Seq(Int(1, 1024)), dec_depths=Seq(Int(0, 256)), dec_channels=Seq(Size),
                   dec_groups=Seq(Size), dec_neighbours=Seq(Int(1, 1024)), grid_sizes=Seq(Length),
                   attn_drop_rate=Prob, drop_path_rate=Real(0, 1), unpool_backend=Choice("map", "interp"))
    domain_rules = (same_length(*_STAGES),
                    Rule(lambda a: int(a.patch_embed_channels) % int(a.patch_embed_groups) == 0, "patch_embed_groups",
                         "a divisor of patch_embed_channels"),
                    _divides("enc_channels", "enc_groups"), _divides("dec_channels", "dec_groups"))

    @classmethod
    def output_classes(cls, args: dict) -> int | None:
        """Per-point class logits when there is a head: what ``DefaultSegmentor``
        without ``num_classes`` (upstream's form) reads."""
        classes = args.get("num_classes")
        return classes if isinstance(classes, int) and classes > 0 else None

    def __init__(self, in_channels, num_classes, patch_embed_depth=1, patch_embed_channels=48, patch_embed_groups=6,
                 patch_embed_neighbours=8, enc_depths=(2, 2, 6, 2), enc_channels=(96, 192, 384, 512),
                 enc_groups=(12, 24, 48, 64), enc_neighbours=(16, 16, 16, 16), dec_depths=(1, 1, 1, 1),
                 dec_channels=(48, 96, 192, 384), dec_groups=(6, 12, 24, 48), dec_neighbours=(16, 16, 16, 16),
                 grid_sizes=(0.06, 0.12, 0.24, 0.48), attn_qkv_bias=True, pe_multiplier=False, pe_bias=True,
                 attn_drop_rate=0.0, drop_path_rate=0, enable_checkpoint=False, unpool_backend="map"):
        super().__init__()
        self._build(in_channels, num_classes, patch_embed_depth, patch_embed_channels, patch_embed_groups,
                    patch_embed_neighbours, enc_depths, enc_channels, enc_groups, enc_neighbours, dec_depths,
                    dec_channels, dec_groups, dec_neighbours, grid_sizes, attn_qkv_bias, pe_multiplier, pe_bias,
                    attn_drop_rate, drop_path_rate, enable_checkpoint, unpool_backend, norm_fn=None)

    def _check(self, stages: dict, patch_embed: tuple[int, int]) -> None:
        """The domains' rules, for a model built from Python (a config is checked before)."""
        lengths = {name: len(value) for name, value in stages.items()}
        if len(set(lengths.values())) != 1 or not lengths["enc_depths"]:
            raise ConfigError(f"{self.variant}: {', '.join(_STAGES)} need one entry per stage each, got {lengths}")
        pairs = [("patch_embed_channels", [patch_embed[0]], "patch_embed_groups", [patch_embed[1]]),
                 ("enc_channels", stages["enc_channels"], "enc_groups", stages["enc_groups"]),
                 ("dec_channels", stages["dec_channels"], "dec_groups", stages["dec_groups"])]
        for channels, widths, groups, counts in pairs:
            if any(int(w) % int(g) for w, g in zip(widths, counts)):
                raise ConfigError(f"{self.variant}: {groups}={list(counts)} must divide {channels}={list(widths)}")

    def _build(self, in_channels, num_classes, patch_embed_depth, patch_embed_channels, patch_embed_groups,
               patch_embed_neighbours, enc_depths, enc_channels, enc_groups, enc_neighbours, dec_depths, dec_channels,
               dec_groups, dec_neighbours, grid_sizes, attn_qkv_bias, pe_multiplier, pe_bias, attn_drop_rate,
               drop_path_rate, enable_checkpoint, unpool_backend, norm_fn) -> None:
        stages = dict(zip(_STAGES, (enc_depths, enc_channels, enc_groups, enc_neighbours, dec_depths, dec_channels,
                                    dec_groups, dec_neighbours, grid_sizes)))
        self._check(stages, (patch_embed_channels, patch_embed_groups))
        if unpool_backend not in ("map", "interp"):
            raise ConfigError(f"{self.variant}: unpool_backend={unpool_backend!r}: use 'map' or 'interp'")
        self.in_channels, self.num_classes = int(in_channels), int(num_classes)
        self.num_stages = len(enc_depths)
        attention = dict(qkv_bias=attn_qkv_bias, pe_multiplier=pe_multiplier, pe_bias=pe_bias,
                         attn_drop_rate=attn_drop_rate, enable_checkpoint=enable_checkpoint, norm_fn=norm_fn,
                         grouped_weight=self.grouped_weight)
        self.patch_embed = GVAPatchEmbed(depth=patch_embed_depth, in_channels=in_channels,
                                         embed_channels=patch_embed_channels, groups=patch_embed_groups,
                                         neighbours=patch_embed_neighbours, **attention)
        enc_rates = [x.item() for x in torch.linspace(0, drop_path_rate, sum(enc_depths))]
        dec_rates = [x.item() for x in torch.linspace(0, drop_path_rate, sum(dec_depths))]
        enc_widths = [patch_embed_channels, *enc_channels]
        dec_widths = [*dec_channels, enc_widths[-1]]
        self.enc_stages, self.dec_stages = nn.ModuleList(), nn.ModuleList()
        for i in range(self.num_stages):
            enc_span = slice(sum(enc_depths[:i]), sum(enc_depths[:i + 1]))
            dec_span = slice(sum(dec_depths[:i]), sum(dec_depths[:i + 1]))
            self.enc_stages.append(Encoder(depth=enc_depths[i], in_channels=enc_widths[i],
                                           embed_channels=enc_widths[i + 1], groups=enc_groups[i],
                                           grid_size=grid_sizes[i], neighbours=enc_neighbours[i],
                                           drop_path_rate=enc_rates[enc_span], **attention))
            self.dec_stages.append(Decoder(depth=dec_depths[i], in_channels=dec_widths[i + 1],
                                           skip_channels=enc_widths[i], embed_channels=dec_widths[i],
                                           groups=dec_groups[i], neighbours=dec_neighbours[i],
                                           drop_path_rate=dec_rates[dec_span], unpool_backend=unpool_backend,
                                           **attention))
        self.seg_head = self._head(dec_widths[0], self.num_classes) if self.num_classes > 0 else nn.Identity()
        self.out_channels = self.num_classes if self.num_classes > 0 else dec_widths[0]

    @staticmethod
    def _head(width: int, num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, width), PointBatchNorm(width), nn.ReLU(inplace=True),
                             nn.Linear(width, num_classes))

    def _prompt(self, data_dict: dict):
        return None

    def forward(self, data_dict: dict) -> torch.Tensor:
        feat = data_dict["feat"]
        if feat.dim() != 2 or feat.shape[1] != self.in_channels:
            raise UserError(f"{self.variant}: in_channels={self.in_channels} but the batch's feat has shape "
                            f"{tuple(feat.shape)}")
        prompt = self._prompt(data_dict)
        points = self.patch_embed([data_dict["coord"], feat, data_dict["offset"].int()], prompt)
        skips = []
        for stage in self.enc_stages:
            coarse, cluster = stage(points, prompt)
            skips.append((points, cluster))
            points = coarse
        for i in reversed(range(self.num_stages)):
            skip_points, cluster = skips[i]
            points = self.dec_stages[i](points, skip_points, cluster, prompt)
        return self.seg_head(points[1])


@MODELS.register_module("PT-v2m2")
class PointTransformerV2m2(PointTransformerV2):
    """``PT-v2m2``: PT-v2m1 with a Linear for the attention weights."""

    variant = "PT-v2m2"
    grouped_weight = False


@MODELS.register_module("PT-v2m3")
class PointTransformerV2m3(PointTransformerV2m2):
    """``PT-v2m3``: PT-v2m2 with PDNorm (``context_channels``, ``conditions``,
    ``norm_decouple``, ``norm_adaptive``, ``norm_affine``; BatchNorms with
    eps 1e-3 and momentum 0.01) and a one-Linear head."""

    variant = "PT-v2m3"
    domains = dict(context_channels=Size, conditions=Names)

    def __init__(self, in_channels, num_classes, patch_embed_depth=1, patch_embed_channels=48, patch_embed_groups=6,
                 patch_embed_neighbours=8, enc_depths=(2, 2, 6, 2), enc_channels=(96, 192, 384, 512),
                 enc_groups=(12, 24, 48, 64), enc_neighbours=(16, 16, 16, 16), dec_depths=(1, 1, 1, 1),
                 dec_channels=(48, 96, 192, 384), dec_groups=(6, 12, 24, 48), dec_neighbours=(16, 16, 16, 16),
                 grid_sizes=(0.06, 0.12, 0.24, 0.48), attn_qkv_bias=True, pe_multiplier=False, pe_bias=True,
                 attn_drop_rate=0.0, drop_path_rate=0, enable_checkpoint=False, unpool_backend="map",
                 context_channels=256, conditions=("ScanNet", "S3DIS", "Structured3D"), norm_decouple=True,
                 norm_adaptive=True, norm_affine=False):
        nn.Module.__init__(self)
        self.conditions = tuple(conditions)
        self.context_channels = int(context_channels)
        self.norm_decouple, self.norm_adaptive = bool(norm_decouple), bool(norm_adaptive)
        norm_fn = partial(PDBatchNorm, eps=1e-3, momentum=0.01, conditions=self.conditions,
                          context_channels=self.context_channels, decouple=self.norm_decouple,
                          adaptive=self.norm_adaptive, affine=norm_affine)
        self._build(in_channels, num_classes, patch_embed_depth, patch_embed_channels, patch_embed_groups,
                    patch_embed_neighbours, enc_depths, enc_channels, enc_groups, enc_neighbours, dec_depths,
                    dec_channels, dec_groups, dec_neighbours, grid_sizes, attn_qkv_bias, pe_multiplier, pe_bias,
                    attn_drop_rate, drop_path_rate, enable_checkpoint, unpool_backend, norm_fn=norm_fn)

    @staticmethod
    def _head(width: int, num_classes: int) -> nn.Module:
        return nn.Sequential(nn.Linear(width, num_classes))

    def _prompt(self, data_dict: dict):
        """``(condition, context)`` of the batch, checked once here."""
        condition = data_dict.get("condition")
        if isinstance(condition, (list, tuple)):
            if len(set(condition)) > 1:
                raise UserError(f"{self.variant}: one condition per batch (upstream's rule), got "
                                f"{sorted(set(condition))}; batch events of one data set together")
            condition = condition[0] if condition else None
        if self.norm_decouple and condition not in self.conditions:
            raise UserError(f"{self.variant}: the batch's condition {condition!r} is none of conditions="
                            f"{list(self.conditions)} (norm_decouple=True picks a BatchNorm by it)")
        context = data_dict.get("context")
        if self.norm_adaptive:
            if context is None:
                raise UserError(f"{self.variant}: norm_adaptive=True needs the batch's 'context' "
                                f"(context_channels={self.context_channels} numbers)")
            context = torch.as_tensor(context, dtype=data_dict["feat"].dtype, device=data_dict["feat"].device)
            if context.numel() != self.context_channels or context.dim() > 2:
                raise UserError(f"{self.variant}: the batch's context has shape {tuple(context.shape)}; it takes "
                                f"({self.context_channels},) or (1, {self.context_channels}), one for the batch")
            context = context.reshape(1, self.context_channels)
        return condition, context
