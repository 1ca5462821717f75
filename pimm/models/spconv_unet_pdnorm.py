"""Upstream's ``SpUNet-v1m3``: the spconv U-Net with prompt-driven
normalisation (PDNorm, from Point Prompt Training) on pimm's sparse
convolution.

Every BatchNorm becomes a :class:`PDBatchNorm`: one BatchNorm per data set
named in ``conditions`` (``norm_decouple``), the batch's ``condition``
picking which, and, with ``norm_adaptive``, a scale and shift computed from
the batch's ``context`` vector (``SiLU`` then ``Linear(context_channels,
2 * C)``, zero at init with ``zero_init``). The rest is the U-Net of
:mod:`pimm.models.spconv_unet` with upstream's module names (``conv_input.conv``,
``down.<s>.conv``, ``enc.<s>.block<i>.proj_conv``...).

The batch carries what upstream's Point Prompt Training wrapper provides:
``condition`` (a data set name, or one per event: they must agree, one
condition per batch as upstream) and, with ``norm_adaptive``, ``context``
(one row of ``context_channels``, or a flat vector: the prompt embedding
that wrapper learns). Upstream registers no such wrapper and neither does
pimm: with ``norm_adaptive=True`` (the default) a batch needs ``context``
from the data pipeline; ``norm_adaptive=False`` needs none.
"""

from __future__ import annotations

from collections import OrderedDict
from functools import partial
from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Bool, Int, Keys, MAX_SIZE, Size
from pimm.utils.errors import ConfigError

from .point_ops import scatter_mean
from .ptv2.pdnorm import PDBatchNorm
from .sparse_layouts import SparseSequential, SpconvConv
from .sparse_maps import KernelMap
from .sparse_unet_levels import unet_levels
from .spconv_unet import SpUNetBase, check_stages, stage_domains

__all__ = ["PDBatchNorm", "SpUNetV1m3"]


class _Prompted(nn.Module):
    """conv -> PDNorm -> ReLU: upstream's stem, down and up modules."""

    def __init__(self, conv: SpconvConv, norm_fn):
        super().__init__()
        self.conv = conv
        self.bn = norm_fn(conv.out_channels)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor, kmap: KernelMap, condition, context) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x, kmap), (condition, context)))


class BasicBlock(nn.Module):
    """Upstream's v1m3 block: as v1m1's, with PDNorms and the projection as
    ``proj_conv`` / ``proj_norm``."""

    def __init__(self, in_channels: int, embed_channels: int, norm_fn):
        super().__init__()
        self.in_channels, self.embed_channels = in_channels, embed_channels
        if in_channels == embed_channels:
            self.proj = SparseSequential(nn.Identity())
        else:
            self.proj_conv = SpconvConv(in_channels, embed_channels, 1)
            self.proj_norm = norm_fn(embed_channels)
        self.conv1 = SpconvConv(in_channels, embed_channels, 3)
        self.bn1 = norm_fn(embed_channels)
        self.relu = nn.ReLU()
        self.conv2 = SpconvConv(embed_channels, embed_channels, 3)
        self.bn2 = norm_fn(embed_channels)

    def forward(self, x: torch.Tensor, kmap: KernelMap, condition, context) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x, kmap), (condition, context)))
        out = self.bn2(self.conv2(out, kmap), (condition, context))
        if self.in_channels == self.embed_channels:
            residual = self.proj(x)
        else:
            residual = self.proj_norm(self.proj_conv(x), (condition, context))
        return self.relu(out + residual)


class _Blocks(nn.Sequential):
    def forward(self, x: torch.Tensor, kmap: KernelMap, condition, context) -> torch.Tensor:
        for block in self:
            x = block(x, kmap, condition, context)
        return x


