"""SparseUNet as it was before the fast kernels (commit 6be09b4), frozen for
``bench/sparse_unet.py``.

The benchmark must compare the new implementation with *today's* code on the
same batches, so this file keeps the previous kernel maps (13 searchsorted
neighbour queries per level) and the previous convolution (autograd through
index_select / per-offset matmuls / cat / index_add). Parameter names match
``pimm.models.SparseUNet`` exactly, so ``load_state_dict`` moves weights
between the two. Only helpers that did not change are imported from pimm.
Not registered in MODELS and not part of the package: benchmark material only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from pimm.models.point_ops import event_grid_coord, event_min, hash_keys, offset2batch, scatter_mean, voxelize

__all__ = ["ReferenceSparseUNet"]


@dataclass
class KernelMap:
    """Sparse-convolution pairs grouped by kernel offset (see module docstring)."""

    in_idx: torch.Tensor
    out_idx: torch.Tensor
    counts: list[int]  # pairs per kernel offset, in order
    num_out: int
    # Offset applied as a dense identity map (submanifold centre; its pairs are
    # not listed), or -1.
    identity: int = -1

    def transposed(self, num_in: int) -> "KernelMap":
        """The map of the transposed convolution (outputs become inputs)."""
        return KernelMap(self.out_idx, self.in_idx, self.counts, num_in, self.identity)


def _neighbor_offsets(kernel_size: int, device: torch.device) -> torch.Tensor:
    r = torch.arange(kernel_size, device=device) - (kernel_size - 1) // 2
    return torch.cartesian_prod(r, r, r)  # (K,3), centre at K // 2 for odd sizes


def neighbor_pairs(
    grid: torch.Tensor, batch: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each offset ``d`` the pairs (i, j) with ``grid[j] == grid[i] + d`` in the
    same event, found by binary search in the sorted voxel hash table.

    ``grid`` must hold distinct voxels. Returns ``(i, j, offset_id)`` sorted by
    offset id.
    """
    reach = int(offsets.abs().max()) if offsets.numel() else 0
    shifted = grid + reach  # keeps every neighbour of a voxel non-negative
    span = int(shifted.max()) + reach + 1 if grid.numel() else 1
    keys = hash_keys(shifted, batch, span)
    sorted_keys, order = torch.sort(keys)
    m, k = grid.shape[0], offsets.shape[0]
    query = hash_keys(
        (shifted[None, :, :] + offsets[:, None, :]).reshape(-1, 3), batch.repeat(k), span
    )
    pos = torch.searchsorted(sorted_keys, query).clamp_max(max(m - 1, 0))
    found = sorted_keys[pos] == query if m else torch.zeros_like(query, dtype=torch.bool)
    flat = torch.nonzero(found).squeeze(1)  # row-major over (offset, voxel): grouped by offset
    return flat % m, order[pos[flat]], flat // m


def submanifold_kernel_map(grid: torch.Tensor, batch: torch.Tensor, kernel_size: int = 3) -> KernelMap:
    """Kernel map of a submanifold convolution: outputs sit on the input voxels and
    each gathers its occupied neighbours within a ``kernel_size``^3 cube."""
    offsets = _neighbor_offsets(kernel_size, grid.device)
    kvol = len(offsets)
    centre = kvol // 2  # the identity: a dense matmul, no pairs needed
    # Offsets k and kvol-1-k are opposite (d, -d), and j = i + d <=> i = j - d:
    # searching the first half of the kernel gives the second half for free.
    i, j, oid = neighbor_pairs(grid, batch, offsets[:centre])
    # Flipping reverses the group order, so mirrored offsets stay sorted.
    out_idx = torch.cat([i, j.flip(0)])
    in_idx = torch.cat([j, i.flip(0)])
    oid = torch.cat([oid, kvol - 1 - oid.flip(0)])
    counts = torch.bincount(oid, minlength=kvol).tolist()
    return KernelMap(in_idx, out_idx, counts, grid.shape[0], identity=centre)


