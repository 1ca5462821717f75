"""Pointcept's ``pointops`` operations (the CUDA extension Point Transformer
v1 and v2 call) in plain PyTorch, with the same signatures and meaning, so
the models built on them run on a CPU as well as on a GPU.

Batching is pointops': the points of the events are concatenated and
``offset`` (B,) holds each event's cumulative end; a query set has its own
``new_offset``, and a query of event ``b`` only ever sees the points of
event ``b``.

* :func:`knn_query`: the ``nsample`` nearest points of each query, nearest
  first (a query that is itself a point finds itself first, at distance 0);
  where an event has fewer points, the missing slots hold index ``-1`` and
  distance ``1e5`` (pointops' ``sqrt(1e10)``). Exactly equidistant
  candidates are ranked by index (pointops' heap keeps an arbitrary one of
  them: which one depends on its heap's order of insertion).
* :func:`grouping`: the rows of those neighbours, optionally with their
  coordinates relative to the query in front; an index ``-1`` reads a zero
  row (and a zero offset).
* :func:`farthest_point_sampling`: from each event's first point, repeatedly
  the point farthest from everything picked so far (ties: the lowest index).
* :func:`interpolation`: inverse-distance weights ``1 / (d + 1e-8)`` over
  the 3 nearest coarse points. A query whose event has fewer than 3 coarse
  points uses those it has (pointops reads the global last row for each
  missing one, with a weight ~1e-5; pimm keeps events apart).
* :func:`grid_pool`: PT-v2's partition pooling, torch_geometric's
  ``voxel_grid`` cells from each event's minimum corner, ordered as its
  cluster ids are (event, then z, y, x), coordinates averaged and features
  max-pooled per cell (``segment_csr``).

Pointcept's kernels themselves are CUDA-only and were not run here: the
tests check every operation against a direct reference written from the
kernels' source, and the models against upstream's own model code run over
Python ports of those kernels (``tests/fixtures/point_transformers``).
"""

from __future__ import annotations

import torch

from .point_ops import offset2batch, scatter_mean
from .ptv3.rows import Groups

__all__ = ["knn_query", "grouping", "knn_query_and_group", "farthest_point_sampling", "strided_offset",
           "interpolation", "grid_pool"]

# pointops' distance of an empty neighbour slot: the square root of its 1e10 initial value.
MISSING_DISTANCE = 1e5
_CHUNK_ELEMENTS = 1 << 18  # query x candidate distances at once (kept in cache: ~2x faster than 1 << 22)
_MAX_CANDIDATES = 1024  # a grid-search query with more candidates is brute-forced
_GRID_COST = 8  # a grid-search candidate costs about as much as this many brute-force distances


def _counts(offset: torch.Tensor) -> torch.Tensor:
    return torch.diff(offset.long(), prepend=offset.new_zeros(1).long())


