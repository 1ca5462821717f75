"""The voxels and kernel maps one batch gives upstream's sparse U-Nets
(``SpUNet-*`` on spconv, ``MinkUNet*`` on MinkowskiEngine): read
``grid_coord``, merge the points of a voxel, and build every map the network
needs at once (:func:`~pimm.models.sparse_maps.kernel_map_pyramid`).

Upstream feeds the points themselves to the library as voxels; with one
point per voxel (what ``GridSample`` gives in training) that is what happens
here. Points sharing a voxel are merged into their mean feature and all get
the voxel's output, as MinkowskiEngine's ``TensorField`` (average, then
``slice``) does; spconv has no defined behaviour for repeated voxels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pimm.utils.errors import ConfigError

from .point_ops import offset2batch, scatter_mean, voxelize
from .sparse_maps import KernelMap, kernel_map_pyramid, submanifold_kernel_map

__all__ = ["UNetLevels", "unet_levels"]


@dataclass
class UNetLevels:
    """Level ``l`` holds the voxels at stride ``2**l``."""

    feat: torch.Tensor  # (M, C) mean feature of every level-0 voxel
    inverse: torch.Tensor  # (N,) level-0 voxel of every point
    batch: torch.Tensor  # (M,) event of every level-0 voxel
    stem: KernelMap  # the 5^3 submanifold map of level 0
    subm: list[KernelMap]  # 3^3 submanifold map per level
    down: list[KernelMap]  # stride-2 map from level l to l + 1

    def level_batch(self, level: int) -> torch.Tensor:
        """The event of every voxel of ``level`` (each takes its children's)."""
        batch = self.batch
        for kmap in self.down[:level]:
            child, parent = kmap.pairs
            batch = batch.new_zeros(kmap.num_out).index_copy_(0, parent, batch.index_select(0, child))
        return batch


def unet_levels(input_dict: dict, owner: str, levels: int, dtype: torch.dtype,
                extent_margin: int | None = None) -> UNetLevels:
    """The levels of a ``levels``-deep U-Net over ``input_dict``'s
    ``grid_coord`` / ``feat`` / ``offset``.

    ``extent_margin``: the grid is bounded as spconv's ``spatial_shape`` of
    ``max(grid_coord) + extent_margin`` bounds it (None: unbounded, as
    MinkowskiEngine). Negative coordinates (which spconv cannot take) are
    moved by a multiple of ``2**(levels - 1)``, which keeps every coarser
    voxel's children as they were (MinkowskiEngine rounds down, like this).
    """
    for key in ("grid_coord", "feat", "offset"):
        if key not in input_dict:
            hint = (" (add GridSample(..., return_grid_coord=True) to the transform and 'grid_coord' to Collect's "
                    "keys)" if key == "grid_coord" else "")
            raise ConfigError(f"{owner} needs {key!r} in the batch{hint}")
    grid = input_dict["grid_coord"].long()
    if grid.dim() != 2 or grid.shape[1] != 3:
        raise ConfigError(f"{owner}: grid_coord must be (N, 3) integer voxel coordinates, got {tuple(grid.shape)}")
    batch = offset2batch(input_dict["offset"].to(grid.device), grid.shape[0])
    if grid.numel():
        low = grid.min(0).values
        if bool((low < 0).any()):
            step = 2 ** (levels - 1)
            grid = grid - torch.div(low.clamp_max(0), step, rounding_mode="floor") * step
    extent = None
    if extent_margin is not None and grid.numel():
        extent = (grid.max(0).values + extent_margin).tolist()
    vgrid, vbatch, inverse = voxelize(grid, batch)
    feat = scatter_mean(input_dict["feat"].to(dtype), inverse, vgrid.shape[0])
    subm, down = kernel_map_pyramid(vgrid, vbatch, levels, 3, extent=extent)
    stem = submanifold_kernel_map(vgrid, vbatch, 5)
    return UNetLevels(feat, inverse, vbatch, stem, subm, down)
