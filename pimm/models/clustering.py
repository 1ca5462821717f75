"""Grouping points into instances, for the instance models of
:mod:`pimm.models.instance` and :mod:`pimm.models.instance_affinity`.

Both models cluster per event and per predicted class in two stages:

1. *fragments* (:func:`vote_fragments`): connected components of the
   26-neighbour voxel graph, an edge kept only where the two voxels' centroid
   votes (``coord + offset``) agree within ``agree_radius`` and, when given,
   an extra per-edge test passes (the affinity model's learned affinity).
   Following voxels along a track is robust even when a long track's votes
   are imprecise, while particles touching at a vertex are cut apart.
2. *merging* the fragments, either by hashing their mean votes
   (:func:`merge_by_votes`, PointGroupLite: fragments whose votes fall within
   ``merge_radius`` join) or by average-linkage agglomeration on a learned
   pairwise affinity (:func:`average_linkage`): two clusters join while the
   mean affinity over all their point pairs is above a threshold. The
   affinity is trained as the probability that two points belong to one
   instance, so 0.5 is its natural threshold.
3. optionally (``absorb_points``), clusters of a few points join the larger
   cluster they touch most (:func:`absorb_small_clusters`): a few voxels of
   a particle predicted as another class are not a particle of their own.

Everything is tensor code: no Python loop over points or voxels (only over
events, and over agglomeration rounds, each of which merges many clusters).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pimm.utils.errors import ConfigError

from .point_ops import connected_components, event_grid_coord, neighbor_pairs, scatter_mean, voxelize

__all__ = [
    "absorb_small_clusters",
    "average_linkage",
    "cluster_instances",
    "compact_labels",
    "drop_small_clusters",
    "finish_labels",
    "merge_by_votes",
    "per_class",
    "radius_table",
    "vote_fragments",
]

NEIGHBORS_26 = torch.tensor([[x, y, z] for x in (-1, 0, 1) for y in (-1, 0, 1) for z in (-1, 0, 1)
                             if (x, y, z) != (0, 0, 0)])


def compact_labels(labels: torch.Tensor) -> torch.Tensor:
    """Relabel to 0..K-1 keeping the order of the original ids."""
    return torch.unique(labels, return_inverse=True)[1]


def per_class(value: float | Sequence[float], num_classes: int, like: torch.Tensor) -> torch.Tensor:
    """A parameter per class as a tensor (a scalar applies to every class)."""
    if isinstance(value, (int, float)):
        return like.new_full((num_classes,), float(value))
    values = like.new_tensor([float(v) for v in value])
    if len(values) < num_classes:
        raise ConfigError(f"clustering: {len(values)} per-class values for {num_classes} classes; "
                          "give one per class or a single number")
    return values[:num_classes]


def radius_table(value, num_events: int, num_classes: int, like: torch.Tensor) -> torch.Tensor:
    """A radius per (event, class) graph, flat ``(num_events * num_classes,)``
    indexed by ``event * num_classes + class``: from one value (every class),
    one per class, or a ``(num_events, classes)`` tensor (per event and class,
    for a policy that chooses radii event by event)."""
    if isinstance(value, torch.Tensor) and value.dim() == 2:
        if value.shape[0] != num_events or value.shape[1] < num_classes:
            raise ConfigError(f"cluster_instances: per-event radii of shape {tuple(value.shape)} for "
                              f"{num_events} events and {num_classes} classes")
        return value[:, :num_classes].to(like).reshape(-1)
    return per_class(value, num_classes, like).repeat(num_events)


def thing_points(semantic: torch.Tensor, stuff_classes: Sequence[int]) -> torch.Tensor:
    """Indices of the points whose class can hold instances."""
    stuff = torch.tensor(list(stuff_classes), dtype=semantic.dtype, device=semantic.device)
    return torch.nonzero(~torch.isin(semantic, stuff)).squeeze(1)


def vote_fragments(
    coord: torch.Tensor,
    votes: torch.Tensor,
    group: torch.Tensor,
    grid_size: float,
    agree_radius: torch.Tensor,
    edge_test: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Stage 1: fragment id of every point (0..F-1).

    ``group`` (N,) separates graphs (event x class); ``agree_radius`` is the
    vote-agreement radius per point's group class, given per *point*
    ``(N,)``. ``edge_test(inverse, a, b)`` may veto more edges: ``a, b`` are
    adjacent voxels and ``inverse`` maps points to voxels.
    """
    vgrid, vgroup, inverse = voxelize(event_grid_coord(coord, group, grid_size), group)
    num_voxels = vgrid.shape[0]
    vvote = scatter_mean(votes, inverse, num_voxels)
    vradius = torch.zeros(num_voxels, dtype=votes.dtype, device=votes.device).scatter_(0, inverse, agree_radius)
    a, b, _ = neighbor_pairs(vgrid, vgroup, NEIGHBORS_26.to(vgrid.device))
    keep = (vvote[a] - vvote[b]).norm(dim=1) <= vradius[a]
    if edge_test is not None:
        keep &= edge_test(inverse, a, b)
    return compact_labels(connected_components(num_voxels, a[keep], b[keep]))[inverse]


