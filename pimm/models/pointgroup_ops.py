"""PointGroup's clustering on any device: upstream's CUDA extension
``pointgroup_ops`` (``ballquery_batch_p``, ``bfs_cluster``) as tensor code,
with its arguments, output layout and results.

``ballquery_batch_p``: for every point, the points of its own event (the
``batch_offsets`` range its ``batch_idxs`` names) closer than ``radius``,
itself included. The distance test is upstream's float32
``dx*dx + dy*dy + dz*dz < radius*radius``; upstream's kernel keeps at most
:data:`MAX_BALL_POINTS` neighbours per point -- the first ones by index --
and so does this. ``mean_active`` is only upstream's first guess of the
output size (it re-runs with a larger one until everything fits), so it
changes nothing here. A point's neighbours are listed in index order and
the lists follow each other in point order (upstream's lists are in the
order its threads finished; ``start_len`` says where each one is either way).

``bfs_cluster``: upstream visits the points in index order; from each
unvisited point it runs a breadth-first search along the neighbour lists,
stepping only onto unvisited points of the current point's label, and keeps
the component when it has at least ``threshold`` points. The lists need not
be symmetric (the neighbour cap makes them one-way where a ball holds more
than :data:`MAX_BALL_POINTS` points), and then a component depends on which
point seeds it. Every point ends in the component of the smallest point that
reaches it along same-label list edges: a point visited by an earlier search
has all its list neighbours visited by then, so a later search stepping onto
it would find nothing new. That smallest reaching point is found for all
points at once by min-label propagation along the directed edges
(:func:`smallest_reaching`), so there is no per-point loop. Components come
in the order of their seeds, as upstream's; within one, points are in index
order (upstream: the search's order), the seed first in both.
"""

from __future__ import annotations

import torch

from .voxel_hash import neighbor_table, voxelize

__all__ = ["MAX_BALL_POINTS", "ballquery_batch_p", "bfs_cluster", "smallest_reaching"]

MAX_BALL_POINTS = 1000  # upstream's kernel stores at most this many neighbours of a point
_PAIR_BUDGET = 1 << 24  # candidate pairs examined at once (bounds the memory of a dense ball)
_CELL_MARGIN = 1.0 + 1e-5  # cells a hair wider than the radius: a float32 distance test never reaches two cells away
_NEIGHBOR_CELLS = torch.tensor([[x, y, z] for x in (-1, 0, 1) for y in (-1, 0, 1) for z in (-1, 0, 1)])


def _event_of_points(batch_idxs: torch.Tensor, batch_offsets: torch.Tensor, n: int) -> torch.Tensor:
    """The event of every point, checked against the ``batch_offsets`` ranges
    upstream's kernel searches."""
    if batch_offsets.dim() != 1 or batch_offsets.numel() < 2:
        raise ValueError(f"ballquery_batch_p: batch_offsets must be (B + 1,) event bounds, got shape "
                         f"{tuple(batch_offsets.shape)}")
    bounds = batch_offsets.long()
    if bool((bounds[1:] < bounds[:-1]).any()) or int(bounds[0]) != 0 or int(bounds[-1]) != n:
        raise ValueError(f"ballquery_batch_p: batch_offsets must rise from 0 to the number of points ({n}), "
                         f"got {bounds.tolist()[:8]}")
    events = batch_idxs.long()
    if events.shape != (n,):
        raise ValueError(f"ballquery_batch_p: batch_idxs must be ({n},), got shape {tuple(batch_idxs.shape)}")
    ranges = torch.searchsorted(bounds[1:], torch.arange(n, device=bounds.device), right=True)
    if not torch.equal(ranges, events):
        raise ValueError("ballquery_batch_p: batch_idxs and batch_offsets disagree (points must be sorted by event "
                         "and each event's points lie in its batch_offsets range)")
    return events


