"""PT-v3 building blocks: the submanifold convolution of the conditional
positional encoding, the transformer block, and the container that threads a
:class:`~pimm.models.ptv3.structure.Point` through named children.

Module and parameter names are upstream's (``cpe.0.weight``, ``norm1.0``,
``attn.qkv``, ``mlp.0.fc1``, ``ls1.0.gamma``, ...), so upstream state dicts
load as they are. The convolution keeps spconv's weight layout
``(C_out, k, k, k, C_in)`` and runs on pimm's kernel maps through a reshape
to ``(k^3, C_in, C_out)`` (kernel offset ``(dx, dy, dz)`` in C order, the
neighbour at ``voxel + (dx, dy, dz) - k // 2``, as spconv and ``conv3d``).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Callable

import torch
from torch import nn

from ..sparse_conv import sparse_conv
from ..sparse_maps import KernelMap
from .attention import SerializedAttention
from .linear import Linear

__all__ = ["SubMConv3d", "PointModule", "PointSequential", "DropPath", "LayerScale", "MLP", "Block"]


class PointModule(nn.Module):
    """A module that takes and returns a whole point batch."""


class SubMConv3d(nn.Module):
    """Submanifold sparse convolution with spconv's parameters: ``weight``
    ``(C_out, k, k, k, C_in)`` and an optional ``bias`` ``(C_out,)``."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, bias: bool = True):
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(out_channels, kernel_size, kernel_size, kernel_size, in_channels))
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias else None
        bound = 1.0 / math.sqrt(in_channels * kernel_size**3)  # conv3d's default (kaiming-uniform, a=sqrt(5))
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, feat: torch.Tensor, kmap: KernelMap, then: nn.Linear | None = None) -> torch.Tensor:
        """The convolution, or with ``then`` the convolution followed by that
        linear layer, as one convolution whose weights are the product
        (``(x W_k) L = x (W_k L)``): where a level has many more points than
        the kernel has weights (``N > 2 k^3 C``), the ``N x C x C`` product
        of the linear layer (and its two in backward) costs more than
        multiplying the ``k^3`` small weight matrices. Same function, sums in
        another order."""
        cout, cin = self.weight.shape[0], self.weight.shape[-1]
        weight = self.weight.reshape(cout, -1, cin).permute(1, 2, 0)  # (k^3, C_in, C_out)
        bias = self.bias
        if then is not None and feat.shape[0] <= 2 * weight.shape[0] * max(cout, then.out_features):
            return then(self(feat, kmap))
        if then is not None:
            weight = torch.matmul(weight, then.weight.t())
            if bias is not None:
                bias = then.weight @ bias if then.bias is None else torch.addmv(then.bias, then.weight, bias)
            else:
                bias = then.bias
        out = sparse_conv(feat, weight.contiguous(), kmap)
        return out if bias is None else out + bias


class PointSequential(PointModule):
    """Children in order, named like upstream (``"0"``, ``"1"``, ... or the
    given names): point modules get the batch, convolutions run on its
    kernel map, anything else maps ``point.feat``."""

    def __init__(self, *modules: nn.Module, **named: nn.Module):
        super().__init__()
        if len(modules) == 1 and isinstance(modules[0], OrderedDict):
            named = dict(modules[0])
            modules = ()
        for i, module in enumerate(modules):
            self.add_module(str(i), module)
        for name, module in named.items():
            self.add_module(name, module)

    def add(self, module: nn.Module, name: str | None = None) -> None:
        self.add_module(str(len(self._modules)) if name is None else name, module)

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, idx: int) -> nn.Module:
        return list(self._modules.values())[idx]

    def forward(self, point):
        for module in self._modules.values():
            if isinstance(module, PointModule):
                point = module(point)
            elif isinstance(module, SubMConv3d):
                point["feat"] = point.sparse_conv(module, point["feat"])
            else:
                point["feat"] = module(point["feat"])
        return point

    def features(self, point, feat: torch.Tensor) -> torch.Tensor:
        """Run the (non-point) children on ``feat`` without touching ``point.feat``."""
        for module in self._modules.values():
            feat = point.sparse_conv(module, feat) if isinstance(module, SubMConv3d) else module(feat)
        return feat


