"""SparseUNet as it was before the fast kernels (commit 6be09b4), for
``bench/sparse_unet.py``.

The benchmark compares the new implementation with *today's* code on the
same batches, so this file keeps the previous kernel maps (13 searchsorted
neighbour queries per level, a sort for the stride-2 maps) and the previous
convolution (autograd through index_select, per-offset matmuls, cat and
index_add) verbatim. The network around them is ``pimm.models.SparseUNet``'s
(the same modules and parameter names, so ``load_state_dict`` moves weights
between the two), with the block forwards of that commit. Benchmark
material only: not registered in MODELS, not part of the package.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pimm.models.point_ops import hash_keys, scatter_mean, voxelize
from pimm.models.sparse_conv import SparseConv
from pimm.models.sparse_unet import ResBlock, SparseUNet, _ConvBNReLU

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


class _TodaySparseConv(SparseConv):
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


class _TodayConvBNReLU(_ConvBNReLU):
    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x, kmap)))


class _TodayResBlock(ResBlock):
    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x, kmap)))
        y = self.bn2(self.conv2(y, kmap))
        return torch.relu(y + x)


class ReferenceSparseUNet(SparseUNet):
    """Today's SparseUNet; same arguments and defaults as ``SparseUNet``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        today = {SparseConv: _TodaySparseConv, _ConvBNReLU: _TodayConvBNReLU, ResBlock: _TodayResBlock}
        for module in self.modules():
            if type(module) in today:
                module.__class__ = today[type(module)]

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