def _cells(xyz: torch.Tensor, events: torch.Tensor, radius: float):
    """Points hashed into cells of edge ~``radius`` per event: the cells
    (distinct), each point's cell, and the points sorted by (cell, index)
    with every cell's first position and size in that order."""
    grid = torch.floor(xyz.double() / (radius * _CELL_MARGIN)).long()
    grid = grid - grid.min(0).values
    span = int(grid.max()) + 3
    if (int(events.max()) + 1) * span ** 3 >= 1 << 62:
        raise ValueError(f"ballquery_batch_p: radius={radius} is too small for the extent of the coordinates "
                         f"(over {span} cells a side); scale the coordinates or raise the radius")
    cell_grid, cell_event, cell_of_point = voxelize(grid, events)
    order = torch.argsort(cell_of_point, stable=True)  # by cell, then by point index
    size = torch.bincount(cell_of_point, minlength=cell_grid.shape[0])
    first = torch.cumsum(size, 0) - size
    return cell_grid, cell_event, cell_of_point, order, first, size


def _query_chunks(work: torch.Tensor, budget: int):
    """Consecutive [start, stop) ranges of queries whose summed work stays
    within ``budget`` (a single query may exceed it alone)."""
    total = torch.cumsum(work, 0)
    start, n = 0, work.shape[0]
    while start < n:
        base = int(total[start - 1]) if start else 0
        stop = int(torch.searchsorted(total, base + budget, right=True))
        stop = max(stop, start + 1)
        yield start, min(stop, n)
        start = stop


def ballquery_batch_p(coords: torch.Tensor, batch_idxs: torch.Tensor, batch_offsets: torch.Tensor, radius: float,
                      mean_active: int = 300, max_neighbors: int = MAX_BALL_POINTS):
    """Neighbours within ``radius`` of every point, in its own event (module doc).

    Args:
        coords: (n, 3) point positions (compared in float32, as upstream).
        batch_idxs: (n,) event of every point, sorted.
        batch_offsets: (B + 1,) event bounds, ``[0, end_0, end_1, ...]``.
        radius: ball radius (> 0).
        mean_active: upstream's initial output size per point; ignored.
        max_neighbors: the kernel's cap per point (upstream: 1000).

    Returns ``(idx (nActive,) int32, start_len (n, 2) int32)``: the
    neighbours of point ``i`` are ``idx[start_len[i, 0] : start_len[i, 0] +
    start_len[i, 1]]``.
    """
    del mean_active  # only sizes upstream's first attempt
    if not radius > 0:
        raise ValueError(f"ballquery_batch_p: radius must be > 0, got {radius}")
    n = coords.shape[0]
    device = coords.device
    if coords.dim() != 2 or coords.shape[1] != 3:
        raise ValueError(f"ballquery_batch_p: coords must be (n, 3), got shape {tuple(coords.shape)}")
    if n == 0:
        return torch.zeros(0, dtype=torch.int32, device=device), torch.zeros(0, 2, dtype=torch.int32, device=device)
    events = _event_of_points(batch_idxs.to(device), batch_offsets.to(device), n)
    xyz = coords.float()
    radius32 = torch.tensor(radius, dtype=torch.float32)
    radius2 = radius32 * radius32  # upstream squares the float32 radius
    cell_grid, cell_event, cell_of_point, order, first, size = _cells(xyz, events, float(radius))
    found, nbr = neighbor_table(cell_grid, cell_event, _NEIGHBOR_CELLS.to(device))  # (27, cells)
    # Per point the (up to 27) cells to search and how many points each holds.
    present = found[:, cell_of_point].t()  # (n, 27)
    cand_cell = torch.where(present, nbr[:, cell_of_point].t(), torch.zeros_like(nbr[:, cell_of_point].t()))
    cand_size = torch.where(present, size[cand_cell], torch.zeros_like(cand_cell))
    neighbours, counts = [], torch.zeros(n, dtype=torch.long, device=device)
    for start, stop in _query_chunks(cand_size.sum(1), _PAIR_BUDGET):
        sizes = cand_size[start:stop].reshape(-1)
        firsts = first[cand_cell[start:stop]].reshape(-1)
        query = torch.arange(start, stop, device=device).repeat_interleave(27).repeat_interleave(sizes)
        step = torch.arange(int(sizes.sum()), device=device) - (torch.cumsum(sizes, 0) - sizes).repeat_interleave(sizes)
        other = order[firsts.repeat_interleave(sizes) + step]
        d = xyz[query] - xyz[other]
        close = (d[:, 0] * d[:, 0] + d[:, 1] * d[:, 1] + d[:, 2] * d[:, 2]) < radius2
        query, other = query[close], other[close]
        # Index order within each point's list, then upstream's cap: its first max_neighbors.
        key, _ = torch.sort(query * n + other)
        query, other = key // n, key % n
        per_query = torch.bincount(query - start, minlength=stop - start)
        rank = torch.arange(key.shape[0], device=device) - (torch.cumsum(per_query, 0) - per_query)[query - start]
        keep = rank < max_neighbors
        neighbours.append(other[keep])
        counts[start:stop] = per_query.clamp_max(max_neighbors)
    idx = torch.cat(neighbours).to(torch.int32)
    start_len = torch.stack([torch.cumsum(counts, 0) - counts, counts], dim=1).to(torch.int32)
    return idx, start_len


