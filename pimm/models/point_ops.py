"""Point-cloud primitives in plain PyTorch: batching, voxel hashing, kernel maps,
scatter reductions and connected components.

Everything here is vectorised tensor code (no per-point Python loops, no custom
CUDA ops), so the models built on it run on a laptop CPU and on any GPU alike.

Batching convention (SPEC "Point-cloud batch"): the points of B events are
concatenated and ``offset`` (B,) holds the cumulative end index of each event.
Events are kept apart by folding the event index into every voxel hash key, so
a neighbourhood can never reach across events.

A *kernel map* is the sparse-convolution bookkeeping: for every kernel offset
``k`` the list of (input row, output row) pairs it connects. It is stored as
two flat tensors ``in_idx, out_idx`` (P,) grouped by offset and ``counts``
(K numbers of pairs per offset).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "offset2batch",
    "batch2offset",
    "event_grid_coord",
    "event_min",
    "hash_keys",
    "voxelize",
    "KernelMap",
    "submanifold_kernel_map",
    "downsample_kernel_map",
    "neighbor_pairs",
    "scatter_mean",
    "scatter_sum",
    "connected_components",
]


def offset2batch(offset: torch.Tensor) -> torch.Tensor:
    """(B,) cumulative end indices -> (N,) event index of every point."""
    counts = torch.diff(offset, prepend=offset.new_zeros(1))
    return torch.repeat_interleave(torch.arange(len(offset), device=offset.device), counts)


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
    count = torch.bincount(index, minlength=size).clamp_min(1).to(src.dtype)
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


def hash_keys(grid: torch.Tensor, batch: torch.Tensor, span: int) -> torch.Tensor:
    """Unique int64 key per (event, voxel); ``grid`` must lie in [0, span)."""
    return ((batch * span + grid[:, 0]) * span + grid[:, 1]) * span + grid[:, 2]


def _span(grid: torch.Tensor) -> int:
    return int(grid.max()) + 1 if grid.numel() else 1


def voxelize(grid: torch.Tensor, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge points that share a voxel.

    Returns ``(voxel_grid (M,3), voxel_batch (M,), inverse (N,))`` with voxels
    sorted by (event, x, y, z) and ``inverse`` mapping each point to its voxel.
    """
    if grid.min() < 0:
        raise ValueError("voxelize expects non-negative grid coordinates")
    span = _span(grid)
    keys, inverse = torch.unique(hash_keys(grid, batch, span), return_inverse=True)
    vb = keys // span**3
    rem = keys % span**3
    vgrid = torch.stack([rem // span**2, (rem // span) % span, rem % span], dim=1)
    return vgrid, vb, inverse


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