def downsample_kernel_map(
    grid: torch.Tensor, batch: torch.Tensor, stride: int = 2
) -> tuple[KernelMap, torch.Tensor, torch.Tensor]:
    """Kernel map of a stride-``stride`` convolution with kernel = stride (grid pooling
    with a separate weight per child position).

    Returns ``(kmap, coarse_grid, coarse_batch)``; every fine voxel feeds exactly
    one coarse voxel, so the transposed map is a learned un-pooling.
    """
    coarse, cbatch, parent = voxelize(torch.div(grid, stride, rounding_mode="floor"), batch)
    local = grid - coarse[parent] * stride
    oid = (local[:, 0] * stride + local[:, 1]) * stride + local[:, 2]
    oid_sorted, order = torch.sort(oid, stable=True)
    counts = torch.bincount(oid_sorted, minlength=stride**3).tolist()
    return KernelMap(order, parent[order], counts, coarse.shape[0]), coarse, cbatch



class SparseConv(nn.Module):
    """Sparse convolution with one (C_in, C_out) weight per kernel offset.

    ``out[o] = sum over pairs (i, o) of offset k of x[i] @ W[k]``; the
    identity offset of a submanifold map is a dense matmul.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_volume: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(kernel_volume, in_channels, out_channels))
        # Kaiming-uniform over the full kernel fan-in; BatchNorm follows every
        # convolution, so the sparse (smaller) effective fan-in does not matter.
        bound = math.sqrt(6.0 / (kernel_volume * in_channels))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        # split/unbind rather than slicing: their backward is one concatenation,
        # where each slice's backward would allocate a full-size zero gradient.
        weights = self.weight.unbind(0)
        if kmap.identity >= 0:
            out = x @ weights[kmap.identity]
        else:
            out = x.new_zeros(kmap.num_out, self.weight.shape[2])
        if kmap.in_idx.numel() == 0:
            return out
        # One gather for all offsets, one small matmul per offset, one scatter.
        groups = x.index_select(0, kmap.in_idx).split(kmap.counts)
        msgs = torch.cat([g @ w for g, w in zip(groups, weights) if g.shape[0]])
        return out.index_add(0, kmap.out_idx, msgs)


class _ConvBNReLU(nn.Module):
    def __init__(self, cin: int, cout: int, kvol: int):
        super().__init__()
        self.conv = SparseConv(cin, cout, kvol)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x, kmap)))


class ResBlock(nn.Module):
    """Basic residual block: conv-BN-ReLU-conv-BN (+ skip) -ReLU, submanifold."""

    def __init__(self, channels: int, kvol: int):
        super().__init__()
        self.conv1 = SparseConv(channels, channels, kvol)
        self.bn1 = nn.BatchNorm1d(channels)
        self.conv2 = SparseConv(channels, channels, kvol)
        self.bn2 = nn.BatchNorm1d(channels)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x, kmap)))
        y = self.bn2(self.conv2(y, kmap))
        return torch.relu(y + x)


class ReferenceSparseUNet(nn.Module):
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
    parameters, ~0.25 s per 4-event LArTPC training step on one CPU core).

    ``forward(input_dict)`` returns (N, ``out_channels``) point features.
    """

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
            raise ValueError(
                f"SparseUNet: enc_blocks needs {levels} entries and dec_blocks {levels - 1} "
                f"(one per level of channels={tuple(channels)}), got {tuple(enc_blocks)} and {tuple(dec_blocks)}"
            )
        if kernel_size % 2 != 1 or kernel_size < 1:
            raise ValueError(f"SparseUNet: kernel_size must be odd, got {kernel_size}")
        if grid_size <= 0:
            raise ValueError(f"SparseUNet: grid_size must be > 0, got {grid_size}")
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
        x = scatter_mean(input_dict["feat"].float(), inverse, vgrid.shape[0])

        # Kernel maps of every level, built once and shared by all its blocks.
        subm, down = [], []
        g, b = vgrid, vbatch
        for i in range(len(self.enc)):
            subm.append(submanifold_kernel_map(g, b, self.kernel_size))
            if i < len(self.down):
                kmap, g, b = downsample_kernel_map(g, b, 2)
                down.append(kmap)

        x = self.stem(x, subm[0])
        skips = []
        for i, blocks in enumerate(self.enc):
            for blk in blocks:
                x = blk(x, subm[i])
            if i < len(self.down):
                skips.append(x)
                x = self.down[i](x, down[i])
        for i in reversed(range(len(self.up))):
            x = self.up[i](x, down[i].transposed(skips[i].shape[0]))
            x = self.fuse[i](torch.cat([x, skips[i]], dim=1))
            for blk in self.dec[i]:
                x = blk(x, subm[i])
        return x[inverse]