class DropPath(nn.Module):
    """Stochastic depth per row (per point, as timm's DropPath on (N, C))."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop_prob == 0.0:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.dim() - 1)).bernoulli_(keep)
        return x * mask.div_(keep)


class LayerScale(nn.Module):
    def __init__(self, dim: int, init_values: float = 1e-5):
        super().__init__()
        self.gamma = nn.Parameter(init_values * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class MLP(nn.Module):
    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, drop: float = 0.0):
        super().__init__()
        self.fc1 = Linear(in_channels, hidden_channels)
        self.act = nn.GELU()
        self.fc2 = Linear(hidden_channels, out_channels)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(PointModule):
    """CPE (sparse conv -> Linear -> LayerNorm, residual), then pre- or
    post-norm attention and MLP, each residual with drop path and optional
    layer scale (PT-v3m2)."""

    def __init__(self, channels: int, num_heads: int, patch_size: int = 48, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, qk_scale=None, attn_drop: float = 0.0, proj_drop: float = 0.0,
                 drop_path: float = 0.0, layer_scale: float | None = None, pre_norm: bool = True,
                 order_index: int = 0, enable_rpe: bool = False, enable_flash: bool = True,
                 upcast_attention: bool = True, upcast_softmax: bool = True, enable_cpe: bool = True,
                 shared_cpe_conv: SubMConv3d | None = None, with_layer_scale_slots: bool = True,
                 cpe_factory: Callable[[int], nn.Module] | None = None,
                 attn_cls: type[SerializedAttention] = SerializedAttention, attn_options: dict | None = None):
        super().__init__()
        self.pre_norm = pre_norm
        if enable_cpe and cpe_factory is not None:
            # A CPE of another shape (PT-v3m8's bottleneck): a module with ``features(point, feat)``.
            self.cpe = cpe_factory(channels)
        elif enable_cpe:
            conv = shared_cpe_conv if shared_cpe_conv is not None else SubMConv3d(channels, channels, 3, bias=True)
            self.cpe = PointSequential(conv, Linear(channels, channels), nn.LayerNorm(channels))
        else:
            self.cpe = None
        self.norm1 = PointSequential(nn.LayerNorm(channels))
        if with_layer_scale_slots:  # PT-v3m2 has the (parameter-free unless set) layer-scale slots
            self.ls1 = PointSequential(LayerScale(channels, layer_scale) if layer_scale is not None else nn.Identity())
        self.attn = attn_cls(channels, num_heads, patch_size, qkv_bias, qk_scale, attn_drop, proj_drop, order_index,
                             enable_rpe, enable_flash, upcast_attention, upcast_softmax, **(attn_options or {}))
        self.norm2 = PointSequential(nn.LayerNorm(channels))
        if with_layer_scale_slots:
            self.ls2 = PointSequential(LayerScale(channels, layer_scale) if layer_scale is not None else nn.Identity())
        self.mlp = PointSequential(MLP(channels, int(channels * mlp_ratio), channels, proj_drop))
        self.drop_path = PointSequential(DropPath(drop_path) if drop_path > 0.0 else nn.Identity())

    def forward(self, point):
        feat = point["feat"]
        # Set by PT-v3m1's un-pooling: what upstream's convolution sees there (see SerializedUnpooling).
        conv_input = point.pop("cpe_input", None)
        if self.cpe is not None:
            # Full precision, as upstream: the convolution's sums are long.
            with torch.autocast(device_type=feat.device.type, enabled=False):
                feat32 = feat.float()
                source = feat32 if conv_input is None else conv_input.float()
                if isinstance(self.cpe, PointSequential):
                    conv, linear, norm = self.cpe[0], self.cpe[1], self.cpe[2]
                    delta = norm(point.sparse_conv(conv, source, then=linear))
                else:
                    delta = self.cpe.features(point, source)
                feat = (feat32 + delta).to(feat.dtype)
        ls1 = getattr(self, "ls1", None)
        ls2 = getattr(self, "ls2", None)
        x = self.norm1.features(point, feat) if self.pre_norm else feat
        x = self.attn(point, x)
        if ls1 is not None:
            x = ls1.features(point, x)
        feat = feat + self.drop_path.features(point, x)
        if not self.pre_norm:
            feat = self.norm1.features(point, feat)
        x = self.norm2.features(point, feat) if self.pre_norm else feat
        x = self.mlp.features(point, x)
        if ls2 is not None:
            x = ls2.features(point, x)
        feat = feat + self.drop_path.features(point, x)
        if not self.pre_norm:
            feat = self.norm2.features(point, feat)
        point["feat"] = feat
        return point
