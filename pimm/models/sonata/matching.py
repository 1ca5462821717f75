"""The tensor operations of Sonata's losses in plain PyTorch (upstream uses
pointops and torch_scatter): nearest-neighbour matching between views,
Sinkhorn-Knopp targets, the patch masks, and per-view loss averaging."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["match_nearest", "sinkhorn_knopp", "patch_mask", "mean_per_segment", "segment_bounds"]

# Rows of a distance block: bounds the memory of one cdist call.
_BLOCK_ELEMENTS = 1 << 24


def segment_bounds(offset: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` of the segments of cumulative ``offset``."""
    ends = offset.tolist()
    return list(zip([0] + ends[:-1], ends))


@torch.no_grad()
def match_nearest(query: torch.Tensor, query_offset: torch.Tensor, target: torch.Tensor,
                  target_offset: torch.Tensor, max_r: float) -> torch.Tensor:
    """``(M, 2)`` pairs ``[query index, target index]``: each query point's
    nearest target point of the same segment (segment ``i`` of
    ``query_offset`` searches segment ``i`` of ``target_offset``), kept when
    closer than ``max_r`` (Euclidean)."""
    if len(query_offset) != len(target_offset):
        raise ValueError(f"match_nearest: {len(query_offset)} query segments but {len(target_offset)} target ones")
    pairs = []
    for (qs, qe), (ts, te) in zip(segment_bounds(query_offset), segment_bounds(target_offset)):
        if qe <= qs or te <= ts:
            continue
        tgt = target[ts:te].float()
        rows = max(1, _BLOCK_ELEMENTS // (te - ts))
        for start in range(qs, qe, rows):
            stop = min(qe, start + rows)
            dist_block = torch.cdist(query[start:stop].float(), tgt)
            best, index = dist_block.min(dim=1)
            keep = best < max_r
            q_index = torch.arange(start, stop, device=query.device)[keep]
            pairs.append(torch.stack([q_index, index[keep] + ts], dim=1))
    if not pairs:
        return torch.zeros((0, 2), dtype=torch.long, device=query.device)
    return torch.cat(pairs, dim=0)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@torch.no_grad()
def sinkhorn_knopp(logits: torch.Tensor, temp: float, num_iter: int = 3) -> torch.Tensor:
    """Balanced soft assignments of ``logits`` (N, K) to the K prototypes:
    rows of the result sum to 1 and, over all ranks, every prototype receives
    the same total mass (SwAV / DINOv2 centering)."""
    scaled = logits.float() / temp
    # One constant shift cancels in the first normalisation; it keeps exp finite
    # (shared across ranks so every rank divides by the same total).
    shift = scaled.max() if scaled.numel() else scaled.new_zeros(())
    if _world_size() > 1:
        dist.all_reduce(shift, op=dist.ReduceOp.MAX)
    q = torch.exp(scaled - shift).t()  # (K, N)
    k = q.shape[0]
    n, total = q.new_tensor(float(q.shape[1])), q.sum()
    if _world_size() > 1:
        both = torch.stack([n, total])
        dist.all_reduce(both)
        n, total = both[0], both[1]
    q = q / total
    for _ in range(num_iter):
        rows = q.sum(dim=1, keepdim=True)
        if _world_size() > 1:
            dist.all_reduce(rows)
        q = q / rows / k
        q = q / q.sum(dim=0, keepdim=True) / n
    return (q * n).t()


@torch.no_grad()
def patch_mask(coord: torch.Tensor, batch: torch.Tensor, size: float, ratio: float,
               generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask whole cubic patches of edge ``size`` (cut per event from its own
    minimum corner): ``int(patches * ratio)`` of them, drawn at random.
    Returns the point mask (N,) bool and each point's patch index (N,)."""
    num = int(batch.max()) + 1 if batch.numel() else 0
    low = torch.full((num, coord.shape[1]), float("inf"), dtype=coord.dtype, device=coord.device)
    low = low.scatter_reduce(0, batch.unsqueeze(1).expand_as(coord), coord, reduce="amin")
    cells = torch.div(coord - low[batch], size, rounding_mode="floor").long()
    keys = torch.cat([batch.unsqueeze(1), cells], dim=1)
    _, patch = torch.unique(keys, dim=0, sorted=True, return_inverse=True)
    patches = int(patch.max()) + 1 if patch.numel() else 0
    chosen = torch.randperm(patches, device=coord.device, generator=generator)[: int(patches * ratio)]
    return torch.isin(patch, chosen), patch


def mean_per_segment(values: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` within each segment id, then over ids ``0..max``
    (an id without values counts as 0, as upstream's ``segment_coo``)."""
    size = int(segment.max()) + 1
    sums = values.new_zeros(size).index_add(0, segment, values)
    counts = torch.bincount(segment, minlength=size).clamp(min=1).to(values.dtype)
    return (sums / counts).mean()
