"""MinkowskiEngine's convolutions computed on a dense grid with torch's
``conv3d`` / ``conv_transpose3d``: the reference pimm's ``MinkUNet*`` is
checked against (MinkowskiEngine itself cannot be installed here).

MinkowskiEngine's definitions, from its source (``src/kernel_region.hpp``,
``coordinate_map_cpu.hpp``, ``coordinate_map_manager.cpp``,
``MinkowskiConvolution.py``, release 0.5):

* a kernel ``(K^3, C_in, C_out)``; kernel index ``k = ix + K * (iy + K * iz)``
  (x fastest), offset ``(i - K // 2) * t`` per axis for odd ``K`` and
  ``i * t`` for even ``K``, ``t`` the input's tensor stride;
* ``out[o] = sum_k in[o + offset_k] @ kernel[k]`` over the inputs that exist;
* a stride-1 convolution keeps the input's coordinates; a stride-``s`` one
  outputs at ``floor(c / (t s)) * t s``; a transposed one writes on the
  existing coordinates of tensor stride ``t / s``, pairing each input with the
  outputs at ``input + offset_k`` (offsets in the output's stride), weight
  ``k``; a 1x1x1 stride-1 kernel is ``(C_in, C_out)``, applied as ``F @ kernel``.

Coordinates are ``(M, 4)`` integer rows ``(batch, x, y, z)``, non-negative
multiples of the tensor stride. Nothing here imports pimm (the fixture
script runs it beside upstream's code in a scratch environment).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["conv", "conv_transpose", "strided_coordinates"]


def _torch_weight(kernel: torch.Tensor, size: int, transposed: bool) -> torch.Tensor:
    cin, cout = kernel.shape[1:]
    w = kernel.reshape(size, size, size, cin, cout)  # (iz, iy, ix, C_in, C_out)
    return w.permute(3, 4, 2, 1, 0) if transposed else w.permute(4, 3, 2, 1, 0)


def _scatter(feat: torch.Tensor, cells: torch.Tensor, batch: torch.Tensor, shape) -> torch.Tensor:
    grid = feat.new_zeros(int(batch.max()) + 1, feat.shape[1], *shape)
    grid[batch, :, cells[:, 0], cells[:, 1], cells[:, 2]] = feat
    return grid


def strided_coordinates(coords: torch.Tensor, stride: int) -> torch.Tensor:
    """The distinct ``floor(c / stride) * stride`` rows (sorted), as a strided convolution outputs."""
    out = coords.clone()
    out[:, 1:] = torch.div(coords[:, 1:], stride, rounding_mode="floor") * stride
    return torch.unique(out, dim=0)


def conv(feat: torch.Tensor, coords: torch.Tensor, kernel: torch.Tensor, size: int, tensor_stride: int = 1,
         stride: int = 1, out_coords: torch.Tensor | None = None) -> torch.Tensor:
    """A (non-transposed) convolution of the voxels ``coords`` (tensor stride
    ``tensor_stride``), read at ``out_coords`` (default: the input's for
    ``stride=1``, :func:`strided_coordinates` otherwise)."""
    if kernel.dim() == 2:
        return feat @ kernel
    if out_coords is None:
        out_coords = coords if stride == 1 else strided_coordinates(coords, tensor_stride * stride)
    pad = size // 2 if size % 2 else 0
    cells = torch.div(coords[:, 1:], tensor_stride, rounding_mode="floor") + pad
    shape = [int(s) + 1 + pad + size for s in cells.max(0).values]  # room for every window, even ones included
    out = F.conv3d(_scatter(feat, cells, coords[:, 0], shape), _torch_weight(kernel, size, False), stride=stride)
    at = torch.div(out_coords[:, 1:], tensor_stride * stride, rounding_mode="floor")
    return out[out_coords[:, 0], :, at[:, 0], at[:, 1], at[:, 2]]


def conv_transpose(feat: torch.Tensor, coords: torch.Tensor, kernel: torch.Tensor, size: int, tensor_stride: int,
                   stride: int, out_coords: torch.Tensor) -> torch.Tensor:
    """A transposed convolution (kernel ``size`` = ``stride``) of the voxels
    ``coords`` (tensor stride ``tensor_stride``) onto ``out_coords`` (tensor
    stride ``tensor_stride // stride``)."""
    cells = torch.div(coords[:, 1:], tensor_stride, rounding_mode="floor")
    shape = [int(s) + 1 for s in cells.max(0).values]
    out = F.conv_transpose3d(_scatter(feat, cells, coords[:, 0], shape), _torch_weight(kernel, size, True),
                             stride=stride)
    at = torch.div(out_coords[:, 1:], tensor_stride // stride, rounding_mode="floor")
    return out[out_coords[:, 0], :, at[:, 0], at[:, 1], at[:, 2]]
