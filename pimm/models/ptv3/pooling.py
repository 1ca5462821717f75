"""Down- and up-sampling between PT-v3 levels.

* :class:`SerializedPooling` (PT-v3m1): points whose curve codes agree above
  the last ``3 log2(stride)`` bits share a parent voxel (``grid >> log2
  stride``); the parent's codes are the children's shifted, so the coarse
  level is serialized without re-encoding.
* :class:`GridPooling` (PT-v3m2): parents are the voxels of ``grid //
  stride`` (any stride), re-serialized on the coarse grid.

Both project the features, max-pool them per parent, average the
coordinates, then norm and activate; the parent level keeps the fine level
(``pooling_parent``) and each child's parent (``pooling_inverse``) for
un-pooling, which adds the projected parent feature to the projected skip.
"""

from __future__ import annotations

import math

import torch

from pimm.utils.errors import ConfigError

from ..point_ops import scatter_mean, voxelize
from .blocks import PointModule, PointSequential
from .linear import Linear
from .rows import Groups
from .structure import Point

__all__ = ["segment_max", "SerializedPooling", "SerializedUnpooling", "GridPooling", "GridUnpooling"]

_REDUCE = ("max", "min", "sum", "mean")


def segment_max(src: torch.Tensor, index: torch.Tensor, size: int, reduce: str = "max") -> torch.Tensor:
    """Reduce rows of ``src`` into ``size`` groups (every group non-empty):
    rows sorted by group, then one ``segment_reduce`` (about 1.5x faster
    forward + backward than ``scatter_reduce`` on LArTPC levels); see
    :meth:`~pimm.models.ptv3.rows.Groups.reduce`."""
    return Groups(index, size).reduce(src, reduce)


def _check_reduce(reduce: str) -> None:
    if reduce not in _REDUCE:
        raise ConfigError(f"PT-v3 pooling reduce={reduce!r}: use one of {list(_REDUCE)}")


class _Pooling(PointModule):
    def __init__(self, in_channels, out_channels, stride, norm_layer, act_layer, reduce, shuffle_orders, traceable):
        super().__init__()
        _check_reduce(reduce)
        self.stride, self.reduce = stride, reduce
        self.shuffle_orders, self.traceable = shuffle_orders, traceable
        self.proj = Linear(in_channels, out_channels)
        self.norm = PointSequential(norm_layer(out_channels)) if norm_layer is not None else None
        self.act = PointSequential(act_layer()) if act_layer is not None else None

    def _pooled(self, point: Point, groups: Groups, **fields) -> Point:
        cluster, size = groups.index, groups.size
        feat = groups.reduce(self.proj(point["feat"]), self.reduce)
        new = Point(feat=feat, **fields)
        if "coord" in point:
            new["coord"] = scatter_mean(point["coord"], cluster, size)
        for key in ("condition", "context"):
            if key in point:
                new[key] = point[key]
        new["pooling_inverse"] = cluster
        new["pooling_parent"] = point
        new["_cache"]["pooling_groups"] = groups  # for un-pooling's backward
        if self.norm is not None:
            new = self.norm(new)
        if self.act is not None:
            new = self.act(new)
        return new


