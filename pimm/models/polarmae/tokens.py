"""Point-cloud tokens for PoLAr-MAE: padded batches, farthest-point seeds,
overlap suppression, ball groups and nearest neighbours, in plain torch.

Upstream runs these through pytorch3d's C++/CUDA kernels and a ``cnms``
extension; here every operation is a batched tensor op (the only Python
loops are over the number of samples drawn, never over points or events),
so the model runs anywhere torch does. The semantics follow pytorch3d's:
``-1`` marks padding in index tensors; a ball query returns the first
``K`` points inside the radius in index order; FPS starts at a random point
(drawn from torch's generator, so it is part of a run's resumable RNG state).
"""

from __future__ import annotations

import torch

__all__ = ["packed_to_padded", "padded_to_packed", "masked_gather", "farthest_points", "suppress_overlaps",
           "ball_query", "knn", "PointGrouping", "chamfer_distance"]


def packed_to_padded(feat: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(N, C)`` points of ``B`` events (``offset``: cumulative counts) ->
    ``(B, N_max, C)`` zero-padded, and each event's length."""
    lengths = torch.diff(offset, prepend=offset.new_zeros(1)).long()
    batch = torch.repeat_interleave(torch.arange(len(lengths), device=feat.device), lengths)
    position = torch.arange(len(feat), device=feat.device) - (offset.long() - lengths)[batch]
    out = feat.new_zeros(len(lengths), int(lengths.max()) if len(lengths) else 0, feat.shape[1])
    out[batch, position] = feat
    return out, lengths


def padded_to_packed(points: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    valid = torch.arange(points.shape[1], device=points.device) < lengths[:, None]
    return points[valid]


def masked_gather(points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``points`` (B, N, C) at ``idx`` (B, K) or (B, G, K); ``-1`` reads point 0."""
    flat = idx.clamp(min=0).reshape(idx.shape[0], -1)
    out = points.gather(1, flat.unsqueeze(-1).expand(-1, -1, points.shape[-1]))
    return out.reshape(*idx.shape, points.shape[-1])


@torch.no_grad()
def farthest_points(points: torch.Tensor, lengths: torch.Tensor, k: int, random_start: bool = True) -> torch.Tensor:
    """Indices (B, k) of ``k`` farthest-point samples of each event's first
    ``lengths`` points (xyz); ``-1`` beyond an event's length."""
    batch, count = points.shape[:2]
    xyz = points[..., :3].float()
    valid = torch.arange(count, device=points.device) < lengths[:, None]
    start = (torch.rand(batch, device=points.device) * lengths.float()).long() if random_start else \
        torch.zeros(batch, dtype=torch.long, device=points.device)
    # |x - c|^2 = |x|^2 + |c|^2 - 2 x.c: one batched matrix product a sample
    # instead of a subtract, square and sum over every point.
    norms = (xyz * xyz).sum(-1)
    nearest = torch.full((batch, count), float("inf"), device=points.device).masked_fill(~valid, -1.0)
    out = torch.empty(batch, k, dtype=torch.long, device=points.device)
    rows = torch.arange(batch, device=points.device)
    current = start.clamp(max=max(count - 1, 0))
    for i in range(k):
        out[:, i] = current
        chosen = xyz[rows, current]
        step = torch.baddbmm((norms + norms[rows, current, None]).unsqueeze(-1), xyz, chosen.unsqueeze(-1),
                             alpha=-2).squeeze(-1)
        nearest = torch.minimum(nearest, step)
        current = nearest.masked_fill(~valid, -1.0).argmax(1)
    return out.masked_fill(torch.arange(k, device=points.device) >= lengths[:, None], -1)


@torch.no_grad()
def suppress_overlaps(centers: torch.Tensor, lengths: torch.Tensor, radius: float, overlap_factor: float,
                      k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy non-maximum suppression of ball centres (upstream's C-NMS): in
    order, a centre closer than ``2 * radius * overlap_factor`` to one already
    kept is dropped. Returns the kept centres first (B, k, 3) and their count."""
    batch, count = centers.shape[:2]
    valid = torch.arange(count, device=centers.device) < lengths[:, None]
    close = torch.cdist(centers.float(), centers.float()) < 2 * radius * overlap_factor
    keep = torch.zeros_like(valid)
    suppressed = ~valid
    for i in range(count):
        take = ~suppressed[:, i]
        keep[:, i] = take
        suppressed |= close[:, i] & take[:, None]
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :k]
    kept = keep.sum(1).clamp(max=k)
    out = masked_gather(centers, order)
    return out * (torch.arange(order.shape[1], device=centers.device) < kept[:, None]).unsqueeze(-1), kept


@torch.no_grad()
def ball_query(centers: torch.Tensor, center_lengths: torch.Tensor, points: torch.Tensor,
               point_lengths: torch.Tensor, k: int, radius: float) -> torch.Tensor:
    """Indices (B, G, k) of the first ``k`` points (in index order) within
    ``radius`` of each centre; ``-1`` where fewer, and for padding centres."""
    count = points.shape[1]
    inside = torch.cdist(centers[..., :3].float(), points[..., :3].float()) < radius
    inside &= (torch.arange(count, device=points.device) < point_lengths[:, None]).unsqueeze(1)
    inside &= (torch.arange(centers.shape[1], device=points.device) < center_lengths[:, None]).unsqueeze(-1)
    key = torch.where(inside, torch.arange(count, device=points.device), count + torch.arange(count,
                                                                                            device=points.device))
    first = key.topk(min(k, count), dim=-1, largest=False).values
    idx = torch.where(first < count, first, torch.full_like(first, -1))
    if idx.shape[-1] < k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], k - idx.shape[-1]), -1)], dim=-1)
    return idx


def knn(query: torch.Tensor, query_lengths: torch.Tensor, points: torch.Tensor, point_lengths: torch.Tensor,
        k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared distances and indices (B, Q, k) of each query's ``k`` nearest points."""
    dist = torch.cdist(query[..., :3].float(), points[..., :3].float()) ** 2
    dist = dist.masked_fill(~(torch.arange(points.shape[1], device=points.device)
                              < point_lengths[:, None]).unsqueeze(1), float("inf"))
    values, idx = dist.topk(min(k, points.shape[1]), dim=-1, largest=False)
    return values, idx


def chamfer_distance(x: torch.Tensor, y: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Symmetric Chamfer distance of squared distances between the first
    ``lengths[i]`` points of ``x[i]`` and ``y[i]``, each direction averaged over
    points then over the batch (pytorch3d's default reductions)."""
    dist = torch.cdist(x.float(), y.float()) ** 2
    valid_x = torch.arange(x.shape[1], device=x.device) < lengths[:, None]
    valid_y = torch.arange(y.shape[1], device=y.device) < lengths[:, None]
    big = torch.finfo(dist.dtype).max
    to_y = dist.masked_fill(~valid_y.unsqueeze(1), big).min(2).values * valid_x
    to_x = dist.masked_fill(~valid_x.unsqueeze(2), big).min(1).values * valid_y
    count = lengths.clamp(min=1).float()
    return ((to_y.sum(1) / count).mean() + (to_x.sum(1) / count).mean())


class PointGrouping(torch.nn.Module):
    """Events -> tokens: FPS seeds, overlap suppression, ball groups of up to
    ``group_upscale_points`` thinned by FPS to ``group_max_points``, coordinates
    relative to the group's centre divided by the radius (upstream's
    ``PointcloudGrouping`` arguments and outputs)."""

    def __init__(self, num_groups: int, context_length: int, group_max_points: int, group_radius: float,
                 group_upscale_points: int, overlap_factor: float, reduction_method: str = "fps",
                 rescale_by_group_radius: bool | float = True):
        super().__init__()
        self.num_groups, self.context_length = num_groups, context_length
        self.group_max_points, self.group_radius = group_max_points, group_radius
        self.group_upscale_points, self.overlap_factor = group_upscale_points, overlap_factor
        self.reduction_method = reduction_method
        self.rescale = group_radius if rescale_by_group_radius is True else float(rescale_by_group_radius or 0)

    def forward(self, points: torch.Tensor, lengths: torch.Tensor) -> dict:
        seeds = farthest_points(points, lengths, self.num_groups)
        seed_xyz = masked_gather(points[..., :3], seeds)
        centers, count = suppress_overlaps(seed_xyz, seeds.ne(-1).sum(1), self.group_radius, self.overlap_factor,
                                           self.num_groups)
        count = count.clamp(max=self.context_length)
        centers = centers[:, :self.context_length]
        idx = ball_query(centers, count, points, lengths, self.group_upscale_points, self.group_radius)
        if self.reduction_method == "fps" and idx.shape[-1] > self.group_max_points:
            idx = self._thin(points, idx)
        idx = idx[..., :self.group_max_points]
        filled = torch.where(idx.eq(-1), idx[..., :1].clamp(min=0), idx)  # pad with the group's first point
        groups = masked_gather(points, filled)
        point_mask = idx.ne(-1)
        token_mask = point_mask.any(-1)
        groups = torch.cat([groups[..., :3] - centers.unsqueeze(2), groups[..., 3:]], dim=-1)
        if self.rescale:
            groups = torch.cat([groups[..., :3] / self.rescale, groups[..., 3:]], dim=-1)
        groups = groups * token_mask[..., None, None]
        return dict(groups=groups, centers=centers, embedding_mask=token_mask, point_mask=point_mask, idx=idx)

    def _thin(self, points: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        batch, groups, big = idx.shape
        members = masked_gather(points, idx).reshape(batch * groups, big, -1)
        chosen = farthest_points(members, idx.ne(-1).sum(-1).reshape(-1), self.group_max_points)
        picked = idx.reshape(batch * groups, big).gather(1, chosen.clamp(min=0))
        return picked.masked_fill(chosen.eq(-1), -1).reshape(batch, groups, self.group_max_points)
