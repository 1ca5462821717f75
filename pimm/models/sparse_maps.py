"""Kernel maps: the bookkeeping of a sparse convolution, built once per
resolution and batch and shared by every layer at that resolution.

A :class:`KernelMap` connects input rows to output rows through kernel
offsets. The convolution (:mod:`pimm.models.sparse_conv`) runs on its
:class:`PairLayout`: every (input, output, offset) pair gets a *slot*, the
slots of one offset form a block, and offsets with similar pair counts share
a bucket whose blocks all have the bucket's largest count, so one
``torch.bmm`` serves a bucket. Two :class:`RowSum` s add per-slot messages
into the outputs (forward) and into the inputs (backward).

All maps of a U-Net -- the submanifold map of every resolution and the
stride-2 map between consecutive resolutions -- are built together by
:func:`kernel_map_pyramid`: the voxels of all levels are stacked (the level
is folded into the event index, so no neighbourhood crosses levels), the
neighbours are searched once in one dense (offset, voxel) table, and the
slots are read off that table with ``nonzero`` and a running count instead
of sorting pairs. One pass of ~40 vectorised ops then serves all levels;
per level the cost of each op was mostly fixed overhead (LArTPC levels hold
9k down to 1k voxels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .voxel_hash import neighbor_table, voxelize

__all__ = [
    "KernelMap",
    "PairLayout",
    "RowSum",
    "downsample_kernel_map",
    "kernel_map_pyramid",
    "submanifold_kernel_map",
]


@dataclass
class RowSum:
    """Sums rows of a (S, C) tensor into groups: group ``g`` is the sum of rows
    ``order[starts[g]:starts[g+1]]`` (empty groups give zeros).

    Runs as ``embedding_bag(mode="sum")``: one fused gather-and-reduce pass
    that measured 2-8x faster on a CPU than ``index_add_`` and faster than a
    CSR sparse-dense product, with a fixed summation order (deterministic).
    """

    order: torch.Tensor  # (P,) rows, grouped
    starts: torch.Tensor  # (num_groups,) start of each group in ``order``

    @classmethod
    def by_index(cls, index: torch.Tensor, num_groups: int) -> RowSum:
        """Row ``p`` goes to group ``index[p]``."""
        sizes = torch.bincount(index, minlength=num_groups)
        return cls(torch.argsort(index, stable=True), torch.cumsum(sizes, 0).sub_(sizes))

    def __call__(self, src: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(self.order, src, self.starts, mode="sum")


@dataclass
class PairLayout:
    """Slots of a kernel map (see the module docstring).

    Padding slots gather row 0 and are summed nowhere; the convolution zeroes
    their gathered output gradient so that they add nothing to the weight
    gradient either.
    """

    gather_in: torch.Tensor  # (S,) input row of every slot
    gather_out: torch.Tensor  # (S,) output row of every slot
    pads: torch.Tensor  # the slots that hold no pair
    slot_offsets: torch.Tensor  # the kernel offset of every block, in slot order
    buckets: list[tuple[int, int]]  # (blocks, block length) per bucket, in slot order
    blocks: list[tuple[int, int]]  # (first slot, pairs) per kernel offset
    to_out: RowSum  # sums slots into the outputs
    to_in: RowSum  # sums slots into the inputs
    bucket_slots: list[int] = field(init=False)  # for Tensor.split
    bucket_blocks: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.bucket_slots = [n * length for n, length in self.buckets]
        self.bucket_blocks = [n for n, _ in self.buckets]

    def transposed(self) -> PairLayout:
        return replace(self, gather_in=self.gather_out, gather_out=self.gather_in, to_out=self.to_in, to_in=self.to_out)


@dataclass
class KernelMap:
    """A sparse convolution's connectivity: ``layout`` plus the sizes. The
    identity offset of a submanifold map (output = input voxel) has no pairs:
    the convolution applies it as a dense matmul."""

    layout: PairLayout
    num_in: int
    num_out: int
    identity: int = -1

    @property
    def kernel_volume(self) -> int:
        return len(self.layout.blocks)

    @property
    def counts(self) -> list[int]:
        """Pairs per kernel offset."""
        return [count for _, count in self.layout.blocks]

    @functools.cached_property
    def pairs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(in_idx, out_idx)`` of all pairs, grouped by offset in offset order."""
        device = self.layout.gather_in.device
        slots = [torch.arange(first, first + count, device=device) for first, count in self.layout.blocks]
        slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long, device=device)
        return self.layout.gather_in.index_select(0, slots), self.layout.gather_out.index_select(0, slots)

    def transposed(self) -> KernelMap:
        """The map of the transposed convolution (outputs become inputs), on
        the same layout read the other way."""
        return KernelMap(self.layout.transposed(), self.num_out, self.num_in, self.identity)

    @classmethod
    def from_pairs(cls, in_idx: torch.Tensor, out_idx: torch.Tensor, offset: torch.Tensor,
                   kernel_volume: int, num_in: int, num_out: int, identity: int = -1) -> KernelMap:
        """A map from an explicit pair list (any order; ``offset`` (P,) gives
        each pair's kernel offset). The builders below do not need this."""
        device = in_idx.device
        order = torch.argsort(offset * max(num_out, 1) + out_idx, stable=True)
        in_idx, out_idx, offset = in_idx[order], out_idx[order], offset[order]
        counts = torch.bincount(offset, minlength=kernel_volume).tolist()
        plan = _plan_buckets([counts], identity)
        first_pair = [sum(counts[:k]) for k in range(kernel_volume)]
        shift = torch.tensor([f - p for f, p in zip(plan.first_slot[0], first_pair)], device=device)
        slots = torch.arange(in_idx.numel(), device=device) + shift.index_select(0, offset)
        by_out, by_in = RowSum.by_index(out_idx, num_out), RowSum.by_index(in_idx, num_in)
        return cls(_layout(plan, 0, slots, in_idx, out_idx,
                           RowSum(slots.index_select(0, by_out.order), by_out.starts),
                           RowSum(slots.index_select(0, by_in.order), by_in.starts)), num_in, num_out, identity)