def merge_by_votes(frag: torch.Tensor, votes: torch.Tensor, group: torch.Tensor,
                   merge_radius: torch.Tensor) -> torch.Tensor:
    """Stage 2 of PointGroupLite: join fragments whose mean votes fall in the
    same or adjacent hash cells of their graph's ``merge_radius`` (one per
    group id, :func:`radius_table`). Returns the merged id of every fragment."""
    num_frag = int(frag.max()) + 1
    fgroup = torch.zeros(num_frag, dtype=group.dtype, device=group.device).scatter_(0, frag, group)
    fvote = scatter_mean(votes, frag, num_frag) / merge_radius[fgroup, None]
    cgrid, cgroup, cell_of_frag = voxelize(event_grid_coord(fvote, fgroup, 1.0), fgroup)
    ca, cb, _ = neighbor_pairs(cgrid, cgroup, NEIGHBORS_26.to(cgrid.device))
    # Graph nodes: fragments [0, F) then cells [F, F + C).
    src = torch.cat([torch.arange(num_frag, device=frag.device), ca + num_frag])
    dst = torch.cat([cell_of_frag + num_frag, cb + num_frag])
    return connected_components(num_frag + cgrid.shape[0], src, dst)[:num_frag]


def average_linkage(pair_sums: torch.Tensor, sizes: torch.Tensor, can_merge: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """Average-linkage agglomeration with a stopping threshold.

    Args:
        pair_sums: (F, F) sum of the pairwise affinity over all point pairs of
            fragments i and j (symmetric).
        sizes: (F,) points per fragment.
        can_merge: (F, F) bool, False between fragments that must stay apart
            (other event or class).
        threshold: clusters join while their mean pair affinity exceeds it.

    Average linkage is *reducible*, so merging every pair of mutual nearest
    neighbours at once gives the same clusters as joining the best pair one at
    a time; each round is a handful of tensor ops over the (F, F) table of
    sums, which stays exact under merging (the sums of a union add up).
    Returns (F,) cluster ids (0..C-1).
    """
    num = sizes.shape[0]
    device = sizes.device
    labels = torch.arange(num, device=device)
    sums, count, allowed = pair_sums.clone(), sizes.to(pair_sums.dtype), can_merge.clone()
    allowed.fill_diagonal_(False)
    while count.numel() > 1:
        mean = sums / (count[:, None] * count[None, :])
        mean = torch.where(allowed, mean, torch.full_like(mean, -torch.inf))
        best_value, best = mean.max(dim=1)
        rows = torch.arange(count.numel(), device=device)
        mutual = (best[best] == rows) & (best_value > threshold)
        if not bool(mutual.any()):
            break
        # Each mutual pair joins under its smaller index.
        target = torch.where(mutual, torch.minimum(rows, best), rows)
        new_id = compact_labels(target)
        size = int(new_id.max()) + 1
        labels = new_id[labels]
        sums = sums.new_zeros(size, count.numel()).index_add_(0, new_id, sums)
        sums = sums.new_zeros(size, size).index_add_(1, new_id, sums)
        count = count.new_zeros(size).index_add_(0, new_id, count)
        allowed = _merge_mask(allowed, new_id, size)
    return labels


def _merge_mask(allowed: torch.Tensor, new_id: torch.Tensor, size: int) -> torch.Tensor:
    """The can-merge table after joining: two clusters may merge only if every
    pair of their members could (events and classes never mix)."""
    forbidden = (~allowed).to(torch.float32)
    forbidden.fill_diagonal_(0.0)
    forbidden = forbidden.new_zeros(size, forbidden.shape[1]).index_add_(0, new_id, forbidden)
    forbidden = forbidden.new_zeros(size, size).index_add_(1, new_id, forbidden)
    merged = forbidden == 0
    merged.fill_diagonal_(False)
    return merged


def finish_labels(labels: torch.Tensor, idx: torch.Tensor, num_points: int, min_points: int) -> torch.Tensor:
    """Scatter the labels of the clustered points ``idx`` into an (N,) tensor,
    -1 for other points and clusters below ``min_points``, ids compacted."""
    labels = compact_labels(labels)
    keep = torch.bincount(labels)[labels] >= min_points
    out = torch.full((num_points,), -1, dtype=torch.long, device=labels.device)
    out[idx] = torch.where(keep, labels, torch.full_like(labels, -1))
    valid = out >= 0
    out[valid] = compact_labels(out[valid])
    return out


def drop_small_clusters(labels: torch.Tensor, point_min: torch.Tensor) -> torch.Tensor:
    """Unassign (-1) the clusters smaller than their threshold: ``point_min``
    (N,) gives one per point, a cluster uses the smallest among its points.
    Ids are compacted."""
    out = labels.clone()
    valid = torch.nonzero(labels >= 0).squeeze(1)
    if valid.numel() == 0:
        return out
    lab = compact_labels(labels[valid])
    num = int(lab.max()) + 1
    need = torch.full((num,), torch.inf, dtype=point_min.dtype, device=lab.device)
    need.scatter_reduce_(0, lab, point_min[valid], reduce="amin")
    keep = torch.bincount(lab, minlength=num).to(need.dtype) >= need
    out[valid] = torch.where(keep[lab], lab, torch.full_like(lab, -1))
    kept = out >= 0
    out[kept] = compact_labels(out[kept])
    return out


def cluster_instances(
    coord: torch.Tensor,
    shifted: torch.Tensor,
    semantic: torch.Tensor,
    batch: torch.Tensor,
    grid_size: float,
    agree_radius: float | Sequence[float] | torch.Tensor,
    merge_radius: float | Sequence[float] | torch.Tensor,
    min_points: int | Sequence[int] = 1,
    stuff_classes: Sequence[int] = (),
    absorb_points: int = 0,
) -> torch.Tensor:
    """PointGroupLite's grouping: vote fragments merged by vote hashing.

    Args:
        coord: (N,3) point positions; ``grid_size`` is their voxel edge.
        shifted: (N,3) centroid votes (``coord + offset_pred``).
        semantic: (N,) predicted class; instances never span two classes.
        batch: (N,) event index; instances never span two events.
        agree_radius, merge_radius: one value, one per class (showers are
            diffuse and their votes scatter more than a track's), or a
            ``(events, classes)`` tensor: one per event and class (a policy
            choosing radii event by event, :mod:`pimm.models.grpo.cluster_policy`).
        min_points: clusters with fewer points are unassigned (-1); one
            number or one per class (a cluster holding several classes after
            absorption uses the smallest of theirs). Applied after absorption.
        absorb_points: clusters of at most this many points then join the
            larger cluster they touch most, whatever its class
            (:func:`absorb_small_clusters`); 0: off.

    Returns (N,) long instance ids, unique across the batch, -1 = unassigned.
    """
    idx = thing_points(semantic, stuff_classes)
    if idx.numel() == 0:
        return torch.full_like(semantic, -1)
    num_classes = int(semantic.max()) + 1
    group = batch[idx] * num_classes + semantic[idx]  # one graph per (event, class)
    votes = shifted[idx]
    num_events = int(batch.max()) + 1
    agree_r = radius_table(agree_radius, num_events, num_classes, votes)
    merge_r = radius_table(merge_radius, num_events, num_classes, votes)
    frag = vote_fragments(coord[idx], votes, group, grid_size, agree_r[group])
    merged = merge_by_votes(frag, votes, group, merge_r)
    labels = finish_labels(merged[frag], idx, semantic.shape[0], 1)
    labels = absorb_small_clusters(coord, labels, batch, grid_size, absorb_points)
    return drop_small_clusters(labels, per_class(min_points, num_classes, votes)[semantic])


def absorb_small_clusters(coord: torch.Tensor, labels: torch.Tensor, batch: torch.Tensor, grid_size: float,
                          max_points: int) -> torch.Tensor:
    """Join every cluster of at most ``max_points`` points to the larger
    cluster it touches most (26-neighbour voxel contacts, any class).

    A few voxels of a particle predicted as another class (a muon's voxels
    called Michel or delta) form a separate small cluster, which is a false
    instance and splits the true one; joining it to the particle it sits on
    repairs both. Clusters that touch no larger cluster stay as they are.
    ``labels`` (N,) are instance ids unique across the batch, -1 = none
    (such points neither absorb nor are absorbed). One round: a small
    cluster never joins another small one. Returns (N,) ids.
    """
    if max_points < 1:
        return labels
    idx = torch.nonzero(labels >= 0).squeeze(1)
    if idx.numel() == 0:
        return labels
    lab = compact_labels(labels[idx])
    size = torch.bincount(lab)
    vgrid, vbatch, inverse = voxelize(event_grid_coord(coord[idx], batch[idx], grid_size), batch[idx])
    # Each voxel takes the label of (one of) its points.
    vlab = torch.empty(vgrid.shape[0], dtype=lab.dtype, device=lab.device).scatter_(0, inverse, lab)
    a, b, _ = neighbor_pairs(vgrid, vbatch, NEIGHBORS_26.to(vgrid.device))
    la, lb = vlab[a], vlab[b]
    touch = (la != lb) & (size[la] <= max_points) & (size[lb] > size[la])
    if not bool(touch.any()):
        return labels
    num = int(size.numel())
    # Contacts per (small cluster, neighbour); each small cluster picks the
    # neighbour with most contacts (ties: the larger neighbour id).
    pair, count = torch.unique(la[touch] * num + lb[touch], return_counts=True)
    small, target = pair // num, pair % num
    best = torch.full((num,), -1, dtype=torch.long, device=lab.device)
    best.scatter_reduce_(0, small, count * num + target, reduce="amax")
    new = torch.where(best >= 0, best % num, torch.arange(num, device=lab.device))
    out = labels.clone()
    out[idx] = compact_labels(new[lab])
    return out
