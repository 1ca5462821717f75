"""spconv's and MinkowskiEngine's convolution layers over pimm's kernel maps.

Upstream pimm's sparse U-Nets hold their convolution weights in the layout of
the library they ran on; these layers keep those layouts (so the parameters
load from upstream's checkpoints as they are) and run them as pimm's sparse
convolution (:func:`pimm.models.sparse_conv.sparse_conv`). A pimm kernel map
pairs output ``o`` with input ``o + offset[k]``, ``k`` counting offsets
z fastest (``(dx * K + dy) * K + dz``); the layouts differ from it in order only:

* spconv 2.x (``SubMConv3d``, ``SparseConv3d``, ``SparseInverseConv3d``):
  ``weight`` ``(C_out, K, K, K, C_in)``, entry ``[:, i, j, l, :]`` acting on
  the input at ``output + (i, j, l) - K // 2`` (submanifold), on child
  ``(i, j, l)`` of the output (stride = kernel = 2), and from the parent onto
  its child ``(i, j, l)`` (inverse). A 1x1x1 convolution takes spconv's
  matrix-product path, which reads the same memory as ``(C_in, C_out)``
  (``weight.view(C_in, C_out)``, no transpose): kept, so checkpoints compute
  what they computed under spconv.
* MinkowskiEngine (``MinkowskiConvolution`` / ``MinkowskiConvolutionTranspose``):
  ``kernel`` ``(K^3, C_in, C_out)``, offsets counted x fastest
  (``kernel_region``: ``dx + K * (dy + K * dz)``), centred for odd ``K``
  and ``[0, K)`` for even ``K``, in units of the input's tensor stride; a
  1x1x1 stride-1 kernel is ``(C_in, C_out)``; a bias is ``(1, C_out)``. A
  transposed convolution pairs each coarse voxel with its children as the
  strided one does, and writes on the finer level's existing voxels.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .sparse_conv import sparse_conv
from .sparse_maps import KernelMap

__all__ = ["MinkowskiConv", "SparseSequential", "SpconvConv", "minkowski_kernel", "spconv_kernel"]


def spconv_kernel(weight: torch.Tensor) -> torch.Tensor:
    """spconv's ``(C_out, K, K, K, C_in)`` as pimm's ``(K^3, C_in, C_out)``."""
    cout, cin = weight.shape[0], weight.shape[-1]
    return weight.permute(1, 2, 3, 4, 0).reshape(-1, cin, cout)


def minkowski_kernel(kernel: torch.Tensor, size: int) -> torch.Tensor:
    """MinkowskiEngine's ``(K^3, C_in, C_out)`` (x fastest) as pimm's (z fastest)."""
    cin, cout = kernel.shape[1:]
    return kernel.view(size, size, size, cin, cout).transpose(0, 2).reshape(-1, cin, cout)


class SparseSequential(nn.Sequential):
    """``nn.Sequential`` that hands the kernel map to the children that take
    one (``takes_kmap``): upstream's containers (spconv's ``SparseSequential``,
    ``nn.Sequential`` of MinkowskiEngine layers), so that the children keep
    upstream's names (``0``, ``1``, ... or ``block0``, ...)."""

    def forward(self, x: torch.Tensor, kmap: KernelMap | None = None) -> torch.Tensor:
        for module in self:
            x = module(x, kmap) if getattr(module, "takes_kmap", False) else module(x)
        return x


class SpconvConv(nn.Module):
    """A convolution with spconv's weight (and, when ``bias``, its ``(C_out,)``
    bias). ``forward(x, kmap)``: the kernel map says what kind (submanifold,
    strided, inverse); ``kernel_size=1`` needs none."""

    takes_kmap = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = False):
        super().__init__()
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel_size
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size, in_channels))
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        bound = 1.0 / math.sqrt(in_channels * kernel_size**3)  # spconv's reset_parameters
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, kmap: KernelMap | None = None) -> torch.Tensor:
        if self.kernel_size == 1:
            out = x @ self.weight.reshape(self.in_channels, self.out_channels)
        else:
            out = sparse_conv(x, spconv_kernel(self.weight), kmap)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}"


class MinkowskiConv(nn.Module):
    """A convolution with MinkowskiEngine's ``kernel`` (and ``bias``).
    ``forward(x, kmap)``; a transposed convolution is the same layer given
    the strided map's ``transposed()``. Initialised as MinkowskiEngine does
    (uniform in +-1/sqrt(fan), fan = C_out * K^3 for a transposed one, else
    C_in * K^3)."""

    takes_kmap = True

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, bias: bool = False,
                 transposed: bool = False):
        super().__init__()
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, kernel_size
        self.transposed = transposed
        volume = kernel_size**3
        shape = (in_channels, out_channels) if volume == 1 else (volume, in_channels, out_channels)
        self.kernel = nn.Parameter(torch.empty(shape))
        self.bias = nn.Parameter(torch.empty(1, out_channels)) if bias else None
        bound = 1.0 / math.sqrt((out_channels if transposed else in_channels) * volume)
        nn.init.uniform_(self.kernel, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, kmap: KernelMap | None = None) -> torch.Tensor:
        if self.kernel.dim() == 2:
            out = x.mm(self.kernel)
        else:
            out = sparse_conv(x, minkowski_kernel(self.kernel, self.kernel_size), kmap)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, bias={self.bias is not None}"
