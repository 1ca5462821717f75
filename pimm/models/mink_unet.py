"""Upstream's MinkowskiEngine U-Nets -- ``MinkUNet14`` ... ``MinkUNet101``
(after chrischoy/SpatioTemporalSegmentation) -- on pimm's sparse convolution.

Five levels (tensor strides 1, 2, 4, 8, 16): a 5^3 stem, four stride-2
convolutions (kernel 2) each followed by a stage of residual blocks, four
transposed convolutions back up, each concatenated with the encoder's output
at that stride and followed by a stage of blocks, and a 1x1 convolution with
bias to ``out_channels``. MinkowskiEngine's stride-1 convolutions keep the
input's coordinates, so they are submanifold convolutions; its transposed
ones write on the coordinates the encoder made at that stride. Module names
(``conv0p1s1.kernel``, ``bn0.bn.weight``, ``block1.0.downsample.0.kernel``...)
and the kernel layout (:mod:`pimm.models.sparse_layouts`) are
MinkowskiEngine's, so upstream checkpoints load strictly. MinkowskiEngine
cannot be installed here: the convolutions are checked against a direct
dense convolution with its kernel offsets and strides (tests), not against
MinkowskiEngine itself.

Points sharing a voxel are averaged and all get the voxel's output, as
upstream's ``TensorField`` (unweighted average) and ``slice`` do.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import Int, Size
from pimm.utils.errors import ConfigError

from .sparse_layouts import MinkowskiConv, SparseSequential
from .sparse_maps import KernelMap
from .sparse_unet_levels import unet_levels

__all__ = ["BasicBlock", "Bottleneck", "MinkUNetBase", "MinkowskiBatchNorm"]


class MinkowskiBatchNorm(nn.Module):
    """MinkowskiEngine's BatchNorm: a ``BatchNorm1d`` held as ``bn``."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1):
        super().__init__()
        self.bn = nn.BatchNorm1d(num_features, eps=eps, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(x)


class BasicBlock(nn.Module):
    """3^3 conv-BN-ReLU-3^3 conv-BN (+ input, through ``downsample`` when
    given) -ReLU."""

    expansion = 1
    takes_kmap = True

    def __init__(self, inplanes: int, planes: int, downsample: nn.Module | None = None, bn_momentum: float = 0.1):
        super().__init__()
        self.conv1 = MinkowskiConv(inplanes, planes, 3)
        self.norm1 = MinkowskiBatchNorm(planes, momentum=bn_momentum)
        self.conv2 = MinkowskiConv(planes, planes, 3)
        self.norm2 = MinkowskiBatchNorm(planes, momentum=bn_momentum)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x, kmap)))
        out = self.norm2(self.conv2(out, kmap))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    """1x1 (planes) -> 3^3 -> 1x1 (4 * planes), each with BN (ReLU between),
    plus the input (through ``downsample`` when given), ReLU."""

    expansion = 4
    takes_kmap = True

    def __init__(self, inplanes: int, planes: int, downsample: nn.Module | None = None, bn_momentum: float = 0.1):
        super().__init__()
        self.conv1 = MinkowskiConv(inplanes, planes, 1)
        self.norm1 = MinkowskiBatchNorm(planes, momentum=bn_momentum)
        self.conv2 = MinkowskiConv(planes, planes, 3)
        self.norm2 = MinkowskiBatchNorm(planes, momentum=bn_momentum)
        self.conv3 = MinkowskiConv(planes, planes * self.expansion, 1)
        self.norm3 = MinkowskiBatchNorm(planes * self.expansion, momentum=bn_momentum)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.relu(self.norm2(self.conv2(out, kmap)))
        out = self.norm3(self.conv3(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class MinkUNetBase(nn.Module):
    """The network; each registered variant sets ``BLOCK``, ``LAYERS`` (blocks
    per stage, encoder 1-4 then decoder 5-8) and ``PLANES`` (their widths).

    ``forward(input_dict)`` (``grid_coord``, ``feat``, ``offset``) returns
    (N, ``out_channels``), one row per point.
    """

    BLOCK: type | None = None
    LAYERS: Sequence[int] = (2, 2, 2, 2, 2, 2, 2, 2)
    PLANES: Sequence[int] = (32, 64, 128, 256, 256, 128, 96, 96)
    INIT_DIM = 32

    domains = dict(in_channels=Size, out_channels=Size, dimension=Int(3, 3))

    @classmethod
    def output_classes(cls, args: dict) -> int | None:
        """Per-point class logits (what ``DefaultSegmentor`` without ``num_classes`` reads)."""
        return args.get("out_channels")

    def __init__(self, in_channels: int, out_channels: int, dimension: int = 3):
        super().__init__()
        name = type(self).__name__
        if self.BLOCK is None:
            raise ConfigError(f"{name} is an abstract base: use one of the registered MinkUNet variants")
        if dimension != 3:
            raise ConfigError(f"{name}: dimension={dimension} is not supported: pimm's sparse convolution is 3-D")
        self.D = dimension
        self.in_channels, self.out_channels = in_channels, out_channels
        block, planes, layers = self.BLOCK, self.PLANES, self.LAYERS
        self.inplanes = self.INIT_DIM
        self.conv0p1s1 = MinkowskiConv(in_channels, self.inplanes, 5)
        self.bn0 = MinkowskiBatchNorm(self.inplanes)
        for i, stage in enumerate(("1p1s2", "2p2s2", "3p4s2", "4p8s2")):
            setattr(self, f"conv{stage}", MinkowskiConv(self.inplanes, self.inplanes, 2))
            setattr(self, f"bn{i + 1}", MinkowskiBatchNorm(self.inplanes))
            setattr(self, f"block{i + 1}", self._make_layer(block, planes[i], layers[i]))
        skips = (planes[2] * block.expansion, planes[1] * block.expansion, planes[0] * block.expansion, self.INIT_DIM)
        for i, stage in enumerate(("4p16s2", "5p8s2", "6p4s2", "7p2s2")):
            setattr(self, f"convtr{stage}", MinkowskiConv(self.inplanes, planes[4 + i], 2, transposed=True))
            setattr(self, f"bntr{i + 4}", MinkowskiBatchNorm(planes[4 + i]))
            self.inplanes = planes[4 + i] + skips[i]
            setattr(self, f"block{i + 5}", self._make_layer(block, planes[4 + i], layers[4 + i]))
        self.final = MinkowskiConv(planes[7] * block.expansion, out_channels, 1, bias=True)
        self.relu = nn.ReLU(inplace=True)
        self.weight_initialization()

    def weight_initialization(self) -> None:
        """Upstream's: Kaiming-normal (fan_out, ReLU; MinkowskiEngine's fan
        of a (K, C_in, C_out) kernel is K * C_out, of a (C_in, C_out) one
        C_in) for the convolutions that are not transposed; BatchNorm 1 / 0."""
        for module in self.modules():
            if isinstance(module, MinkowskiConv) and not module.transposed:
                kernel = module.kernel
                fan = kernel.shape[0] if kernel.dim() == 2 else kernel.shape[0] * kernel.shape[2]
                nn.init.normal_(kernel, 0.0, 2**0.5 / fan**0.5)
            if isinstance(module, MinkowskiBatchNorm):
                nn.init.ones_(module.bn.weight)
                nn.init.zeros_(module.bn.bias)

    def _make_layer(self, block, planes: int, blocks: int, bn_momentum: float = 0.1) -> SparseSequential:
        downsample = None
        if self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(MinkowskiConv(self.inplanes, planes * block.expansion, 1),
                                       MinkowskiBatchNorm(planes * block.expansion))
        layers = [block(self.inplanes, planes, downsample=downsample, bn_momentum=bn_momentum)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes, bn_momentum=bn_momentum) for _ in range(1, blocks)]
        return SparseSequential(*layers)

    def forward(self, input_dict: dict) -> torch.Tensor:
        levels = unet_levels(input_dict, type(self).__name__, 5, self.conv0p1s1.kernel.dtype)
        subm, down = levels.subm, levels.down
        out_p1 = self.relu(self.bn0(self.conv0p1s1(levels.feat, levels.stem)))
        out = self.block1(self.relu(self.bn1(self.conv1p1s2(out_p1, down[0]))), subm[1])
        out_b1p2 = out
        out_b2p4 = self.block2(self.relu(self.bn2(self.conv2p2s2(out_b1p2, down[1]))), subm[2])
        out_b3p8 = self.block3(self.relu(self.bn3(self.conv3p4s2(out_b2p4, down[2]))), subm[3])
        out = self.block4(self.relu(self.bn4(self.conv4p8s2(out_b3p8, down[3]))), subm[4])
        for level, (convtr, bntr, block, skip) in zip((3, 2, 1, 0), (
                (self.convtr4p16s2, self.bntr4, self.block5, out_b3p8),
                (self.convtr5p8s2, self.bntr5, self.block6, out_b2p4),
                (self.convtr6p4s2, self.bntr6, self.block7, out_b1p2),
                (self.convtr7p2s2, self.bntr7, self.block8, out_p1))):
            out = self.relu(bntr(convtr(out, down[level].transposed())))
            out = block(torch.cat([out, skip], dim=1), subm[level])
        return self.final(out).index_select(0, levels.inverse)


def _variant(name: str, base: type, **attrs) -> type:
    shown = ", ".join(f"{k}={getattr(v, '__name__', v)}" for k, v in attrs.items())
    doc = f"Upstream's ``{name}``: ``{base.__name__}`` with ``{shown}``."
    return MODELS.register_module()(type(name, (base,), {"__doc__": doc, "__module__": __name__, **attrs}))


MinkUNet14 = _variant("MinkUNet14", MinkUNetBase, BLOCK=BasicBlock, LAYERS=(1, 1, 1, 1, 1, 1, 1, 1))
MinkUNet18 = _variant("MinkUNet18", MinkUNetBase, BLOCK=BasicBlock, LAYERS=(2, 2, 2, 2, 2, 2, 2, 2))
MinkUNet34 = _variant("MinkUNet34", MinkUNetBase, BLOCK=BasicBlock, LAYERS=(2, 3, 4, 6, 2, 2, 2, 2))
MinkUNet50 = _variant("MinkUNet50", MinkUNetBase, BLOCK=Bottleneck, LAYERS=(2, 3, 4, 6, 2, 2, 2, 2))
MinkUNet101 = _variant("MinkUNet101", MinkUNetBase, BLOCK=Bottleneck, LAYERS=(2, 3, 4, 23, 2, 2, 2, 2))
MinkUNet14A = _variant("MinkUNet14A", MinkUNet14, PLANES=(32, 64, 128, 256, 128, 128, 96, 96))
MinkUNet14B = _variant("MinkUNet14B", MinkUNet14, PLANES=(32, 64, 128, 256, 128, 128, 128, 128))
MinkUNet14C = _variant("MinkUNet14C", MinkUNet14, PLANES=(32, 64, 128, 256, 192, 192, 128, 128))
MinkUNet14D = _variant("MinkUNet14D", MinkUNet14, PLANES=(32, 64, 128, 256, 384, 384, 384, 384))
MinkUNet18A = _variant("MinkUNet18A", MinkUNet18, PLANES=(32, 64, 128, 256, 128, 128, 96, 96))
MinkUNet18B = _variant("MinkUNet18B", MinkUNet18, PLANES=(32, 64, 128, 256, 128, 128, 128, 128))
MinkUNet18D = _variant("MinkUNet18D", MinkUNet18, PLANES=(32, 64, 128, 256, 384, 384, 384, 384))
MinkUNet34A = _variant("MinkUNet34A", MinkUNet34, PLANES=(32, 64, 128, 256, 256, 128, 96, 96))
MinkUNet34B = _variant("MinkUNet34B", MinkUNet34, PLANES=(32, 64, 128, 256, 256, 128, 64, 32))
MinkUNet34C = _variant("MinkUNet34C", MinkUNet34, PLANES=(32, 64, 128, 256, 256, 128, 96, 96))