def smallest_reaching(num_nodes: int, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """For every node of a directed graph (edges ``src -> dst``), the smallest
    node that reaches it (itself included).

    Min-label propagation along the edges; between rounds every label jumps
    to its own label's label (a node reaching a node's reacher reaches the
    node), which collapses long chains in a few rounds."""
    labels = torch.arange(num_nodes, device=src.device)
    if src.numel() == 0:
        return labels
    while True:
        new = labels.scatter_reduce(0, dst, labels[src], reduce="amin")
        while True:
            jumped = new[new]
            if torch.equal(jumped, new):
                break
            new = jumped
        if torch.equal(new, labels):
            return labels
        labels = new


def bfs_cluster(semantic_label: torch.Tensor, ball_query_idxs: torch.Tensor, start_len: torch.Tensor,
                threshold: int):
    """Same-label components along the neighbour lists of
    :func:`ballquery_batch_p`, as upstream's breadth-first search finds them
    (module doc); components of fewer than ``threshold`` points are dropped.

    Returns ``(cluster_idxs (sumNPoint, 2) int32, cluster_offsets (nCluster + 1,)
    int32)``: rows ``[cluster id, point index]``, cluster ``c`` at rows
    ``cluster_offsets[c]:cluster_offsets[c + 1]``, its seed first.
    """
    n = start_len.shape[0]
    device = start_len.device
    label = semantic_label.reshape(-1).long().to(device)
    if label.shape[0] < n:
        raise ValueError(f"bfs_cluster: {label.shape[0]} labels for {n} points")
    starts, lens = start_len[:, 0].long(), start_len[:, 1].long()
    total = int(lens.sum())
    src = torch.arange(n, device=device).repeat_interleave(lens)
    position = starts[src] + torch.arange(total, device=device) - (torch.cumsum(lens, 0) - lens)[src]
    if total and (int(position.max()) >= ball_query_idxs.numel() or int(position.min()) < 0):
        raise ValueError("bfs_cluster: start_len points past the end of ball_query_idxs")
    dst = ball_query_idxs.reshape(-1).long().to(device)[position]
    if total and (int(dst.min()) < 0 or int(dst.max()) >= n):
        raise ValueError(f"bfs_cluster: ball_query_idxs holds indices outside [0, {n})")
    same = label[dst] == label[src]
    seed = smallest_reaching(n, src[same], dst[same])
    size = torch.bincount(seed, minlength=n)
    kept_seed = (seed == torch.arange(n, device=device)) & (size >= int(threshold))
    cluster_of_seed = torch.cumsum(kept_seed.long(), 0) - 1
    member = torch.nonzero(kept_seed[seed]).squeeze(1)
    cluster = cluster_of_seed[seed[member]]
    order = torch.argsort(cluster, stable=True)  # clusters in seed order, points in index order
    cluster_idxs = torch.stack([cluster[order], member[order]], dim=1).to(torch.int32)
    sizes = size[kept_seed]
    cluster_offsets = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)]).to(torch.int32)
    return cluster_idxs, cluster_offsets
