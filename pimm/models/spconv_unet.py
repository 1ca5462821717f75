"""Upstream's spconv U-Nets -- ``SpUNet-v1m1``, ``SpUNet-v1m2`` and
``SpUNetNoSkipBase`` -- on pimm's sparse convolution.

The same network as upstream's (``pimm/models/sparse_unet/spconv_unet_v1m*``
there, after Pointcept): a 5^3 submanifold stem, then per stage a stride-2
convolution (kernel 2) and residual blocks of two 3^3 submanifold
convolutions; on the way up spconv's inverse convolution back onto the
finer level's voxels, concatenation with that level's skip (not in
``SpUNetNoSkipBase``) and blocks again; a 1x1 convolution to ``num_classes``.
Module names, weight layouts (:mod:`pimm.models.sparse_layouts`), the
BatchNorm settings of each variant and the initialisation are upstream's, so
its checkpoints load strictly and compute what they computed under spconv
(tested against upstream's own code on spconv's CPU path,
``tests/fixtures/sparse_unets``).

Where spconv's grid bounds matter: v1m2 and ``SpUNetNoSkipBase`` size the
grid as ``max(grid_coord) + 1`` (v1m1: ``+ 96``), and spconv's strided
convolution drops a voxel whose parent falls past that bound (the last
plane of an axis with an odd extent); the same voxels are dropped here
(:func:`~pimm.models.sparse_maps.kernel_map_pyramid`'s ``extent``). Where an
extent would shrink to 0 spconv stops with an error; here it stays 1.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Callable, Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Bool, Int, MAX_SIZE, Real, Rule, Seq, Size, same_length
from pimm.utils.errors import ConfigError

from .point_ops import scatter_mean
from .sparse_layouts import SparseSequential, SpconvConv
from .sparse_maps import KernelMap
from .sparse_unet_levels import unet_levels

__all__ = ["BasicBlock", "SpUNetBase", "SpUNetV1m1", "SpUNetV1m2", "SpUNetNoSkipBase", "check_stages"]

Norm = Callable[[int], nn.Module]


def check_stages(owner: str, channels: Sequence[int], layers: Sequence[int], decoder: bool) -> None:
    """Upstream's shape rules (its asserts), as one-line errors."""
    if len(channels) != len(layers) or len(layers) % 2 or not layers:
        raise ConfigError(f"{owner}: channels and layers take one entry per stage, as many encoder stages as decoder "
                          f"stages (an even number), got {len(channels)} and {len(layers)}")
    if decoder and min(layers[len(layers) // 2:]) < 1:
        raise ConfigError(f"{owner}: every decoder stage needs a block (layers[{len(layers) // 2}:] >= 1), "
                          f"got layers={tuple(layers)}")


def stage_domains(**extra) -> tuple[dict, tuple]:
    """The argument domains the spconv U-Nets share."""
    domains = dict(in_channels=Size, base_channels=Size, channels=Seq(Size, min_len=2),
                   layers=Seq(Int(0, 256), min_len=2), **extra)
    rules = (same_length("channels", "layers"),
             Rule(lambda a: len(a.layers) % 2 == 0, "layers", "an even number of entries (encoder + decoder stages)"))
    return domains, rules


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN (+ ``proj`` of the input) -ReLU, 3^3 submanifold;
    ``proj`` is a 1x1 convolution and its norm when the width changes."""

    takes_kmap = True

    def __init__(self, in_channels: int, embed_channels: int, norm_fn: Norm, proj_norm_fn: Norm):
        super().__init__()
        if in_channels == embed_channels:
            self.proj = SparseSequential(nn.Identity())
        else:
            self.proj = SparseSequential(SpconvConv(in_channels, embed_channels, 1), proj_norm_fn(embed_channels))
        self.conv1 = SpconvConv(in_channels, embed_channels, 3)
        self.bn1 = norm_fn(embed_channels)
        self.relu = nn.ReLU()
        self.conv2 = SpconvConv(embed_channels, embed_channels, 3)
        self.bn2 = norm_fn(embed_channels)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x, kmap)))
        out = self.bn2(self.conv2(out, kmap))
        return self.relu(out + self.proj(x, kmap))


def _blocks(widths: list[tuple[int, int]], norm_fn: Norm, proj_norm_fn: Norm) -> SparseSequential:
    return SparseSequential(OrderedDict((f"block{i}", BasicBlock(cin, cout, norm_fn, proj_norm_fn))
                                        for i, (cin, cout) in enumerate(widths)))


class SpUNetBase(nn.Module):
    """The spconv U-Net; the registered variants set its norms and options.

    ``forward(input_dict)`` (``grid_coord``, ``feat``, ``offset``) returns one
    row per point: ``num_classes`` logits, or the last decoder's features
    when ``num_classes=0``; with ``cls_mode`` one row per event (the mean over
    the coarsest level's voxels).
    """

    owner = "SpUNet"
    extent_margin = 96  # spconv's spatial_shape: max(grid_coord) + this

    @classmethod
    def output_classes(cls, args: dict) -> int | None:
        """Per-point class logits (what ``DefaultSegmentor`` without ``num_classes`` reads), when there is a head."""
        classes = args.get("num_classes", args.get("out_channels"))
        return classes if isinstance(classes, int) and classes > 0 and not args.get("cls_mode") else None

    def _build(self, in_channels: int, num_classes: int, base_channels: int, channels: Sequence[int],
               layers: Sequence[int], cls_mode: bool, skip: bool, norm_fn: Norm, side_norm_fn: Norm) -> None:
        check_stages(self.owner, channels, layers, decoder=not cls_mode)
        self.in_channels, self.num_classes, self.base_channels = in_channels, num_classes, base_channels
        self.channels, self.layers = tuple(channels), tuple(layers)
        self.num_stages = len(layers) // 2
        self.cls_mode, self.skip = bool(cls_mode), bool(skip)

        self.conv_input = SparseSequential(SpconvConv(in_channels, base_channels, 5), side_norm_fn(base_channels),
                                           nn.ReLU())
        enc_channels, dec_channels = base_channels, channels[-1]
        self.down, self.up, self.enc = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        self.dec = None if self.cls_mode else nn.ModuleList()
        for s in range(self.num_stages):
            self.down.append(SparseSequential(SpconvConv(enc_channels, channels[s], 2), side_norm_fn(channels[s]),
                                              nn.ReLU()))
            self.enc.append(_blocks([(channels[s], channels[s])] * layers[s], norm_fn, side_norm_fn))
            if not self.cls_mode:
                self.up.append(SparseSequential(SpconvConv(channels[-s - 2], dec_channels, 2),
                                                side_norm_fn(dec_channels), nn.ReLU()))
                first = dec_channels + enc_channels if self.skip else dec_channels
                widths = [(first if i == 0 else dec_channels, dec_channels) for i in range(layers[-s - 1])]
                self.dec.append(_blocks(widths, norm_fn, side_norm_fn))
            enc_channels, dec_channels = channels[s], channels[-s - 2]
        final_in = channels[self.num_stages - 1] if self.cls_mode else channels[-1]
        self.final = SpconvConv(final_in, num_classes, 1, bias=True) if num_classes > 0 else nn.Identity()
        self.out_channels = num_classes if num_classes > 0 else final_in
        self._init_weights()

    def _init_weights(self) -> None:
        """Upstream's: its submanifold convolutions and linear layers ~ N(0,
        0.02) (truncated at +-2), zero biases; the strided and inverse
        convolutions keep spconv's init."""
        for name, module in self.named_modules():
            subm = isinstance(module, SpconvConv) and not name.startswith(("down.", "up."))
            if subm or isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, input_dict: dict) -> torch.Tensor:
        levels = unet_levels(input_dict, self.owner, self.num_stages + 1, self.conv_input[0].weight.dtype,
                             extent_margin=self.extent_margin)
        x = self.conv_input(levels.feat, levels.stem)
        skips = [x]
        for s in range(self.num_stages):
            x = self.down[s](x, levels.down[s])
            x = self.enc[s](x, levels.subm[s + 1])
            skips.append(x)
        x = skips.pop(-1)
        if not self.cls_mode:
            for s in reversed(range(self.num_stages)):
                x = self.up[s](x, levels.down[s].transposed())
                skip = skips.pop(-1)
                if self.skip:
                    x = torch.cat([x, skip], dim=1)
                x = self.dec[s](x, levels.subm[s])
        x = self.final(x)
        if self.cls_mode:
            return scatter_mean(x, levels.level_batch(self.num_stages), len(input_dict["offset"]))
        return x.index_select(0, levels.inverse)


_STAGES = dict(channels=(32, 64, 128, 256, 256, 128, 96, 96), layers=(2, 3, 4, 6, 2, 2, 2, 2))


@MODELS.register_module("SpUNet-v1m1")
class SpUNetV1m1(SpUNetBase):
    """Upstream's ``SpUNet-v1m1``: every BatchNorm ``eps=1e-3, momentum=0.01``;
    ``cls_mode`` drops the decoder and averages the coarsest level per event."""

    owner = "SpUNet-v1m1"
    domains, domain_rules = stage_domains(num_classes=Int(0, MAX_SIZE), cls_mode=Bool)

    def __init__(self, in_channels: int, num_classes: int, base_channels: int = 32,
                 channels: Sequence[int] = _STAGES["channels"], layers: Sequence[int] = _STAGES["layers"],
                 cls_mode: bool = False):
        super().__init__()
        norm = partial(nn.BatchNorm1d, eps=1e-3, momentum=0.01)
        self._build(in_channels, num_classes, base_channels, channels, layers, cls_mode, True, norm, norm)


@MODELS.register_module("SpUNet-v1m2")
class SpUNetV1m2(SpUNetBase):
    """Upstream's ``SpUNet-v1m2``: the blocks' BatchNorms ``eps=1e-5,
    momentum=bn_momentum``, the others (stem, down, up, projections)
    ``momentum=0.02``; spconv grid ``max(grid_coord) + 1``."""

    owner = "SpUNet-v1m2"
    extent_margin = 1
    domains, domain_rules = stage_domains(num_classes=Int(0, MAX_SIZE), bn_momentum=Real(0, 1) | None)

    def __init__(self, in_channels: int, num_classes: int, base_channels: int = 32,
                 channels: Sequence[int] = _STAGES["channels"], layers: Sequence[int] = _STAGES["layers"],
                 bn_momentum: float = 0.1):
        super().__init__()
        norm = partial(nn.BatchNorm1d, eps=1e-5, momentum=bn_momentum)
        side = partial(nn.BatchNorm1d, eps=1e-5, momentum=0.02)
        self._build(in_channels, num_classes, base_channels, channels, layers, False, True, norm, side)


@MODELS.register_module()
class SpUNetNoSkipBase(SpUNetBase):
    """Upstream's ``SpUNetNoSkipBase``: v1m1 without the skip connections
    (each decoder stage sees only the upsampled features), ``out_channels``
    outputs, spconv grid ``max(grid_coord) + 1``."""

    owner = "SpUNetNoSkipBase"
    extent_margin = 1
    domains, domain_rules = stage_domains(out_channels=Int(0, MAX_SIZE))

    def __init__(self, in_channels: int, out_channels: int, base_channels: int = 32,
                 channels: Sequence[int] = _STAGES["channels"], layers: Sequence[int] = _STAGES["layers"]):
        super().__init__()
        norm = partial(nn.BatchNorm1d, eps=1e-3, momentum=0.01)
        self._build(in_channels, out_channels, base_channels, channels, layers, False, False, norm, norm)