@dataclass
class _BucketPlan:
    buckets: list[list[tuple[list[int], int]]]  # per level: (offsets, block length) per bucket
    first_slot: list[list[int]]  # per level and offset: first slot of its block (level-local)
    counts: list[list[int]]  # per level and offset: pairs
    bounds: list[int]  # slots before every level, and the total


# Padding slots one matmul bucket is worth: a bucket costs ~6 more dispatched
# ops per convolution (forward and backward, ~10-20 us each on a busy CPU), a
# padding slot a gathered row and its share of three matmuls (~0.1 us at 32
# channels). Tuned on LArTPC batches with 16-96 channels.
_SLOTS_PER_BUCKET = 512


def _group_offsets(counts: list[int], identity: int) -> list[tuple[list[int], int]]:
    """Offsets into buckets (``(offsets, block length)``, in slot order) that
    minimise padding slots + ``_SLOTS_PER_BUCKET`` per bucket: a bucket is a
    run of the offsets sorted by count (dynamic programming over the runs)."""
    ranked = sorted(((c, k) for k, c in enumerate(counts) if c and k != identity), reverse=True)
    n = len(ranked)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of the first j offsets
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        total = 0
        for i in range(j - 1, -1, -1):  # bucket = ranked[i:j], its length ranked[i]
            total += ranked[i][0]
            cost = best[i] + ranked[i][0] * (j - i) - total + _SLOTS_PER_BUCKET
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups = []
    j = n
    while j > 0:
        i = cut[j]
        groups.append(([k for _, k in ranked[i:j]], ranked[i][0]))
        j = i
    return groups[::-1]


def _plan_buckets(counts: list[list[int]], identity: int) -> _BucketPlan:
    """Bucket the offsets of every level; slots are numbered level after level."""
    plan = _BucketPlan([], [], counts, [0])
    for level_counts in counts:
        groups = _group_offsets(level_counts, identity)
        first = [0] * len(level_counts)
        slot = 0
        for ks, length in groups:
            for k in ks:
                first[k] = slot
                slot += length
        plan.buckets.append(groups)
        plan.first_slot.append(first)
        plan.bounds.append(plan.bounds[-1] + slot)
    return plan