def _squared_distances(query: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """(q, 3), (n, 3) -> (q, n) as pointops sums them: dx^2 + dy^2 + dz^2 in
    the points' precision (not the |a|^2 + |b|^2 - 2ab expansion, whose
    cancellation reorders near neighbours)."""
    diff = query[:, None, 0] - points[None, :, 0]
    d2 = diff * diff
    for axis in (1, 2):
        diff = query[:, None, axis] - points[None, :, axis]
        d2 = d2 + diff * diff
    return d2


def _key(values: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(value, label) as one int64 that orders as the pair: a non-negative
    float's bits are monotonic in it."""
    return (values.float().contiguous().view(torch.int32).long() << 32) | labels


def _nearest(d2: torch.Tensor, k: int, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` smallest of each row of non-negative ``d2`` ranked by (value,
    label) -- ``labels`` (the same shape) or the column -- whatever order
    ``topk`` leaves equal values in: ``(labels, values)`` (rows, k).

    ``topk`` picks k by value. Where more than k values are at most the k-th
    (a tie at the k-th value, common on a grid), the row keeps every value
    below the k-th and the lowest labels among those equal to it. The k are
    then sorted by (value, label)."""
    values, picked = torch.topk(d2, k, dim=1, largest=False, sorted=False)
    kth = values.amax(1, keepdim=True)
    crowded = torch.nonzero((d2 <= kth).sum(1) > k).squeeze(1)
    if crowded.numel():
        rows, bound = d2.index_select(0, crowded), kth.index_select(0, crowded)
        if labels is None:  # columns in order: the first of the tied ones
            below, tied = rows < bound, rows == bound
            keep = below | (tied & (torch.cumsum(tied, 1) <= k - below.sum(1, keepdim=True)))
            columns = torch.nonzero(keep)[:, 1].view(-1, k)
        else:
            columns = torch.topk(_key(rows, labels.index_select(0, crowded)), k, dim=1, largest=False).indices
        picked[crowded] = columns
        values[crowded] = rows.gather(1, columns)
    names = picked if labels is None else labels.gather(1, picked)
    order = torch.argsort(_key(values, names), dim=1)
    return names.gather(1, order), values.gather(1, order)


def _brute_force(queries: torch.Tensor, points: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) local indices and squared distances against every point, a cache-sized chunk of queries at a time."""
    rows = max(1, _CHUNK_ELEMENTS // max(1, points.shape[0]))
    parts = [_nearest(_squared_distances(queries[a:a + rows], points), k) for a in range(0, queries.shape[0], rows)]
    return torch.cat([p for p, _ in parts]), torch.cat([d for _, d in parts])


def _grid_search(queries: torch.Tensor, points: torch.Tensor, k: int,
                 cell: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The same ranking from the points of the 27 cells of side ``cell``
    around each query's; ``exact`` (q,) marks the queries it is proved for:
    at least k candidates and the k-th closer than ``cell`` (every point
    outside the 27 cells is at least ``cell`` away). None where the cells
    hold too many candidates to be worth it."""
    device, m = points.device, queries.shape[0]
    corner = torch.minimum(points.amin(0), queries.amin(0))
    point_cell = torch.floor((points - corner) / cell).long() + 1  # +1: a margin cell on the low side
    query_cell = torch.floor((queries - corner) / cell).long() + 1
    dims = torch.maximum(point_cell.amax(0), query_cell.amax(0)) + 2  # and on the high side: no key wraps
    stride = torch.stack([dims[1] * dims[2], dims[2], torch.ones_like(dims[2])])
    sorted_keys, order = torch.sort((point_cell * stride).sum(1))
    around = torch.stack(torch.meshgrid(*[torch.arange(-1, 2, device=device)] * 3, indexing="ij"), -1).view(-1, 3)
    keys = (query_cell * stride).sum(1, keepdim=True) + (around * stride).sum(1)  # (q, 27)
    first = torch.searchsorted(sorted_keys, keys)
    count = (torch.searchsorted(sorted_keys, keys, right=True) - first).view(-1)
    if int(count.sum()) * _GRID_COST > m * points.shape[0]:
        return None  # hardly fewer candidates than points: comparing with every point is faster
    owner = torch.repeat_interleave(torch.arange(m, device=device).repeat_interleave(27), count)
    skip = torch.repeat_interleave(first.view(-1) - (torch.cumsum(count, 0) - count), count)
    candidate = order[torch.arange(owner.numel(), device=device) + skip]
    diff = queries.index_select(0, owner) - points.index_select(0, candidate)
    sq = diff * diff
    total = count.view(m, 27).sum(1)
    width = int(min(total.max(), _MAX_CANDIDATES))
    slot = torch.arange(owner.numel(), device=device) - torch.repeat_interleave(torch.cumsum(total, 0) - total, total)
    value = sq[:, 0] + sq[:, 1] + sq[:, 2]
    if width < int(total.max()):  # the crowded queries' candidates past the width are dropped (brute-forced)
        fits = torch.nonzero(slot < width).squeeze(1)
        owner, slot, value, candidate = (t.index_select(0, fits) for t in (owner, slot, value, candidate))
    d2 = torch.full((m, max(width, k)), float("inf"), dtype=points.dtype, device=device)
    labels = torch.full(d2.shape, points.shape[0], dtype=torch.long, device=device)
    d2.index_put_((owner, slot), value)
    labels.index_put_((owner, slot), candidate)
    picked, near = _nearest(d2, k, labels)
    # A point's cell is computed in floating point: near a cell's face it may be one cell off, by the round-off
    # of a quotient as large as the grid (float32's, the coarsest taken), so the proof keeps that much slack.
    slack = 8 * torch.finfo(torch.float32).eps * float(dims.max())
    exact = (total >= k) & (total <= width) & (near[:, -1] < (cell * (1 - slack)) ** 2)
    return picked, near, exact


def _nearest_in_event(queries: torch.Tensor, points: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) local indices and squared distances of the k nearest points,
    ranked by (squared distance, index). Small events: against every point.
    Otherwise a grid search, its cell from the k-th distance of a sample of
    queries (brute-forced), and the queries it cannot prove brute-forced."""
    q, n = queries.shape[0], points.shape[0]
    if q * n <= _CHUNK_ELEMENTS or n <= 8 * k:
        return _brute_force(queries, points, k)
    sample = torch.linspace(0, q - 1, min(q, 64), device=queries.device).long()
    _, sample_d2 = _brute_force(queries[sample], points, k)
    reach = torch.quantile(sample_d2[:, -1].double().sqrt(), 0.9).item()
    extent = (points.amax(0) - points.amin(0)).max().item()
    cell = max(1.25 * reach, 1e-6 * extent, 1e-12)
    found = _grid_search(queries, points, k, cell)
    if found is None:
        return _brute_force(queries, points, k)
    picked, near, exact = found
    missed = torch.nonzero(~exact).squeeze(1)
    if missed.numel():
        picked[missed], near[missed] = _brute_force(queries[missed], points, k)
    return picked, near


@torch.no_grad()
def knn_query(nsample: int, xyz: torch.Tensor, offset: torch.Tensor, new_xyz: torch.Tensor | None = None,
              new_offset: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx (m, nsample) long, dist (m, nsample))``: for each query of
    ``new_xyz`` (default: the points themselves) its ``nsample`` nearest
    points of ``xyz`` in the same event, nearest first, and their Euclidean
    distances; ``-1`` / ``1e5`` where the event has fewer points."""
    if new_xyz is None or new_offset is None:
        new_xyz, new_offset = xyz, offset
    m = new_xyz.shape[0]
    idx = torch.full((m, nsample), -1, dtype=torch.long, device=xyz.device)
    dist = torch.full((m, nsample), MISSING_DISTANCE, dtype=xyz.dtype, device=xyz.device)
    ends, new_ends = offset.long().tolist(), new_offset.long().tolist()
    start = new_start = 0
    for end, new_end in zip(ends, new_ends):
        k = min(nsample, end - start)
        if k > 0 and new_end > new_start:
            picked, d2 = _nearest_in_event(new_xyz[new_start:new_end], xyz[start:end], k)
            idx[new_start:new_end, :k] = picked + start
            dist[new_start:new_end, :k] = d2.sqrt()
        start, new_start = end, new_end
    return idx, dist


def grouping(idx: torch.Tensor, feat: torch.Tensor, xyz: torch.Tensor, new_xyz: torch.Tensor | None = None,
             with_xyz: bool = False) -> torch.Tensor:
    """(m, nsample, c) rows ``feat[idx]`` (zeros where ``idx`` is -1); with
    ``with_xyz`` the neighbours' ``xyz - new_xyz`` (zeros where -1) come first:
    (m, nsample, 3 + c). Differentiable in ``feat`` and the coordinates."""
    if new_xyz is None:
        new_xyz = xyz
    valid = (idx >= 0).unsqueeze(-1)
    safe = idx.clamp_min(0)
    grouped = torch.where(valid, feat[safe], feat.new_zeros(()))
    if not with_xyz:
        return grouped
    relative = torch.where(valid, xyz[safe] - new_xyz.unsqueeze(1), xyz.new_zeros(()))
    return torch.cat((relative, grouped), -1)


def knn_query_and_group(feat: torch.Tensor, xyz: torch.Tensor, offset: torch.Tensor | None = None,
                        new_xyz: torch.Tensor | None = None, new_offset: torch.Tensor | None = None,
                        idx: torch.Tensor | None = None, nsample: int | None = None,
                        with_xyz: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`grouping` over ``idx``, or over a fresh :func:`knn_query` of
    ``nsample`` neighbours when ``idx`` is None; returns ``(grouped, idx)``."""
    if idx is None:
        idx, _ = knn_query(nsample, xyz, offset, new_xyz, new_offset)
    return grouping(idx, feat, xyz, new_xyz, with_xyz), idx


def strided_offset(offset: torch.Tensor, stride: int) -> torch.Tensor:
    """The ``new_offset`` of keeping ``count // stride`` points of each event."""
    return torch.cumsum(torch.div(_counts(offset), stride, rounding_mode="floor"), 0).to(offset.dtype)


@torch.no_grad()
def farthest_point_sampling(xyz: torch.Tensor, offset: torch.Tensor, new_offset: torch.Tensor) -> torch.Tensor:
    """(m,) long indices into ``xyz``: per event, ``new_offset``'s count of
    points by farthest point sampling from the event's first point (each next
    point maximises the squared distance to the nearest one picked; ties go
    to the lowest index). All events advance together, one pick a step."""
    counts, new_counts = _counts(offset), _counts(new_offset)
    num_events = counts.numel()
    steps = int(new_counts.max()) if num_events else 0
    if steps == 0:
        return torch.zeros(0, dtype=torch.long, device=xyz.device)
    width = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    slot = torch.arange(width, device=xyz.device)
    valid = slot[None, :] < counts[:, None]  # (B, width)
    rows = torch.where(valid, starts[:, None] + slot[None, :], 0)
    points = xyz[rows]  # (B, width, 3), padding repeats row 0 and is never picked
    # pointops starts every point at 1e10; a padding slot at -1 loses every argmax.
    nearest = torch.full(valid.shape, 1e10, dtype=xyz.dtype, device=xyz.device).masked_fill(~valid, -1.0)
    events = torch.arange(num_events, device=xyz.device)
    picked = torch.zeros(num_events, steps, dtype=torch.long, device=xyz.device)
    last = torch.zeros(num_events, dtype=torch.long, device=xyz.device)
    for step in range(1, steps):
        d2 = _squared_distances_rows(points, points[events, last])
        nearest = torch.where(valid, torch.minimum(nearest, d2), nearest)
        last = nearest.argmax(1)
        picked[:, step] = last
    keep = torch.arange(steps, device=xyz.device)[None, :] < new_counts[:, None]
    return (picked + starts[:, None])[keep]


def _squared_distances_rows(points: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """(B, n, 3), (B, 3) -> (B, n): pointops' dx^2 + dy^2 + dz^2 to each event's centre."""
    diff = points - centre[:, None, :]
    sq = diff * diff
    return sq[..., 0] + sq[..., 1] + sq[..., 2]


def interpolation(xyz: torch.Tensor, new_xyz: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor,
                  new_offset: torch.Tensor, k: int = 3) -> torch.Tensor:
    """(n, c): ``feat`` of the points ``xyz`` carried to ``new_xyz`` by
    inverse-distance weighting over the ``k`` nearest of the same event,
    weights ``1 / (d + 1e-8)`` normalised to sum 1 (constants for autograd,
    as pointops' distances are; the gradient reaches ``feat``)."""
    idx, dist = knn_query(k, xyz, offset, new_xyz, new_offset)
    recip = torch.where(idx >= 0, 1.0 / (dist + 1e-8), dist.new_zeros(()))
    weight = recip / recip.sum(1, keepdim=True)
    rows = feat[idx.clamp_min(0)]  # (n, k, c)
    return (rows * weight.unsqueeze(-1).to(feat.dtype)).sum(1)


def grid_pool(coord: torch.Tensor, feat: torch.Tensor, offset: torch.Tensor, grid_size: float,
              start: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PT-v2's grid pooling: ``(coord, feat, offset, cluster)`` of the cells.

    A point's cell is ``trunc((coord - start[event]) / grid_size)``, ``start``
    each event's minimum corner unless given (B, 3). Cells are numbered in
    the order of torch_geometric's ``voxel_grid`` ids (event, then z, y, x);
    a cell's coordinate is the mean of its points', its feature their
    maximum; ``cluster`` (N,) maps every point to its cell.
    """
    batch = offset2batch(offset.long(), coord.shape[0])
    num_events = offset.numel()
    if start is None:
        start = coord.new_full((num_events, coord.shape[1]), float("inf")).scatter_reduce(
            0, batch[:, None].expand_as(coord), coord, reduce="amin")
    with torch.no_grad():
        # divided by a tensor, as torch_cluster does (a Python scalar may become a multiplication by its reciprocal)
        cell = ((coord - start[batch]) / coord.new_full((coord.shape[1],), grid_size)).long()
        extent = cell.amax(0) + 1
        key = batch
        for axis in reversed(range(cell.shape[1])):  # z most significant after the event, x least
            key = key * extent[axis] + cell[:, axis]
        _, cluster, counts = torch.unique(key, sorted=True, return_inverse=True, return_counts=True)
    size = counts.numel()
    groups = Groups(cluster, size)
    pooled_coord = scatter_mean(coord, cluster, size)
    pooled_feat = groups.reduce(feat, "max")
    first = torch.cumsum(counts, 0) - counts
    pooled_batch = batch[groups.order[first]]
    pooled_offset = torch.cumsum(torch.bincount(pooled_batch, minlength=num_events), 0).to(offset.dtype)
    return pooled_coord, pooled_feat, pooled_offset, cluster
