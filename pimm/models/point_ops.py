"""Point-cloud primitives in plain PyTorch: batching, voxel hashing, neighbour
search, scatter reductions and connected components.

Everything here is vectorised tensor code (no per-point Python loops, no custom
CUDA ops), so the models built on it run on a laptop CPU and on any GPU alike.

Batching convention (SPEC "Point-cloud batch"): the points of B events are
concatenated and ``offset`` (B,) holds the cumulative end index of each event.
Events are kept apart by folding the event index into every voxel hash key, so
a neighbourhood can never reach across events.

Neighbour search (:func:`neighbor_table`) is the primitive under the kernel
maps of :mod:`pimm.models.sparse_maps` (``KernelMap``,
``submanifold_kernel_map``, ``downsample_kernel_map``; still importable from
here) and under the clustering of :mod:`pimm.models.instance`.
"""

from __future__ import annotations

import torch

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


def neighbor_table(
    grid: torch.Tensor, batch: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense neighbour table: ``found[k, i]`` is True when the voxel
    ``grid[i] + offsets[k]`` of the same event exists, and then it is row
    ``nbr[k, i]`` (``nbr`` is meaningless where ``found`` is False).

    ``grid`` must hold distinct voxels. Keys are linear in the coordinates,
    so the key of ``grid + d`` is the key plus a constant, and the voxels of
    one (event, x, y) column are consecutive in key order. One binary search
    per column of offsets -- at its lowest ``dz`` -- therefore finds all of
    them: the key ``base + t`` is exactly as many places after ``base``'s
    insertion point as there are keys in ``[base, base + t)``, at most
    ``t``. All columns go through a single ``searchsorted`` (5 columns for a
    half 3^3 kernel instead of 13 searches, 9 for a full one instead of 26),
    and everything else is a dozen vectorised ops, whatever the kernel.
    """
    m, k = grid.shape[0], offsets.shape[0]
    device = grid.device
    if m == 0 or k == 0:
        return torch.zeros(k, m, dtype=torch.bool, device=device), torch.zeros(k, m, dtype=torch.long, device=device)
    reach = int(offsets.abs().max())
    shifted = grid + reach  # keeps every neighbour of a voxel non-negative
    span = int(shifted.max()) + reach + 1
    keys = hash_keys(shifted, batch, span)
    # Voxels from voxelize() come sorted already; then no reordering is needed.
    in_order = bool((keys[1:] > keys[:-1]).all())
    sorted_keys, order = (keys, None) if in_order else torch.sort(keys)

    columns: dict[tuple[int, int], list[int]] = {}
    offs = offsets.tolist()
    for dx, dy, dz in offs:
        columns.setdefault((dx, dy), []).append(dz)
    lows = {c: min(dzs) for c, dzs in columns.items()}
    width = max(max(dzs) - lows[c] + 1 for c, dzs in columns.items())
    col_id = {c: n for n, c in enumerate(columns)}
    # Row of each offset's answer in the (columns * (width + 1), m) tables.
    rows = [col_id[(dx, dy)] * (width + 1) + dz - lows[(dx, dy)] for dx, dy, dz in offs]
    shift = [(dx * span + dy) * span + lows[(dx, dy)] for dx, dy in columns]

    base = sorted_keys + torch.tensor(shift, device=device)[:, None]  # (columns, m): key at (x+dx, y+dy, z+low)
    pos = torch.searchsorted(sorted_keys, base)
    # A sentinel tail so that looking up to `width` places past the end needs no clamp.
    padded = torch.cat([sorted_keys, sorted_keys.new_full((width,), torch.iinfo(torch.int64).max)])
    slots = (pos[:, None, :] + torch.arange(width, device=device)[:, None]).view(-1)
    # The slot holding key base + t answers dz = low + t; keys are unique, so
    # each t is answered by at most one slot. Anything else goes to row `width`.
    dz_of_slot = (padded.index_select(0, slots).view(-1, width, m) - base[:, None, :]).clamp_(0, width)
    found = torch.zeros(len(columns), width + 1, m, dtype=torch.bool, device=device)
    found.scatter_(1, dz_of_slot, True)
    nbr = torch.zeros(len(columns), width + 1, m, dtype=torch.long, device=device)
    nbr.scatter_(1, dz_of_slot, slots.view(-1, width, m))
    rows_t = torch.tensor(rows, device=device)
    found = found.view(-1, m).index_select(0, rows_t)
    nbr = nbr.view(-1, m).index_select(0, rows_t)
    if order is not None:  # back from key order to the caller's row order
        nbr = order.index_select(0, nbr.clamp_max_(m - 1).view(-1)).view(k, m)
        found = torch.zeros_like(found).index_copy_(1, order, found)
        nbr = torch.zeros_like(nbr).index_copy_(1, order, nbr)
    return found, nbr


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


_MOVED = ("KernelMap", "PairLayout", "RowSum", "downsample_kernel_map", "submanifold_kernel_map")


def __getattr__(name: str):
    # The kernel maps moved to sparse_maps (which imports this module, hence
    # the lazy look-up); the old import path keeps working.
    if name in _MOVED:
        from . import sparse_maps

        return getattr(sparse_maps, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
