"""PointGroupAffinity: centroid votes plus a learned pairwise affinity, so that
instances are grouped by what the network has learned to call "the same
particle" rather than by fixed distance thresholds on imprecise votes.

Why: PointGroupLite's votes (coord + offset) are off by tens of voxels on
showers and long tracks, so fixed merge radii either leave shower pieces apart
or join neighbouring particles. Here every point also gets a small free
embedding ``g`` and each class a learned vote bandwidth ``sigma``; the
affinity of two points is

    p(i, j) = exp(-|v_i - v_j|^2 / (sigma_i sigma_j) - |g_i - g_j|^2)

with ``v`` the votes, trained with binary cross-entropy as the probability
that the two points belong to one instance (pairs: random pairs of points of
one event and class, and adjacent voxels). The offsets keep their L1 +
direction loss, and the affinity loss also pulls the votes of one instance
together.

Clustering (:mod:`pimm.models.clustering`), per event and predicted class:
fragments along voxel adjacency where votes agree and the adjacent affinity is
above ``fragment_affinity`` (an over-segmentation), then average-linkage
agglomeration of the fragments on the exact mean affinity of their point pairs
until no two clusters have a mean above ``merge_affinity`` (0.5: "more likely
the same than not").

Status: experimental, no shipped config. In trials on the default LArTPC
events it stayed below PointGroupLite (val ARI 0.19-0.41 against 0.64 at step
150); kept, with its unit tests, as a starting point for a learned grouping.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from .clustering import NEIGHBORS_26, average_linkage, finish_labels, per_class, thing_points, vote_fragments
from .instance import centroid_offset_loss, instance_centroid_offsets, make_offset_head
from .losses import CriteriaFitLogits, build_criteria
from .point_ops import event_grid_coord, neighbor_pairs, offset2batch, voxelize
from .segmentors import build_backbone
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import Int, Length, MAX_SIZE, PosInt, Prob, Registered, Seq, Size, Weight

__all__ = ["PointGroupAffinity", "pair_affinity_logit", "affinity_pair_loss", "sample_partner_pairs"]


def pair_affinity_logit(votes: torch.Tensor, embed: torch.Tensor, bandwidth: torch.Tensor, i: torch.Tensor,
                        j: torch.Tensor) -> torch.Tensor:
    """``-log p(i, j)`` (the squared embedding distance) of the pairs ``(i, j)``."""
    vote_d2 = (votes[i] - votes[j]).pow(2).sum(1) / (bandwidth[i] * bandwidth[j])
    return vote_d2 + (embed[i] - embed[j]).pow(2).sum(1)


def affinity_pair_loss(dist2: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of ``p = exp(-dist2)`` against ``same``; positives
    and negatives are averaged separately and added, so that neither kind of
    pair drowns the other."""
    pos = dist2[same]
    # -log(1 - exp(-d2)); the clamp bounds it at ~9 when two points coincide.
    neg = -torch.log(-torch.expm1(-dist2[~same].clamp_min(1e-4)))
    zero = dist2.sum() * 0.0
    return (pos.mean() if pos.numel() else zero) + (neg.mean() if neg.numel() else zero)