class SerializedPooling(_Pooling):
    """PT-v3m1 pooling by curve-code prefix (stride a power of 2)."""

    def __init__(self, in_channels, out_channels, stride=2, norm_layer=None, act_layer=None, reduce="max",
                 shuffle_orders=True, traceable=True):
        if stride < 1 or stride & (stride - 1):
            raise ConfigError(f"PT-v3m1: stride={stride} must be a power of 2 (serialized pooling)")
        super().__init__(in_channels, out_channels, stride, norm_layer, act_layer, reduce, shuffle_orders, traceable)

    def forward(self, point: Point) -> Point:
        depth = (math.ceil(self.stride) - 1).bit_length()
        if depth > point["serialized_depth"]:
            depth = 0
        code = point["serialized_code"] >> (3 * depth)
        _, cluster, counts = torch.unique(code[0], sorted=True, return_inverse=True, return_counts=True)
        head = torch.sort(cluster, stable=True)[1].index_select(0, torch.cumsum(counts, 0) - counts)
        code = code[:, head]
        order = torch.argsort(code, dim=1, stable=True)
        inverse = torch.empty_like(order).scatter_(1, order, torch.arange(code.shape[1], device=code.device)
                                                    .expand_as(order))
        if self.shuffle_orders and self.training:  # eval stays deterministic
            perm = torch.randperm(code.shape[0]).to(code.device)
            code, order, inverse = code[perm], order[perm], inverse[perm]
        new = self._pooled(point, Groups(cluster, head.numel()), grid_coord=point["grid_coord"][head] >> depth,
                           batch=point["batch"][head], serialized_code=code, serialized_order=order,
                           serialized_inverse=inverse, serialized_depth=point["serialized_depth"] - depth,
                           order=point["order"])
        return new


class GridPooling(_Pooling):
    """PT-v3m2 pooling on the ``grid // stride`` voxels (re-serialized)."""

    def __init__(self, in_channels, out_channels, stride=2, norm_layer=None, act_layer=None, reduce="max",
                 shuffle_orders=True, traceable=True):
        if stride < 1:
            raise ConfigError(f"PT-v3m2: stride={stride} must be >= 1")
        super().__init__(in_channels, out_channels, stride, norm_layer, act_layer, reduce, shuffle_orders, traceable)

    def forward(self, point: Point) -> Point:
        grid = torch.div(point.ensure_grid_coord(), self.stride, rounding_mode="floor")
        vgrid, vbatch, cluster = voxelize(grid, point["batch"])
        groups = Groups(cluster, vgrid.shape[0])
        new = self._pooled(point, groups, grid_coord=vgrid, batch=vbatch)
        new.coarsen_serialization(point, cluster, self.stride, shuffle_orders=self.shuffle_orders and self.training)
        new["_cache"]["pooling_groups"] = groups  # (the serialization starts a new cache)
        return new


class _Unpooling(PointModule):
    cpe_sees_skip_only = False

    def __init__(self, in_channels, skip_channels, out_channels, norm_layer=None, act_layer=None, traceable=False):
        super().__init__()
        self.proj = PointSequential(Linear(in_channels, out_channels))
        self.proj_skip = PointSequential(Linear(skip_channels, out_channels))
        if norm_layer is not None:
            self.proj.add(norm_layer(out_channels))
            self.proj_skip.add(norm_layer(out_channels))
        if act_layer is not None:
            self.proj.add(act_layer())
            self.proj_skip.add(act_layer())
        self.traceable = traceable

    def forward(self, point: Point) -> Point:
        parent = point.pop("pooling_parent")
        inverse = point.pop("pooling_inverse")
        groups = point["_cache"].get("pooling_groups")
        up = self.proj.features(point, point["feat"])
        skip = self.proj_skip.features(parent, parent["feat"])
        if groups is not None and groups.index is inverse:
            parent["feat"] = skip + groups.spread(up)
        else:
            parent["feat"] = skip + up.index_select(0, inverse)
        if self.cpe_sees_skip_only:
            parent["cpe_input"] = skip
        if self.traceable:  # as upstream: the level below and how its points map onto this one's
            parent["unpooling_parent"] = point
            parent["unpooling_inverse"] = inverse
        return parent


class SerializedUnpooling(_Unpooling):
    """PT-v3m1 un-pooling: ``proj_skip(skip) + proj(parent)[child's parent]``.

    Upstream's m1 leaves spconv's copy of the features at ``proj_skip(skip)``
    (it does not refresh it after the sum), so the next block's CPE
    convolves the skip branch alone while its residual adds to the sum;
    ``cpe_input`` carries that to the block (PT-v3m2's un-pooling refreshes
    the copy, so there the CPE sees the sum)."""

    cpe_sees_skip_only = True


class GridUnpooling(_Unpooling):
    """PT-v3m2 un-pooling (same arithmetic as :class:`SerializedUnpooling`)."""
