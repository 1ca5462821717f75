"""Point-cloud primitives in plain PyTorch: batching, voxel hashing, neighbour
search, scatter reductions and connected components.

Everything here is vectorised tensor code (no per-point Python loops, no custom
CUDA ops), so the models built on it run on a laptop CPU and on any GPU alike.

Batching convention (SPEC "Point-cloud batch"): the points of B events are
concatenated and ``offset`` (B,) holds the cumulative end index of each event.
Events are kept apart by folding the event index into every voxel hash key, so
a neighbourhood can never reach across events.

Neighbour search (:func:`neighbor_table`, in :mod:`pimm.models.voxel_hash` with
the voxel hashing; re-exported here) is the primitive under the kernel
maps of :mod:`pimm.models.sparse_maps` (``KernelMap``,
``submanifold_kernel_map``, ``downsample_kernel_map``; still importable from
here) and under the clustering of :mod:`pimm.models.instance`.
"""

from __future__ import annotations

import torch

# Voxel hashing and the neighbour table live in voxel_hash (which the kernel
# maps build on without importing this module); the kernel maps moved to
# sparse_maps. Both stay importable from here.
from .sparse_maps import (  # noqa: F401
    KernelMap,
    PairLayout,
    RowSum,
    downsample_kernel_map,
    submanifold_kernel_map,
)
from .voxel_hash import hash_keys, neighbor_table, voxelize

__all__ = [
    "offset2batch",
    "batch2offset",
    "event_grid_coord",
    "event_min",
    "hash_keys",
    "voxelize",
    "neighbor_pairs",
    "neighbor_table",
    "scatter_mean",
    "scatter_sum",
    "connected_components",
]


def offset2batch(offset: torch.Tensor, num_points: int | None = None) -> torch.Tensor:
    """(B,) cumulative end indices -> (N,) event index of every point.

    Pass ``num_points`` (N, e.g. ``coord.shape[0]``) when it is known: on a GPU
    the output size then needs no read of ``offset`` (no host sync)."""
    counts = torch.diff(offset, prepend=offset.new_zeros(1))
    return torch.repeat_interleave(torch.arange(len(offset), device=offset.device), counts, output_size=num_points)


def batch2offset(batch: torch.Tensor, num_events: int | None = None) -> torch.Tensor:
    """(N,) sorted event index -> (B,) cumulative end indices."""
    n = int(batch.max()) + 1 if num_events is None else num_events
    return torch.cumsum(torch.bincount(batch, minlength=n), 0)


def scatter_sum(src: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Sum rows of ``src`` into ``size`` buckets (differentiable, via index_add)."""
    out = src.new_zeros((size,) + tuple(src.shape[1:]))
    return out.index_add(0, index, src)


def scatter_mean(src: torch.Tensor, index: torch.Tensor, size: int) -> torch.Tensor:
    """Mean of rows of ``src`` per bucket; empty buckets give 0."""
    total = scatter_sum(src, index, size)
    # Counted by index_add into ``size`` buckets, not bincount: a CUDA bincount reads the
    # index's range on the host (a sync) to size its output.
    count = src.new_zeros(size).index_add_(0, index, src.new_ones(index.shape[0])).clamp_min(1)
    return total / count.view((-1,) + (1,) * (src.dim() - 1))


def event_grid_coord(coord: torch.Tensor, batch: torch.Tensor, grid_size: float) -> torch.Tensor:
    """Integer grid coordinates ``floor((coord - event_min) / grid_size)``.

    The origin is the per-event minimum, so an event's voxelisation (and hence
    the network output) does not depend on which other events share its batch.
    """
    # The small epsilon keeps points that sit exactly on lattice planes (e.g.
    # integer voxel indices scaled by a normalising transform) from falling one
    # cell low through float round-off.
    return torch.floor((coord - event_min(coord, batch)) / grid_size + 1e-3).long()


def event_min(x: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """(N,D) -> (N,D): the per-event column minimum, broadcast back to each row."""
    num_events = int(batch.max()) + 1 if batch.numel() else 0
    lo = x.new_full((num_events, x.shape[1]), torch.iinfo(x.dtype).max if not x.is_floating_point() else float("inf"))
    lo = lo.scatter_reduce(0, batch[:, None].expand(-1, x.shape[1]), x, reduce="amin")
    return lo[batch]


def neighbor_pairs(
    grid: torch.Tensor, batch: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each offset ``d`` the pairs (i, j) with ``grid[j] == grid[i] + d`` in the
    same event (see :func:`neighbor_table`).

    ``grid`` must hold distinct voxels. Returns ``(i, j, offset_id)`` sorted by
    offset id, then by ``i``.
    """
    found, nbr = neighbor_table(grid, batch, offsets)
    m = grid.shape[0]
    flat = torch.nonzero(found.view(-1)).squeeze(1)  # row-major over (offset, voxel)
    return flat % m, nbr.view(-1).index_select(0, flat), torch.div(flat, m, rounding_mode="floor")


def connected_components(num_nodes: int, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Component label (the smallest node id in it) of every node of an undirected graph.

    Min-label propagation along edges, each round followed by pointer jumping
    (``label = label[label]``) which halves chain lengths, so long tracks
    converge in a few dozen vectorised rounds instead of one round per hop.
    """
    labels = torch.arange(num_nodes, device=src.device)
    if src.numel() == 0:
        return labels
    a = torch.cat([src, dst])
    b = torch.cat([dst, src])
    while True:
        new = labels.scatter_reduce(0, a, labels[b], reduce="amin")
        # Pull the new minimum onto the old label's root as well, so whole trees
        # merge at once rather than node by node.
        new = new.scatter_reduce(0, labels, new, reduce="amin")
        while True:
            jumped = new[new]
            if torch.equal(jumped, new):
                break
            new = jumped
        if torch.equal(new, labels):
            return labels
        labels = new