def sample_partner_pairs(group: torch.Tensor, per_point: int, generator: torch.Generator | None = None):
    """``per_point`` random partners for every point, drawn uniformly among the
    points of the same ``group`` (itself included). Returns ``(i, j)``."""
    order = torch.argsort(group, stable=True)
    _, counts = torch.unique_consecutive(group[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    group_of_sorted = torch.repeat_interleave(torch.arange(counts.numel(), device=group.device), counts)
    n = group.numel()
    u = torch.rand(per_point, n, generator=generator, device=group.device)
    pick = starts[group_of_sorted] + (u * counts[group_of_sorted]).long().clamp_max(counts[group_of_sorted] - 1)
    i = order.repeat(per_point)
    return i, order[pick.view(-1)]


def adjacent_pairs(coord: torch.Tensor, group: torch.Tensor, grid_size: float):
    """Pairs of points in 26-adjacent voxels of one ``group`` (one representative point per voxel)."""
    vgrid, vgroup, inverse = voxelize(event_grid_coord(coord, group, grid_size), group)
    rep = torch.full((vgrid.shape[0],), coord.shape[0], dtype=torch.long, device=coord.device)
    rep = rep.scatter_reduce(0, inverse, torch.arange(coord.shape[0], device=coord.device), reduce="amin")
    a, b, _ = neighbor_pairs(vgrid, vgroup, NEIGHBORS_26.to(vgrid.device))
    return rep[a], rep[b]


@MODELS.register_module()
class PointGroupAffinity(nn.Module):
    """Backbone + semantic, centroid-offset and embedding heads; affinity
    clustering at eval (see the module docstring).

    Args:
        backbone, num_classes, criteria, grid_size, offset_scale,
            offset_weight, direction_weight: as :class:`PointGroupLite`.
        embed_dim: free embedding dimensions next to the votes.
        vote_bandwidth: initial per-class bandwidth (coordinate units) of the
            vote distance in the affinity; learned.
        affinity_weight: weight of the pairwise affinity loss.
        pairs_per_point: random same-event, same-class partners per point.
        agree_radius: fragment edges need votes within this (per class).
        fragment_affinity: fragment edges need an affinity above this.
        merge_affinity: clusters join while their mean pair affinity is above it.
        max_linkage_points: the mean affinities of an event larger than this
            are estimated on an evenly spaced subset of its points (memory
            grows with the square of the points).
        min_points, stuff_classes: as :class:`PointGroupLite`.

    ``forward`` returns ``seg_logits``, ``offset_pred``, ``embedding``,
    ``loss`` (when ``segment`` and ``instance`` are given) and, in eval mode,
    ``instance_pred``.
    """

    domains = dict(backbone=Registered("model"), num_classes=Int(1, MAX_SIZE),
                   criteria=Seq(Registered("loss")) | None, grid_size=Length, offset_scale=Length,
                   offset_weight=Weight, direction_weight=Weight, embed_dim=Size, vote_bandwidth=Length,
                   affinity_weight=Weight, pairs_per_point=Int(1, 1024), agree_radius=Length | Seq(Length, min_len=1),
                   fragment_affinity=Prob, merge_affinity=Prob, max_linkage_points=Int(1, 10**7), min_points=PosInt,
                   stuff_classes=Seq(Int(0, MAX_SIZE)))
    output_classes = answers_with("num_classes")  # the columns of seg_logits
    domain_rules = (CriteriaFitLogits(),)

    def __init__(
        self,
        backbone: dict,
        num_classes: int,
        criteria: Sequence[dict] | None = None,
        grid_size: float = 1.0,
        offset_scale: float = 50.0,
        offset_weight: float = 1.0,
        direction_weight: float = 1.0,
        embed_dim: int = 4,
        vote_bandwidth: float = 20.0,
        affinity_weight: float = 1.0,
        pairs_per_point: int = 4,
        agree_radius: float | Sequence[float] = 6.0,
        fragment_affinity: float = 0.5,
        merge_affinity: float = 0.5,
        max_linkage_points: int = 6000,
        min_points: int = 1,
        stuff_classes: Sequence[int] = (),
    ):
        super().__init__()
        name = "PointGroupAffinity"
        if int(num_classes) < 1:
            raise ConfigError(f"{name}: num_classes must be >= 1, got {num_classes}")
        radii = list(agree_radius) if isinstance(agree_radius, (list, tuple)) else [agree_radius]
        if min([grid_size, offset_scale, vote_bandwidth] + radii) <= 0:
            raise ConfigError(f"{name}: grid_size, offset_scale, vote_bandwidth and agree_radius must be > 0")
        for key, value in (("fragment_affinity", fragment_affinity), ("merge_affinity", merge_affinity)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}: {key} is a probability threshold in [0, 1), got {value}")
        if int(embed_dim) < 0 or int(pairs_per_point) < 1 or int(max_linkage_points) < 2:
            raise ConfigError(f"{name}: embed_dim >= 0, pairs_per_point >= 1 and max_linkage_points >= 2 needed")
        self.num_classes = int(num_classes)
        self.backbone, width = build_backbone(backbone, name)
        self.seg_head = nn.Linear(width, self.num_classes)
        self.offset_head = make_offset_head(width)
        self.embed_dim = int(embed_dim)
        self.embed_head = nn.Sequential(nn.Linear(width, width, bias=False), nn.BatchNorm1d(width), nn.ReLU(),
                                        nn.Linear(width, max(self.embed_dim, 1)))
        self.log_bandwidth = nn.Parameter(torch.full((self.num_classes,), math.log(vote_bandwidth)))
        self.criteria = build_criteria(criteria or [dict(type="CrossEntropyLoss", ignore_index=-1)], int(num_classes))
        self.grid_size, self.offset_scale = float(grid_size), float(offset_scale)
        self.offset_weight, self.direction_weight = float(offset_weight), float(direction_weight)
        self.affinity_weight, self.pairs_per_point = float(affinity_weight), int(pairs_per_point)
        self.agree_radius = tuple(agree_radius) if isinstance(agree_radius, (list, tuple)) else float(agree_radius)
        self.fragment_affinity, self.merge_affinity = float(fragment_affinity), float(merge_affinity)
        self.max_linkage_points = int(max_linkage_points)
        self.min_points = int(min_points)
        self.stuff_classes = tuple(int(c) for c in stuff_classes)

    def _embed(self, feat: torch.Tensor) -> torch.Tensor:
        embed = self.embed_head(feat)
        return embed if self.embed_dim else embed * 0.0

    def affinity_loss(self, coord, offset_pred, embed, segment, instance, batch) -> torch.Tensor:
        valid = torch.nonzero(instance >= 0).squeeze(1)
        if valid.numel() < 2:
            return embed.sum() * 0.0
        # The votes enter the affinity detached: the offsets learn from their own
        # loss only (an unbounded pull on far-apart votes of long tracks
        # otherwise swamps the backbone's gradients); the affinity loss trains
        # the embedding and the bandwidths.
        votes, emb = (coord + offset_pred.detach())[valid], embed[valid]
        sem = segment[valid].clamp(0, self.num_classes - 1)
        inst = instance[valid]
        bandwidth = self.log_bandwidth.exp()[sem]
        group = batch[valid] * self.num_classes + sem
        ri, rj = sample_partner_pairs(group, self.pairs_per_point)
        ai, aj = adjacent_pairs(coord[valid], batch[valid], self.grid_size)
        i, j = torch.cat([ri, ai]), torch.cat([rj, aj])
        keep = i != j
        i, j = i[keep], j[keep]
        same = (inst[i] == inst[j]) & (batch[valid][i] == batch[valid][j])
        dist2 = pair_affinity_logit(votes, emb, bandwidth, i, j)
        return affinity_pair_loss(dist2, same)

    def forward(self, input_dict: dict) -> dict[str, torch.Tensor]:
        feat = self.backbone(input_dict)
        seg_logits = self.seg_head(feat)
        offset_pred = self.offset_head(feat) * self.offset_scale
        embed = self._embed(feat)
        out = {"seg_logits": seg_logits, "offset_pred": offset_pred, "embedding": embed}
        coord = input_dict["coord"]
        batch = offset2batch(input_dict["offset"].to(coord.device))
        if "segment" in input_dict and "instance" in input_dict:
            segment, instance = input_dict["segment"].long(), input_dict["instance"].long()
            target, valid = instance_centroid_offsets(coord, instance, batch)
            out["loss"] = (
                self.criteria(seg_logits, segment)
                + centroid_offset_loss(offset_pred, target, valid, self.offset_scale, self.offset_weight,
                                       self.direction_weight)
                + self.affinity_weight * self.affinity_loss(coord, offset_pred, embed, segment, instance, batch)
            )
        if not self.training:
            with torch.no_grad():
                out["instance_pred"] = self.cluster(coord, offset_pred, embed, seg_logits.argmax(1), batch)
        return out

    @torch.no_grad()
    def cluster(self, coord: torch.Tensor, offset_pred: torch.Tensor, embed: torch.Tensor, semantic: torch.Tensor,
                batch: torch.Tensor) -> torch.Tensor:
        """(N,) instance ids (unique across the batch, -1 unassigned)."""
        idx = thing_points(semantic, self.stuff_classes)
        if idx.numel() == 0:
            return torch.full_like(semantic, -1)
        sem, event = semantic[idx], batch[idx]
        votes, emb = (coord + offset_pred)[idx], embed[idx]
        bandwidth = self.log_bandwidth.exp()[sem]
        group = event * self.num_classes + sem
        agree = per_class(self.agree_radius, self.num_classes, votes)[sem]

        def affine_edges(inverse, a, b):
            rep = torch.full((int(inverse.max()) + 1,), idx.numel(), dtype=torch.long, device=inverse.device)
            rep = rep.scatter_reduce(0, inverse, torch.arange(idx.numel(), device=inverse.device), reduce="amin")
            dist2 = pair_affinity_logit(votes, emb, bandwidth, rep[a], rep[b])
            return torch.exp(-dist2) > self.fragment_affinity

        frag = vote_fragments(coord[idx], votes, group, self.grid_size, agree, affine_edges)
        return finish_labels(self.merge_fragments(frag, votes, emb, bandwidth, group, event), idx,
                             semantic.shape[0], self.min_points)

    def merge_fragments(self, frag, votes, emb, bandwidth, group, event) -> torch.Tensor:
        """Average-linkage merging of the fragments, event by event (fragment
        ids of one event are contiguous: they are numbered in (event, class,
        position) order). Returns the merged label of every point."""
        num_frag = int(frag.max()) + 1
        fgroup = torch.zeros(num_frag, dtype=group.dtype, device=group.device).scatter_(0, frag, group)
        fevent = torch.zeros(num_frag, dtype=event.dtype, device=event.device).scatter_(0, frag, event)
        merged = torch.arange(num_frag, device=frag.device)
        for e in torch.unique(event).tolist():
            points = torch.nonzero(event == e).squeeze(1)
            frags = torch.nonzero(fevent == e).squeeze(1)
            first, count = int(frags[0]), frags.numel()
            if count < 2:
                continue
            if points.numel() > self.max_linkage_points:
                pick = torch.linspace(0, points.numel() - 1, self.max_linkage_points, device=points.device)
                points = points[pick.long()]
            local = frag[points] - first
            member = torch.zeros(points.numel(), count, dtype=votes.dtype, device=votes.device)
            member[torch.arange(points.numel(), device=points.device), local] = 1.0
            vote_d2 = torch.cdist(votes[points], votes[points]).pow_(2)
            vote_d2 /= bandwidth[points, None] * bandwidth[None, points]
            dist2 = vote_d2 + torch.cdist(emb[points], emb[points]).pow_(2)
            pair_sums = member.t() @ torch.exp(-dist2) @ member
            sizes = member.sum(0)
            fg = fgroup[first:first + count]
            can_merge = (fg[:, None] == fg[None, :]) & (sizes[:, None] > 0) & (sizes[None, :] > 0)
            labels = average_linkage(pair_sums, sizes.clamp_min(1), can_merge, self.merge_affinity)
            merged[first:first + count] = first + labels
        return merged[frag]
