"""SparseUNet: a submanifold sparse-convolution U-Net in plain PyTorch.

This is the architecture family that works best on LArTPC images (UResNet,
MinkUNet), rebuilt without MinkowskiEngine/spconv: the kernel maps of all
resolutions are built once per batch (:mod:`pimm.models.sparse_maps`) and the
convolutions run on them as gather -> batched matmuls -> fused sum
(:mod:`pimm.models.sparse_conv`), so it needs no compiled extension and is
fast on a CPU. Why this design, and measured speed, are in
``docs/models.md``.

Pipeline: points -> voxels (mean features) -> stem -> encoder levels (residual
submanifold 3^3 blocks, stride-2 convolution between levels) -> decoder
(stride-2 transposed convolution, concat skip, residual blocks) -> features of
the finest voxels copied back to their points.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from .point_ops import event_grid_coord, event_min, offset2batch, scatter_mean, voxelize
from .sparse_maps import KernelMap, kernel_map_pyramid
from .sparse_conv import SparseConv
from pimm.utils.domains import Int, Length, same_length, Seq, Size

__all__ = ["SparseConv", "SparseUNet"]


class _ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int, kvol: int):
        super().__init__()
        self.conv = SparseConv(cin, cout, kvol)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        return self.bn(self.conv(x, kmap)).relu_()  # in place: BatchNorm keeps its input, not its output


class ResBlock(nn.Module):
    """Basic residual block: conv-BN-ReLU-conv-BN (+ skip) -ReLU, submanifold."""

    def __init__(self, channels: int, kvol: int):
        super().__init__()
        self.conv1 = SparseConv(channels, channels, kvol)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = SparseConv(channels, channels, kvol)
        self.bn2 = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        y = self.bn1(self.conv1(x, kmap)).relu_()
        return self.bn2(self.conv2(y, kmap)).add_(x).relu_()


@MODELS.register_module()
class SparseUNet(nn.Module):
    """Submanifold sparse-convolution U-Net over voxelised points.

    Args:
        in_channels: width of ``feat``.
        grid_size: voxel edge in ``coord`` units (ignored when the batch holds
            ``grid_coord``). Points sharing a voxel are merged (mean feature)
            and get the same output feature.
        channels: width of each resolution level, finest first; level ``i`` has
            stride ``2**i``.
        enc_blocks: residual blocks per encoder level.
        dec_blocks: residual blocks per decoder level (levels 0..L-2).
        kernel_size: submanifold kernel edge (odd).

    The defaults are the configuration measured in ``docs/models.md`` (1.5 M
    parameters); ``bench/sparse_unet.py`` times it.

    ``forward(input_dict)`` returns (N, ``out_channels``) point features.
    """

    domains = dict(in_channels=Size, grid_size=Length, channels=Seq(Size, min_len=2), enc_blocks=Seq(Int(0, 64)),
                   dec_blocks=Seq(Int(0, 64)), kernel_size=Int(1, 15))
    domain_rules = (same_length('channels', 'enc_blocks', 'dec_blocks', offset=dict(dec_blocks=-1)),)

    def __init__(
        self,
        in_channels: int,
        grid_size: float = 1.0,
        channels: Sequence[int] = (16, 32, 48, 64, 96),
        enc_blocks: Sequence[int] = (1, 1, 1, 1, 1),
        dec_blocks: Sequence[int] = (1, 1, 1, 1),
        kernel_size: int = 3,
    ):
        super().__init__()
        levels = len(channels)
        if len(enc_blocks) != levels or len(dec_blocks) != levels - 1:
            raise ConfigError(
                f"SparseUNet: enc_blocks needs {levels} entries and dec_blocks {levels - 1} "
                f"(one per level of channels={tuple(channels)}), got {tuple(enc_blocks)} and {tuple(dec_blocks)}"
            )
        if kernel_size % 2 != 1 or kernel_size < 1:
            raise ConfigError(f"SparseUNet: kernel_size must be odd, got {kernel_size}")
        if grid_size <= 0:
            raise ConfigError(f"SparseUNet: grid_size must be > 0, got {grid_size}")
        self.grid_size = float(grid_size)
        self.kernel_size = kernel_size
        self.out_channels = channels[0]
        kvol = kernel_size**3

        self.stem = _ConvBNReLU(in_channels, channels[0], kvol)
        self.enc = nn.ModuleList(
            nn.ModuleList(ResBlock(channels[i], kvol) for _ in range(enc_blocks[i])) for i in range(levels)
        )
        self.down = nn.ModuleList(_ConvBNReLU(channels[i], channels[i + 1], 8) for i in range(levels - 1))
        self.up = nn.ModuleList(_ConvBNReLU(channels[i + 1], channels[i], 8) for i in range(levels - 1))
        # After concatenating the skip, a 1x1 projection back to the level width.
        self.fuse = nn.ModuleList(
            nn.Sequential(nn.Linear(2 * channels[i], channels[i], bias=False), nn.BatchNorm1d(channels[i]), nn.ReLU())
            for i in range(levels - 1)
        )
        self.dec = nn.ModuleList(
            nn.ModuleList(ResBlock(channels[i], kvol) for _ in range(dec_blocks[i])) for i in range(levels - 1)
        )

    def grid_coord(self, input_dict: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(grid (N,3) long >= 0, batch (N,)) of the points of ``input_dict``."""
        coord = input_dict["coord"]
        batch = offset2batch(input_dict["offset"].to(coord.device))
        if batch.shape[0] != coord.shape[0]:
            raise ValueError(f"offset[-1]={batch.shape[0]} does not match {coord.shape[0]} points")
        grid = input_dict.get("grid_coord")
        if grid is None:
            grid = event_grid_coord(coord, batch, self.grid_size)
        else:
            # Voxel hashing needs non-negative coordinates; shifting each event by
            # its own minimum keeps events independent of their batch-mates.
            grid = grid.long()
            grid = grid - event_min(grid, batch)
        return grid, batch

    def forward(self, input_dict: dict) -> torch.Tensor:
        grid, batch = self.grid_coord(input_dict)
        vgrid, vbatch, inverse = voxelize(grid, batch)
        x = scatter_mean(input_dict["feat"].to(self.stem.conv.weight.dtype), inverse, vgrid.shape[0])

        # Kernel maps of every level, built once and shared by all its blocks.
        subm, down = kernel_map_pyramid(vgrid, vbatch, len(self.enc), self.kernel_size)

        x = self.stem(x, subm[0])
        skips = []
        for i, blocks in enumerate(self.enc):
            for blk in blocks:
                x = blk(x, subm[i])
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x, down[i])
        for i in reversed(range(len(self.up))):
            x = self.up[i](x, down[i].transposed())
            x = self.fuse[i](torch.cat([x, skips[i]], dim=1))
            for blk in self.dec[i]:
                x = blk(x, subm[i])
        return x.index_select(0, inverse)
