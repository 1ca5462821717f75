"""Volt's tokenizer geometry: the kernel map of spconv's strided
``SparseConv3d`` (padding 0) from input voxels to patch tokens, built on
pimm's kernel maps, and the tokens of each event.

spconv's strided convolution puts an output voxel ``o`` (per axis) wherever
some input ``p`` satisfies ``o * stride <= p < o * stride + kernel_size``,
inside the output extent ``(shape - kernel_size) // stride + 1`` (``shape``:
the input's ``spatial_shape``, the batch's largest grid coordinate + 96 in
Volt); the pair uses kernel entry ``p - o * stride``. With ``kernel_size ==
stride`` (Volt's default, 5) every input has exactly one output, its patch
``p // stride``. spconv's inverse convolution (Volt-v1m2's decoder) runs the
same pairs back, onto the input voxels. The attention then runs over each
event's tokens (:func:`event_sizes`).
"""

from __future__ import annotations

import itertools

import torch

from ..point_ops import voxelize
from ..sparse_maps import KernelMap

__all__ = ["SPCONV_PAD", "strided_kernel_map", "event_sizes"]

# What upstream's ``Point.sparsify`` (and Volt-v1m1) add to the largest grid
# coordinate for spconv's spatial shape.
SPCONV_PAD = 96


def strided_kernel_map(grid: torch.Tensor, batch: torch.Tensor, kernel_size: int,
                       stride: int) -> tuple[KernelMap, torch.Tensor, torch.Tensor]:
    """Map of spconv's ``SparseConv3d(kernel_size, stride, padding=0)`` over the
    points ``grid`` (N, 3) non-negative, event ``batch`` (N,).

    Returns ``(kmap, token_grid (T, 3), token_batch (T,))``, tokens sorted
    by (event, x, y, z); kernel entry ``(i, j, l)`` (C order) pairs input
    ``o * stride + (i, j, l)`` with output ``o``, as spconv's weight
    ``[:, i, j, l, :]``. Points sharing a voxel each feed their tokens.
    """
    device = grid.device
    extent = ((grid.max(0).values + SPCONV_PAD - kernel_size) // stride + 1).clamp_min(1) if grid.numel() else None
    reach = -(-kernel_size // stride)  # outputs per axis an input can reach
    # Per axis and shift t: the candidate output floor(p / s) - t and the kernel entry it uses.
    home = torch.div(grid, stride, rounding_mode="floor")
    rows, outs, entries = [], [], []
    for shift in itertools.product(range(reach), repeat=3):
        out = home - torch.tensor(shift, device=device)
        entry = grid - out * stride
        ok = (out >= 0).all(1) & (entry < kernel_size).all(1)
        if extent is not None:
            ok &= (out < extent).all(1)
        index = torch.nonzero(ok).squeeze(1)
        rows.append(index)
        outs.append(out.index_select(0, index))
        entries.append(entry.index_select(0, index))
    rows, outs, entries = torch.cat(rows), torch.cat(outs), torch.cat(entries)
    token_grid, token_batch, out_idx = voxelize(outs, batch.index_select(0, rows))
    offset = (entries[:, 0] * kernel_size + entries[:, 1]) * kernel_size + entries[:, 2]
    kmap = KernelMap.from_pairs(rows, out_idx, offset, kernel_size**3, grid.shape[0], token_grid.shape[0])
    return kmap, token_grid, token_batch


@torch.no_grad()
def event_sizes(token_batch: torch.Tensor) -> list[int]:
    """Tokens per event (``token_batch`` sorted; events without tokens left
    out): one attention sequence each, as upstream's variable-length call."""
    return torch.unique_consecutive(token_batch, return_counts=True)[1].tolist()
