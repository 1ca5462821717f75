"""The point batch that flows through PT-v3: a dict with attribute access.

Keys follow upstream's ``Point``: ``feat``, ``coord``, ``grid_coord``,
``batch``, ``offset``, the serialization (``serialized_code``,
``serialized_order``, ``serialized_inverse``, ``serialized_depth``,
``order``) and, after pooling, ``pooling_parent`` / ``pooling_inverse``.

What upstream keeps in an spconv tensor (the sparse-conv indices of a
level) is here a cache of pimm kernel maps (:meth:`Point.conv_map`); the
patch layouts of the attention are cached the same way. Both belong to the
resolution level, so the decoder, which gets the encoder's point of that
level back from un-pooling, reuses them.
"""

from __future__ import annotations

import torch

from pimm.utils.errors import ConfigError

from ..point_ops import batch2offset, offset2batch, scatter_mean, voxelize
from ..sparse_maps import KernelMap, submanifold_kernel_map
from .serialization import coarsen, depth_for, serialize

__all__ = ["Point"]


class Point(dict):
    """A batch of points (see the module docstring). Missing ``batch`` or
    ``offset`` is derived from the other; ``grid_coord`` from ``coord`` and
    ``grid_size`` when absent."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "batch" not in self and "offset" in self:
            self["batch"] = offset2batch(self["offset"])
        elif "offset" not in self and "batch" in self:
            self["offset"] = batch2offset(self["batch"])
        self.setdefault("_cache", {})

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value

    def ensure_grid_coord(self) -> torch.Tensor:
        """Non-negative integer voxel coordinates. Without ``grid_coord``:
        ``trunc((coord - batch minimum) / grid_size)``, upstream's rule (the
        origin is the whole batch's minimum, not each event's); a
        ``grid_coord`` with negative entries is moved by the batch's minimum."""
        if "grid_coord" not in self:
            if "coord" not in self or "grid_size" not in self:
                raise ConfigError("PT-v3 needs grid_coord in the batch (add GridSample(..., return_grid_coord=True) "
                                  "to the transform) or coord and grid_size")
            size = self["grid_size"]
            size = float(size.flatten()[0]) if isinstance(size, torch.Tensor) else float(size)
            coord = self["coord"]
            self["grid_coord"] = torch.div(coord - coord.min(0).values, size, rounding_mode="trunc").long()
        else:
            grid = self["grid_coord"].long()
            if grid.numel() and int(grid.min()) < 0:
                grid = grid - grid.min(0).values
            self["grid_coord"] = grid
        return self["grid_coord"]

    def serialization(self, order=("z",), depth: int | None = None, shuffle_orders: bool = False) -> None:
        """Codes, orders and inverses of every curve in ``order`` (see
        :func:`~pimm.models.ptv3.serialization.serialize`)."""
        order = [order] if isinstance(order, str) else list(order)
        code, idx, inverse, depth = serialize(self.ensure_grid_coord(), self["batch"], order, depth)
        rows = None
        if shuffle_orders:  # serialize's own shuffle, done here to remember which curve went where
            rows = torch.randperm(code.shape[0]).to(code.device)
            code, idx, inverse = code[rows], idx[rows], inverse[rows]
        self._set_serialization(order, code, idx, inverse, depth, rows)

    def _set_serialization(self, order, code, idx, inverse, depth, rows) -> None:
        self["order"] = order
        self["serialized_code"], self["serialized_order"], self["serialized_inverse"] = code, idx, inverse
        self["serialized_depth"] = depth
        # Which of ``order``'s curves each row holds (None: in order), for coarsen_serialization.
        self["_cache"] = {"serialized_rows": rows}

    def coarsen_serialization(self, child: "Point", cluster: torch.Tensor, stride: int,
                              shuffle_orders: bool = False) -> None:
        """``serialization(child.order, shuffle_orders=...)`` of this level,
        whose voxels are ``child.grid_coord // stride`` (``cluster``: each
        child's voxel here), read off the child level's serialization when
        that gives the same result (a power-of-2 stride, the depth that
        serialize would pick, see :func:`~.serialization.coarsen`) and
        computed afresh otherwise. Same results, same random numbers."""
        levels = stride.bit_length() - 1 if isinstance(stride, int) and stride > 0 else -1
        rows = child["_cache"].get("serialized_rows", False) if "serialized_code" in child else False
        if levels < 1 or stride != 1 << levels or rows is False:
            self.serialization(order=child["order"], shuffle_orders=shuffle_orders)
            return
        depth = depth_for(self.ensure_grid_coord())
        if depth != child["serialized_depth"] - levels:
            self.serialization(order=child["order"], shuffle_orders=shuffle_orders)
            return
        canonical = None if rows is None else torch.argsort(rows)
        code, idx, inverse = coarsen(child["serialized_code"], child["serialized_order"], levels, cluster,
                                     self["grid_coord"].shape[0], canonical)
        rows = None
        if shuffle_orders:
            rows = torch.randperm(code.shape[0]).to(code.device)
            code, idx, inverse = code[rows], idx[rows], inverse[rows]
        self._set_serialization(list(child["order"]), code, idx, inverse, depth, rows)

    def conv_map(self, kernel_size: int) -> tuple[KernelMap, torch.Tensor | None]:
        """Submanifold kernel map of this level and, when several points share
        a voxel, each point's voxel (``None`` when the voxels are distinct)."""
        key = ("subm", kernel_size)
        cache = self["_cache"]
        if key not in cache:
            grid, batch = self.ensure_grid_coord(), self["batch"]
            if self._voxels_distinct():
                cache[key] = (submanifold_kernel_map(grid, batch, kernel_size), None)
                return cache[key]
            vgrid, vbatch, inverse = voxelize(grid, batch)
            if vgrid.shape[0] == grid.shape[0]:
                cache[key] = (submanifold_kernel_map(grid, batch, kernel_size), None)
            else:
                cache[key] = (submanifold_kernel_map(vgrid, vbatch, kernel_size), inverse)
        return cache[key]

    def _voxels_distinct(self) -> bool:
        """True when no two points share a voxel, read off the curve codes
        (event and voxel, one to one) when the level is serialized: a
        comparison of neighbours in curve order instead of hashing. False
        means "not known"."""
        if "serialized_code" not in self:
            return False
        code = self["serialized_code"][0].index_select(0, self["serialized_order"][0])
        return bool((code[1:] != code[:-1]).all())

    def sparse_conv(self, conv, feat: torch.Tensor, then=None) -> torch.Tensor:
        """Apply a :class:`~pimm.models.ptv3.blocks.SubMConv3d` (and the
        linear layer ``then`` after it) over this level (points sharing a
        voxel are averaged in and all get the voxel's output)."""
        kmap, inverse = self.conv_map(conv.kernel_size)
        if inverse is None:
            return conv(feat, kmap, then)
        return conv(scatter_mean(feat, inverse, kmap.num_in), kmap, then).index_select(0, inverse)
