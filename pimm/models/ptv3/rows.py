"""Row gathers whose backward passes are gathers too.

Autograd's backward of ``x.index_select(0, index)`` is a zero-filled
``index_add`` into ``x``'s shape, which on a CPU measured ~15x the forward
gather (17,860 x 32 floats: 2.1 ms against 0.13 ms). PT-v3 moves rows
through fixed maps -- into the attention's patch slots and back, children to
parents and back -- whose inverses are known when the map is built, so the
backward passes here are gathers (or a sorted ``embedding_bag`` sum) on
those inverses. The values and gradients are the ones ``index_select``
gives (sums of the same terms).

* :class:`PatchRows`: points <-> padded patch slots of the attention;
* :class:`Groups`: children grouped by parent, for pooling's per-parent max
  and un-pooling's parent-to-children copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["PatchRows", "Groups"]


class PatchRows:
    """The map between ``N`` points and ``S >= N`` patch slots: ``gather``
    (S,) is the point read into every slot, ``scatter`` (N,) every point's own
    slot (``gather[scatter] = arange(N)``); the other slots copy a point
    again (padding)."""

    def __init__(self, gather: torch.Tensor, scatter: torch.Tensor):
        self.gather, self.scatter = gather, scatter
        n, s = scatter.numel(), gather.numel()
        device = gather.device
        # owner[slot]: the point whose own slot it is, or n (a zero row) for padding slots.
        self.owner = torch.full((s,), n, dtype=torch.long, device=device)
        self.owner.index_copy_(0, scatter, torch.arange(n, device=device))
        self.extra = torch.nonzero(self.owner == n).squeeze(1)  # padding slots
        self.extra_point = gather.index_select(0, self.extra)

    def to_slots(self, x: torch.Tensor) -> torch.Tensor:
        """(N, C) -> (S, C): ``x.index_select(0, gather)``."""
        return _ToSlots.apply(x, self)

    def from_slots(self, y: torch.Tensor) -> torch.Tensor:
        """(S, C) -> (N, C): every point's row from its own slot."""
        return _FromSlots.apply(y, self)


class _ToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows: PatchRows):
        ctx.rows = rows
        return x.index_select(0, rows.gather)

    @staticmethod
    def backward(ctx, grad):
        rows: PatchRows = ctx.rows
        grad = grad.contiguous()
        out = grad.index_select(0, rows.scatter)
        if rows.extra.numel():
            out.index_add_(0, rows.extra_point, grad.index_select(0, rows.extra))
        return out, None


class _FromSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, rows: PatchRows):
        ctx.rows = rows
        return y.index_select(0, rows.scatter)

    @staticmethod
    def backward(ctx, grad):
        rows: PatchRows = ctx.rows
        padded = torch.cat([grad, grad.new_zeros((1,) + grad.shape[1:])])
        return padded.index_select(0, rows.owner), None


class Groups:
    """``N`` children in ``size`` non-empty groups (``index`` (N,): each
    child's group), sorted once: ``order`` lists the children group by group
    (stable), ``lengths`` the group sizes."""

    def __init__(self, index: torch.Tensor, size: int):
        with torch.no_grad():
            self.index, self.size = index, size
            self.order = torch.argsort(index, stable=True)
            self.lengths = torch.bincount(index, minlength=size)
            self.starts = torch.cumsum(self.lengths, 0) - self.lengths
            self.rank = torch.empty_like(self.order).scatter_(
                0, self.order, torch.arange(index.numel(), device=index.device))

    def reduce(self, src: torch.Tensor, reduce: str = "max") -> torch.Tensor:
        """(N, C) -> (size, C) per-group ``reduce`` (``segment_reduce`` on the
        sorted rows; for max/min the gradient goes to the rows equal to the
        result, split evenly among ties, as ``segment_reduce``'s own)."""
        if reduce in ("max", "min"):
            return _GroupExtremum.apply(src, self, reduce)
        return torch.segment_reduce(_Permute.apply(src, self.order, self.rank), reduce, lengths=self.lengths,
                                    unsafe=True)

    def spread(self, feat: torch.Tensor) -> torch.Tensor:
        """(size, C) -> (N, C): every child gets its group's row
        (``feat.index_select(0, index)``; backward sums each group's rows)."""
        return _Spread.apply(feat, self)


class _Permute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.contiguous().index_select(0, inverse), None, None


class _GroupExtremum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src, groups: Groups, reduce: str):
        out = torch.segment_reduce(src.index_select(0, groups.order), reduce, lengths=groups.lengths, unsafe=True)
        ctx.groups = groups
        ctx.save_for_backward(src, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        src, out = ctx.saved_tensors
        groups: Groups = ctx.groups
        # segment_reduce's own backward, measured (torch 2.13): every row equal to the result (or NaN)
        # gets the gradient, divided by their number where the gradient is positive; other rows get 0.
        # In the rows' own order, with a float mask (a bool one measured ~5x slower on a CPU). On the
        # CPU a cheap check each skips the tie count and the NaN and infinity rules when they change
        # nothing (elsewhere the read-back would stall the device): the general form cost ~10x the
        # forward on LArTPC levels.
        on_cpu = src.device.type == "cpu"
        hit = torch.eq(src, out.index_select(0, groups.index), out=torch.empty_like(src))  # 1.0 or 0.0
        if not on_cpu or bool(torch.isnan(out.sum())):  # a NaN result: its NaN rows are hit
            hit = torch.where(torch.isnan(src), 1.0, hit)
        share = grad
        if not on_cpu or int(hit.sum(dtype=torch.float64)) != out.numel():  # a result hit twice: ties
            ties = F.embedding_bag(groups.order, hit.to(grad.dtype), groups.starts, mode="sum")
            share = torch.where(grad > 0, grad / ties.clamp_min(1), grad)
        share = share.index_select(0, groups.index)
        if on_cpu and bool(torch.isfinite(grad.sum())):  # a finite gradient times 0.0 is 0
            return share.mul_(hit), None, None
        return torch.where(hit != 0, share, 0.0), None, None


class _Spread(torch.autograd.Function):
    @staticmethod
    def forward(ctx, feat, groups: Groups):
        ctx.groups = groups
        return feat.index_select(0, groups.index)

    @staticmethod
    def backward(ctx, grad):
        groups: Groups = ctx.groups
        return F.embedding_bag(groups.order, grad.contiguous(), groups.starts, mode="sum"), None