@MODELS.register_module("SpUNet-v1m3")
class SpUNetV1m3(SpUNetBase):
    """Upstream's ``SpUNet-v1m3`` (module doc). ``norm_affine=False`` (the
    default) leaves the BatchNorms without weight and bias: the modulation
    scales and shifts instead."""

    owner = "SpUNet-v1m3"
    domains, domain_rules = stage_domains(num_classes=Int(0, MAX_SIZE), context_channels=Size, cls_mode=Bool,
                                          conditions=Keys, zero_init=Bool, norm_decouple=Bool, norm_adaptive=Bool,
                                          norm_affine=Bool)

    def __init__(self, in_channels: int, num_classes: int = 0, base_channels: int = 32, context_channels: int = 256,
                 channels: Sequence[int] = (32, 64, 128, 256, 256, 128, 96, 96),
                 layers: Sequence[int] = (2, 3, 4, 6, 2, 2, 2, 2), cls_mode: bool = False,
                 conditions: Sequence[str] = ("ScanNet", "S3DIS", "Structured3D"), zero_init: bool = True,
                 norm_decouple: bool = True, norm_adaptive: bool = True, norm_affine: bool = False):
        super().__init__()
        check_stages(self.owner, channels, layers, decoder=not cls_mode)
        if norm_decouple and not conditions:
            raise ConfigError(f"{self.owner}: norm_decouple=True needs at least one name in conditions")
        self.in_channels, self.num_classes, self.base_channels = in_channels, num_classes, base_channels
        self.channels, self.layers, self.num_stages = tuple(channels), tuple(layers), len(layers) // 2
        self.cls_mode, self.conditions, self.zero_init = bool(cls_mode), tuple(conditions), bool(zero_init)
        self.norm_decouple, self.norm_adaptive = bool(norm_decouple), bool(norm_adaptive)
        self.context_channels = context_channels
        norm_fn = partial(PDBatchNorm, eps=1e-3, momentum=0.01, conditions=self.conditions,
                          context_channels=context_channels, decouple=norm_decouple, adaptive=norm_adaptive,
                          affine=norm_affine)

        self.conv_input = _Prompted(SpconvConv(in_channels, base_channels, 5), norm_fn)
        enc_channels, dec_channels = base_channels, channels[-1]
        self.down, self.up, self.enc = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        self.dec = None if self.cls_mode else nn.ModuleList()
        for s in range(self.num_stages):
            self.down.append(_Prompted(SpconvConv(enc_channels, channels[s], 2), norm_fn))
            self.enc.append(_Blocks(OrderedDict((f"block{i}", BasicBlock(channels[s], channels[s], norm_fn))
                                                for i in range(layers[s]))))
            if not self.cls_mode:
                self.up.append(_Prompted(SpconvConv(channels[-s - 2], dec_channels, 2), norm_fn))
                first = dec_channels + enc_channels
                self.dec.append(_Blocks(OrderedDict(
                    (f"block{i}", BasicBlock(first if i == 0 else dec_channels, dec_channels, norm_fn))
                    for i in range(layers[-s - 1]))))
            enc_channels, dec_channels = channels[s], channels[-s - 2]
        final_in = channels[self.num_stages - 1] if self.cls_mode else channels[-1]
        self.final = SpconvConv(final_in, num_classes, 1, bias=True) if num_classes > 0 else nn.Identity()
        self.out_channels = num_classes if num_classes > 0 else final_in
        self._init_weights()

    def _init_weights(self) -> None:
        super()._init_weights()
        # (upstream zero-initialises the modulation whatever norm_adaptive says, and so fails
        # without one; there is nothing to initialise then)
        if self.zero_init and self.norm_adaptive:
            for module in self.modules():
                if isinstance(module, PDBatchNorm):
                    nn.init.zeros_(module.modulation[-1].weight)
                    nn.init.zeros_(module.modulation[-1].bias)

    def _prompt(self, input_dict: dict) -> tuple[str | None, torch.Tensor | None]:
        condition = None
        if self.norm_decouple:
            given = input_dict.get("condition")
            names = [given] if isinstance(given, str) else list(given) if isinstance(given, (list, tuple)) else None
            if not names or not all(isinstance(n, str) for n in names):
                raise ConfigError(f"{self.owner} needs the batch's 'condition' (a data set name, one of "
                                  f"{list(self.conditions)}), e.g. Update(keys_dict=dict(condition=...)) and "
                                  f"'condition' in Collect's keys; got {given!r}")
            if len(set(names)) > 1:
                raise ConfigError(f"{self.owner}: one condition per batch (upstream's rule), got {sorted(set(names))}")
            condition = names[0]
            if condition not in self.conditions:
                raise ConfigError(f"{self.owner}: condition {condition!r} is not in conditions={list(self.conditions)}")
        context = None
        if self.norm_adaptive:
            context = input_dict.get("context")
            if not isinstance(context, torch.Tensor) or context.numel() != self.context_channels:
                raise ConfigError(f"{self.owner}: norm_adaptive=True needs the batch's 'context', one vector of "
                                  f"context_channels={self.context_channels} (the prompt embedding of upstream's "
                                  f"Point Prompt Training), got {getattr(context, 'shape', context)!r}; "
                                  "or set norm_adaptive=False")
            context = context.reshape(1, -1).to(self.conv_input.conv.weight.dtype)
        return condition, context

    def forward(self, input_dict: dict) -> torch.Tensor:
        condition, context = self._prompt(input_dict)
        levels = unet_levels(input_dict, self.owner, self.num_stages + 1, self.conv_input.conv.weight.dtype,
                             extent_margin=self.extent_margin)
        x = self.conv_input(levels.feat, levels.stem, condition, context)
        skips = [x]
        for s in range(self.num_stages):
            x = self.down[s](x, levels.down[s], condition, context)
            x = self.enc[s](x, levels.subm[s + 1], condition, context)
            skips.append(x)
        x = skips.pop(-1)
        if not self.cls_mode:
            for s in reversed(range(self.num_stages)):
                x = self.up[s](x, levels.down[s].transposed(), condition, context)
                x = torch.cat([x, skips.pop(-1)], dim=1)
                x = self.dec[s](x, levels.subm[s], condition, context)
        x = self.final(x)
        if self.cls_mode:
            return scatter_mean(x, levels.level_batch(self.num_stages), len(input_dict["offset"]))
        return x.index_select(0, levels.inverse)
