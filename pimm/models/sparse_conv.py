"""Sparse convolution over a kernel map, as one autograd node.

``out[o] = sum over pairs (i, o) of offset k of x[i] @ W[k]`` (plus
``x @ W[centre]`` for the identity offset of a submanifold map).

Each call does: one ``index_select`` of the pair rows, one matmul per kernel
offset on its contiguous block of pairs, and one CSR sparse-dense product that
sums the messages into their outputs (:meth:`KernelMap.scatter_out`). The
backward pass is written out by hand (:class:`_SparseConvFunction`) and is
again gather -> per-offset matmuls -> CSR scatter, instead of what autograd
derives from the forward: ~80 small nodes per convolution (a matmul backward
per offset, split/cat, an ``index_add`` whose backward is a zero-filled
scatter), which cost more than the arithmetic on this data (3-4 neighbours
per voxel, 16-96 channels). The scatter matrices belong to the kernel map,
so they are built once per resolution and batch and reused by every layer
and by both passes.

Why not a library: spconv/torchsparse/MinkowskiEngine need a compiler or a
CUDA build; this is plain PyTorch and runs the same on CPU and GPU.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .sparse_maps import KernelMap

__all__ = ["SparseConv", "sparse_conv"]


class _SparseConvFunction(torch.autograd.Function):
    # Each bucket costs a handful of dispatched ops and the matmuls write
    # straight into one buffer: on LArTPC batches the convolutions are small
    # enough that the number of ops, not their arithmetic, sets much of the cost.
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        layout = kmap.layout
        cin, cout = weight.shape[1:]
        # Padding slots gather row 0: their messages are summed nowhere.
        x_slots = x.index_select(0, layout.gather_in)
        w_blocks = weight.index_select(0, layout.slot_offsets)  # one weight per block, in slot order
        msgs = x.new_empty(x_slots.shape[0], cout)
        for xb, wb, mb, (n, _) in zip(x_slots.split(layout.bucket_slots), w_blocks.split(layout.bucket_blocks),
                                      msgs.split(layout.bucket_slots), layout.buckets):
            torch.bmm(xb.view(n, -1, cin), wb, out=mb.view(n, -1, cout))
        out = layout.to_out(msgs) if msgs.shape[0] else x.new_zeros(kmap.num_out, cout)
        if kmap.identity >= 0:
            out.addmm_(x, weight[kmap.identity])
        # Only x and the weight are kept: the gathered rows (a copy of x
        # per pair, 3-4x its size) and the weight blocks are gathered again in
        # backward, which halves the memory a training step holds for a
        # fraction of a gather's time.
        ctx.save_for_backward(x, weight)
        ctx.kmap = kmap
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        kmap: KernelMap = ctx.kmap
        layout = kmap.layout
        cin, cout = weight.shape[1:]
        x_slots = x.index_select(0, layout.gather_in)
        w_blocks = weight.index_select(0, layout.slot_offsets)
        grad_out = grad_out.contiguous()
        # Zero gradient in the padding slots keeps them out of the weight
        # gradient (their x rows are row 0, not zero).
        g_slots = grad_out.index_select(0, layout.gather_out).index_fill_(0, layout.pads, 0.0)
        need_x = ctx.needs_input_grad[0]
        grad_blocks = torch.empty_like(w_blocks)
        back = torch.empty_like(x_slots) if need_x else None
        pieces = zip(x_slots.split(layout.bucket_slots), g_slots.split(layout.bucket_slots),
                     w_blocks.transpose(1, 2).split(layout.bucket_blocks), grad_blocks.split(layout.bucket_blocks),
                     back.split(layout.bucket_slots) if need_x else [None] * len(layout.buckets), layout.buckets)
        for xb, gb, wt, grad_b, bb, (n, _) in pieces:
            gb = gb.view(n, -1, cout)
            torch.bmm(xb.view(n, -1, cin).transpose(1, 2), gb, out=grad_b)
            if need_x:
                torch.bmm(gb, wt, out=bb.view(n, -1, cin))
        grad_w = torch.zeros_like(weight).index_copy_(0, layout.slot_offsets, grad_blocks)
        if kmap.identity >= 0:
            torch.mm(x.t(), grad_out, out=grad_w[kmap.identity])
        grad_x = None
        if need_x:
            grad_x = layout.to_in(back) if back.shape[0] else torch.zeros_like(x)
            if kmap.identity >= 0:
                grad_x.addmm_(grad_out, weight[kmap.identity].t())
        return grad_x, grad_w, None


def sparse_conv(x: torch.Tensor, weight: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
    """(num_in, C_in) features, (K, C_in, C_out) weight -> (num_out, C_out).

    Runs in the promoted dtype of ``x`` and ``weight`` with autocast off, so
    under AMP the convolution itself stays in full precision (its matmuls are
    small; the pair bookkeeping dominates).
    """
    if weight.shape[0] != kmap.kernel_volume:
        raise ValueError(f"weight has {weight.shape[0]} kernel offsets, the kernel map {kmap.kernel_volume}")
    if x.shape[0] != kmap.num_in:
        raise ValueError(f"x has {x.shape[0]} rows, the kernel map expects {kmap.num_in}")
    dtype = torch.promote_types(x.dtype, weight.dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return _SparseConvFunction.apply(x.to(dtype), weight.to(dtype), kmap)


class SparseConv(nn.Module):
    """Sparse convolution with one (C_in, C_out) weight per kernel offset."""

    def __init__(self, in_channels: int, out_channels: int, kernel_volume: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(kernel_volume, in_channels, out_channels))
        # Kaiming-uniform over the full kernel fan-in; BatchNorm follows every
        # convolution, so the sparse (smaller) effective fan-in does not matter.
        bound = math.sqrt(6.0 / (kernel_volume * in_channels))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, kmap: KernelMap) -> torch.Tensor:
        return sparse_conv(x, self.weight, kmap)