@functools.lru_cache(maxsize=4096)
def _index_tensor(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _layout(plan: _BucketPlan, level: int, slots: torch.Tensor, in_idx: torch.Tensor, out_idx: torch.Tensor,
            to_out: RowSum, to_in: RowSum) -> PairLayout:
    """One level's layout: its pairs' (level-local) slots, rows and sums."""
    device = in_idx.device
    size = plan.bounds[level + 1] - plan.bounds[level]
    gather_in = torch.zeros(size, dtype=torch.long, device=device).index_copy_(0, slots, in_idx)
    gather_out = torch.zeros(size, dtype=torch.long, device=device).index_copy_(0, slots, out_idx)
    empty = torch.ones(size, dtype=torch.bool, device=device).index_fill_(0, slots, False)
    groups = plan.buckets[level]
    slot_offsets = _index_tensor(tuple(k for ks, _ in groups for k in ks), device)
    blocks = list(zip(plan.first_slot[level], plan.counts[level]))
    return PairLayout(gather_in, gather_out, torch.nonzero(empty).squeeze(1), slot_offsets,
                      [(len(ks), length) for ks, length in groups], blocks, to_out, to_in)


def _maps_from_table(found: torch.Tensor, nbr: torch.Tensor, out_bounds: list[int], in_bounds: list[int],
                     identity: int, child_entry: torch.Tensor | None = None,
                     kept: torch.Tensor | None = None) -> list[KernelMap]:
    """Per-level kernel maps of a (K, N) table over the stacked output voxels
    of several levels: ``found[k, o]`` says output ``o`` has a pair at offset
    ``k``, whose input is the stacked row ``nbr[k, o]``; pairs never cross
    levels. Grouping by input: for a submanifold map (``child_entry`` None)
    it is the grouping by output mirrored, as pair (k, o <- j) mirrors
    (K-1-k, j <- o); for a strided map every input has exactly one pair, the
    one at table entry ``child_entry[i]`` (with ``kept``, a mask over the
    inputs: only those have one, ``child_entry`` listing theirs in order).
    """
    kvol, n = found.shape
    device = found.device
    levels = len(out_bounds) - 1
    # Table entries with a pair, grouped by output (so level after level), then offset.
    ok = torch.nonzero(found.t())
    out, offset = ok[:, 0], ok[:, 1]
    # A pair's rank within its (level, offset) = running count along the table row
    # minus the pairs of that offset in earlier levels.
    # (int32: a bool cumsum into int64 measured 8x slower on a CPU)
    running = torch.cumsum(found, dim=1, dtype=torch.int32)
    before = torch.cat([torch.zeros(kvol, 1, dtype=torch.int32, device=device), running], 1)[:, out_bounds].long()
    plan = _plan_buckets((before[:, 1:] - before[:, :-1]).t().tolist(), identity)
    slot_base = torch.tensor(plan.first_slot, device=device) - before[:, :-1].t() - 1  # (levels, K)
    sizes = torch.tensor([b - a for a, b in zip(out_bounds[:-1], out_bounds[1:])], device=device)
    level_of = torch.repeat_interleave(torch.arange(levels, device=device), sizes, output_size=n)
    running, slot_base = running.view(-1), slot_base.view(-1)

    def slot_of(k: torch.Tensor, o: torch.Tensor) -> torch.Tensor:  # level-local slot of entry (k, o)
        return running.index_select(0, k * n + o) + slot_base.index_select(0, level_of.index_select(0, o) * kvol + k)

    pair_slot = slot_of(offset, out)
    src = nbr.view(-1).index_select(0, offset * n + out)
    per_out = torch.count_nonzero(found, dim=0)
    out_starts = torch.cumsum(per_out, 0).sub_(per_out)
    pair_bounds = torch.cat([out_starts, out_starts.new_tensor([ok.shape[0]])])[out_bounds].tolist()
    if child_entry is None:
        in_slot = slot_of(kvol - 1 - offset, src)  # the mirror of each pair, in by-output order
    else:
        child_offset = torch.div(child_entry, n, rounding_mode="floor")
        in_slot = slot_of(child_offset, child_entry - child_offset * n)
        if kept is None:
            in_starts, kept_bounds = torch.arange(in_bounds[-1], device=device), in_bounds
        else:  # inputs outside every output (spconv's spatial extent) are summed nowhere
            in_starts = torch.cumsum(kept, 0).sub_(kept.long())
            kept_bounds = torch.cat([in_starts, in_starts.new_tensor([child_entry.shape[0]])])[in_bounds].tolist()

    maps = []
    for level in range(levels):
        (o0, o1), (i0, i1) = out_bounds[level:level + 2], in_bounds[level:level + 2]
        p0, p1 = pair_bounds[level:level + 2]
        slots = pair_slot[p0:p1]
        starts = out_starts[o0:o1] - p0
        if child_entry is None:
            to_in = RowSum(in_slot[p0:p1], starts)
        else:
            k0, k1 = kept_bounds[level:level + 2]
            to_in = RowSum(in_slot[k0:k1], in_starts[i0:i1] - k0)
        layout = _layout(plan, level, slots, src[p0:p1] - i0, out[p0:p1] - o0, RowSum(slots, starts), to_in)
        maps.append(KernelMap(layout, i1 - i0, o1 - o0, identity))
    return maps


@functools.lru_cache(maxsize=None)
def _cube_offsets(kernel_size: int) -> torch.Tensor:
    r = torch.arange(kernel_size) - (kernel_size - 1) // 2
    return torch.cartesian_prod(r, r, r)  # (K,3), centre at K // 2 for odd sizes


def _submanifold_maps(grid: torch.Tensor, level_batch: torch.Tensor, bounds: list[int], kernel_size: int) -> list[KernelMap]:
    device = grid.device
    offsets = _cube_offsets(kernel_size).to(device)
    kvol, n = len(offsets), grid.shape[0]
    centre = kvol // 2  # the identity: a dense matmul, no pairs needed
    # Offsets k and K-1-k are opposite (d, -d), and j = i + d <=> i = j - d:
    # searching the first half of the kernel gives the second half for free.
    half_found, half_nbr = neighbor_table(grid, level_batch, offsets[:centre])
    found = torch.zeros(kvol, n, dtype=torch.bool, device=device)
    nbr = torch.zeros(kvol, n, dtype=torch.long, device=device)
    found[:centre] = half_found
    nbr[:centre] = half_nbr
    ko = torch.nonzero(half_found)
    k, out = ko[:, 0], ko[:, 1]
    mirror = (kvol - 1 - k) * n + half_nbr.view(-1).index_select(0, k * n + out)
    found.view(-1).index_fill_(0, mirror, True)
    nbr.view(-1).index_copy_(0, mirror, out.contiguous())
    return _maps_from_table(found, nbr, bounds, bounds, centre)


def _stride_maps(grids: list[torch.Tensor], parents: list[torch.Tensor], stride: int,
                 orphans: bool = False) -> list[KernelMap]:
    """Maps from each level to the next, coarser one (``parents[l]``: the
    level-(l+1) voxel of every level-l voxel; with ``orphans``, -1 for a voxel
    that has none)."""
    device = grids[0].device
    kvol = stride**3
    fine = torch.cat(grids[:-1])
    coarse_bounds = [0]
    fine_bounds = [0]
    for g_fine, g_coarse in zip(grids[:-1], grids[1:]):
        fine_bounds.append(fine_bounds[-1] + g_fine.shape[0])
        coarse_bounds.append(coarse_bounds[-1] + g_coarse.shape[0])
    num_coarse = coarse_bounds[-1]
    parent = torch.cat([p + b for p, b in zip(parents, coarse_bounds[:-1])])
    kept = torch.cat(parents) >= 0 if orphans else None
    rows = torch.arange(fine.shape[0], device=device)
    if kept is not None:
        rows, parent = rows[kept], parent[kept]
        fine = fine.index_select(0, rows)
    local = fine - torch.cat(grids[1:]).index_select(0, parent) * stride
    child_pos = (local[:, 0] * stride + local[:, 1]) * stride + local[:, 2]
    entry = child_pos * num_coarse + parent
    found = torch.zeros(kvol * num_coarse, dtype=torch.bool, device=device).index_fill_(0, entry, True)
    child = torch.empty(kvol * num_coarse, dtype=torch.long, device=device).index_copy_(0, entry, rows)
    return _maps_from_table(found.view(kvol, num_coarse), child.view(kvol, num_coarse), coarse_bounds, fine_bounds,
                            -1, child_entry=entry, kept=kept)


def kernel_map_pyramid(grid: torch.Tensor, batch: torch.Tensor, levels: int, kernel_size: int = 3,
                       stride: int = 2, extent: list[int] | None = None) -> tuple[list[KernelMap], list[KernelMap]]:
    """All maps of a ``levels``-deep U-Net over distinct voxels ``grid`` (as
    :func:`~pimm.models.point_ops.voxelize` returns them): level ``l`` holds
    the voxels at stride ``stride**l``.

    Returns ``(submanifold, strided)``: ``submanifold[l]`` is the
    ``kernel_size``^3 submanifold map of level ``l``, ``strided[l]`` the
    stride-``stride`` map from level ``l`` to ``l+1`` (its ``transposed()``
    goes back up).

    ``extent`` (per axis, level 0) bounds the grid as spconv's
    ``spatial_shape`` does: a strided level spans ``(e - stride) // stride + 1``
    (at least 1), and a voxel whose parent lies beyond has none (it feeds no
    coarser voxel and gets nothing back up).
    """
    grids, batches, parents, orphans = [grid], [batch], [], False
    for _ in range(levels - 1):
        coarse, cbatch, parent = voxelize(torch.div(grids[-1], stride, rounding_mode="floor"), batches[-1])
        if extent is not None:
            extent = [max(1, (e - stride) // stride + 1) for e in extent]
            inside = (coarse < torch.tensor(extent, device=coarse.device)).all(1)
            if not bool(inside.all()):
                orphans = True
                renumber = torch.cumsum(inside, 0).sub_(1).masked_fill_(~inside, -1)
                coarse, cbatch, parent = coarse[inside], cbatch[inside], renumber.index_select(0, parent)
        grids.append(coarse)
        batches.append(cbatch)
        parents.append(parent)
    bounds = [0]
    for g in grids:
        bounds.append(bounds[-1] + g.shape[0])
    num_events = int(batch.max()) + 1 if batch.numel() else 1
    # Folding the level into the event index keeps every level apart, and keeps
    # the stacked voxels sorted by key, as the neighbour search prefers.
    level_batch = torch.cat([b + level * num_events for level, b in enumerate(batches)])
    subm = _submanifold_maps(torch.cat(grids), level_batch, bounds, kernel_size)
    strided = _stride_maps(grids, parents, stride, orphans) if levels > 1 else []
    return subm, strided


def submanifold_kernel_map(grid: torch.Tensor, batch: torch.Tensor, kernel_size: int = 3) -> KernelMap:
    """Kernel map of one submanifold convolution: outputs sit on the input
    voxels (distinct) and each gathers its occupied neighbours within a
    ``kernel_size``^3 cube."""
    return _submanifold_maps(grid, batch, [0, grid.shape[0]], kernel_size)[0]


def downsample_kernel_map(
    grid: torch.Tensor, batch: torch.Tensor, stride: int = 2
) -> tuple[KernelMap, torch.Tensor, torch.Tensor]:
    """Kernel map of a stride-``stride`` convolution with kernel = stride (grid pooling
    with a separate weight per child position).

    Returns ``(kmap, coarse_grid, coarse_batch)``; every fine voxel feeds exactly
    one coarse voxel, so the transposed map is a learned un-pooling.
    """
    coarse, cbatch, parent = voxelize(torch.div(grid, stride, rounding_mode="floor"), batch)
    return _stride_maps([grid, coarse], [parent], stride)[0], coarse, cbatch
