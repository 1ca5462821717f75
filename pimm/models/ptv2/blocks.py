"""Point Transformer v2's building blocks (Wu et al. 2022, as upstream pimm
builds them): grouped vector attention over k nearest neighbours, the block
and block sequence around it, grid pooling, map / interpolation unpooling,
and the stage containers.

A level is the list ``[coord, feat, offset]``. Every normalisation is called
as ``norm(feat, prompt)``: PT-v2m1 and m2 use :class:`PointBatchNorm`, which
ignores the prompt; PT-v2m3 passes its :class:`~pimm.models.ptv2.pdnorm.PDBatchNorm`
factory as ``norm_fn`` and the batch's ``(condition, context)`` as the
prompt. With ``norm_fn`` given, the un-pooling and the patch embedding keep
their layers as separate children (``proj_linear``, ``proj_norm``, ...), as
upstream's m3 does, instead of in one ``proj`` sequence. Module and
parameter names are upstream's, so its state dicts load as they are.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..pointops import grid_pool, grouping, interpolation, knn_query
from ..ptv3.blocks import DropPath

__all__ = ["PointBatchNorm", "GroupedLinear", "GroupedVectorAttention", "Block", "BlockSequence", "GridPool",
           "UnpoolWithSkip", "Encoder", "Decoder", "GVAPatchEmbed"]


class PointBatchNorm(nn.Module):
    """BatchNorm over the channels of (n, c) rows or (n, k, c) neighbourhoods."""

    def __init__(self, embed_channels: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(embed_channels)

    def forward(self, input: torch.Tensor, prompt=None) -> torch.Tensor:
        if input.dim() == 3:
            return self.norm(input.transpose(1, 2).contiguous()).transpose(1, 2).contiguous()
        return self.norm(input)


class GroupedLinear(nn.Module):
    """PT-v2m1's attention-weight projection: one output per channel group,
    the sum of the group's channels each scaled by its own weight (``weight``
    (1, in_features), no bias)."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        if out_features != groups or in_features % groups:
            raise ValueError(f"GroupedLinear: {in_features} -> {out_features} in {groups} groups: the output must "
                             "be one per group and the groups must divide the input")
        self.in_features, self.out_features, self.groups = in_features, out_features, groups
        self.weight = nn.Parameter(torch.empty(1, in_features))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        scaled = input * self.weight
        return scaled.reshape(*input.shape[:-1], self.groups, self.in_features // self.groups).sum(-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, groups={self.groups}"


def _linear_bn_relu(in_channels: int, out_channels: int, bias: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(in_channels, out_channels, bias=bias), PointBatchNorm(out_channels),
                         nn.ReLU(inplace=True))


def _position_mlp(channels: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, channels), PointBatchNorm(channels), nn.ReLU(inplace=True),
                         nn.Linear(channels, channels))


class GroupedVectorAttention(nn.Module):
    """Each point attends to its neighbours (``reference_index`` (n, k) from
    :func:`~pimm.models.pointops.knn_query`): one softmax weight per channel
    group from ``key_j - query_i`` (times a positional multiplier and/or plus
    a positional bias, MLPs of the neighbour's offset), over ``value_j``
    (plus the bias). A missing neighbour (-1) takes part in the softmax and
    is then zeroed, as upstream does."""

    def __init__(self, embed_channels: int, groups: int, attn_drop_rate: float = 0.0, qkv_bias: bool = True,
                 pe_multiplier: bool = False, pe_bias: bool = True, grouped_weight: bool = False):
        super().__init__()
        self.embed_channels, self.groups = embed_channels, groups
        self.attn_drop_rate, self.qkv_bias = attn_drop_rate, qkv_bias
        self.pe_multiplier, self.pe_bias = pe_multiplier, pe_bias
        self.linear_q = _linear_bn_relu(embed_channels, embed_channels, qkv_bias)
        self.linear_k = _linear_bn_relu(embed_channels, embed_channels, qkv_bias)
        self.linear_v = nn.Linear(embed_channels, embed_channels, bias=qkv_bias)
        if pe_multiplier:
            self.linear_p_multiplier = _position_mlp(embed_channels)
        if pe_bias:
            self.linear_p_bias = _position_mlp(embed_channels)
        project = GroupedLinear(embed_channels, groups, groups) if grouped_weight else nn.Linear(embed_channels, groups)
        self.weight_encoding = nn.Sequential(project, PointBatchNorm(groups), nn.ReLU(inplace=True),
                                             nn.Linear(groups, groups))
        self.softmax = nn.Softmax(dim=1)
        self.attn_drop = nn.Dropout(attn_drop_rate)

    def forward(self, feat: torch.Tensor, coord: torch.Tensor, reference_index: torch.Tensor) -> torch.Tensor:
        query, key, value = self.linear_q(feat), self.linear_k(feat), self.linear_v(feat)
        key = grouping(reference_index, key, coord, with_xyz=True)
        value = grouping(reference_index, value, coord)
        pos, key = key[..., :3], key[..., 3:]
        relation = key - query.unsqueeze(1)
        if self.pe_multiplier:
            relation = relation * self.linear_p_multiplier(pos)
        if self.pe_bias:
            bias = self.linear_p_bias(pos)
            relation, value = relation + bias, value + bias
        weight = self.attn_drop(self.softmax(self.weight_encoding(relation)))  # (n, k, groups)
        weight = weight * (reference_index >= 0).unsqueeze(-1).to(weight.dtype)
        n, k, channels = value.shape
        value = value.view(n, k, self.groups, channels // self.groups)
        return (value * weight.unsqueeze(-1)).sum(1).reshape(n, channels)


class Block(nn.Module):
    """fc1-norm-ReLU, attention, norm-ReLU, fc3-norm, stochastic depth, plus
    the input, ReLU."""

    def __init__(self, embed_channels: int, groups: int, qkv_bias: bool = True, pe_multiplier: bool = False,
                 pe_bias: bool = True, attn_drop_rate: float = 0.0, drop_path_rate: float = 0.0,
                 enable_checkpoint: bool = False, norm_fn: Callable[[int], nn.Module] = PointBatchNorm,
                 grouped_weight: bool = False):
        super().__init__()
        self.attn = GroupedVectorAttention(embed_channels, groups, attn_drop_rate, qkv_bias, pe_multiplier, pe_bias,
                                           grouped_weight)
        self.fc1 = nn.Linear(embed_channels, embed_channels, bias=False)
        self.fc3 = nn.Linear(embed_channels, embed_channels, bias=False)
        self.norm1, self.norm2, self.norm3 = norm_fn(embed_channels), norm_fn(embed_channels), norm_fn(embed_channels)
        self.act = nn.ReLU(inplace=True)
        self.enable_checkpoint = enable_checkpoint
        self.drop_path = DropPath(drop_path_rate) if drop_path_rate > 0.0 else nn.Identity()

    def forward(self, points: list, reference_index: torch.Tensor, prompt=None) -> list:
        coord, feat, offset = points
        identity = feat
        feat = self.act(self.norm1(self.fc1(feat), prompt))
        if self.enable_checkpoint and torch.is_grad_enabled():
            feat = checkpoint(self.attn, feat, coord, reference_index, use_reentrant=False)
        else:
            feat = self.attn(feat, coord, reference_index)
        feat = self.act(self.norm2(feat, prompt))
        feat = self.norm3(self.fc3(feat), prompt)
        return [coord, self.act(identity + self.drop_path(feat)), offset]


class BlockSequence(nn.Module):
    """``depth`` blocks sharing one neighbour table (``neighbours`` nearest
    points, the point itself first). ``drop_path_rate``: one rate per block,
    or one for all."""

    def __init__(self, depth: int, embed_channels: int, groups: int, neighbours: int = 16, qkv_bias: bool = True,
                 pe_multiplier: bool = False, pe_bias: bool = True, attn_drop_rate: float = 0.0,
                 drop_path_rate: float | list = 0.0, enable_checkpoint: bool = False,
                 norm_fn: Callable[[int], nn.Module] = PointBatchNorm, grouped_weight: bool = False):
        super().__init__()
        if isinstance(drop_path_rate, (list, tuple)):
            if len(drop_path_rate) != depth:
                raise ValueError(f"BlockSequence: {len(drop_path_rate)} drop-path rates for {depth} blocks")
            rates = list(drop_path_rate)
        else:
            rates = [float(drop_path_rate) if isinstance(drop_path_rate, float) else 0.0] * depth
        self.neighbours = neighbours
        self.blocks = nn.ModuleList(
            Block(embed_channels, groups, qkv_bias, pe_multiplier, pe_bias, attn_drop_rate, rate, enable_checkpoint,
                  norm_fn, grouped_weight) for rate in rates)

    def forward(self, points: list, prompt=None) -> list:
        coord, _, offset = points
        reference_index, _ = knn_query(self.neighbours, coord, offset)
        for block in self.blocks:
            points = block(points, reference_index, prompt)
        return points


class GridPool(nn.Module):
    """fc-norm-ReLU, then :func:`~pimm.models.pointops.grid_pool` on cells of
    ``grid_size``; returns the pooled level and each point's cell."""

    def __init__(self, in_channels: int, out_channels: int, grid_size: float,
                 norm_fn: Callable[[int], nn.Module] = PointBatchNorm, bias: bool = False):
        super().__init__()
        self.in_channels, self.out_channels, self.grid_size = in_channels, out_channels, grid_size
        self.fc = nn.Linear(in_channels, out_channels, bias=bias)
        self.norm = norm_fn(out_channels)
        self.act = nn.ReLU(inplace=True)

    def forward(self, points: list, start: torch.Tensor | None = None, prompt=None) -> tuple[list, torch.Tensor]:
        coord, feat, offset = points
        feat = self.act(self.norm(self.fc(feat), prompt))
        coord, feat, offset, cluster = grid_pool(coord, feat, offset, self.grid_size, start)
        return [coord, feat, offset], cluster


def _add_projection(owner: nn.Module, name: str, in_channels: int, out_channels: int, bias: bool,
                    norm_fn: Callable[[int], nn.Module] | None) -> None:
    """Linear-norm-ReLU as one ``name`` sequence (m1, m2), or as
    ``name_linear`` / ``_norm`` / ``_act`` children of ``owner`` (m3)."""
    if norm_fn is None:
        owner.add_module(name, _linear_bn_relu(in_channels, out_channels, bias))
    else:
        owner.add_module(f"{name}_linear", nn.Linear(in_channels, out_channels, bias=bias))
        owner.add_module(f"{name}_norm", norm_fn(out_channels))
        owner.add_module(f"{name}_act", nn.ReLU(inplace=True))


def _project(owner: nn.Module, name: str, feat: torch.Tensor, prompt) -> torch.Tensor:
    if name in owner._modules:
        return owner._modules[name](feat)
    linear, norm, act = (owner._modules[f"{name}_{part}"] for part in ("linear", "norm", "act"))
    return act(norm(linear(feat), prompt))


class UnpoolWithSkip(nn.Module):
    """Back to the finer level: the projected coarse features copied to every
    point of the cell (``backend="map"``, given the pooling's ``cluster``) or
    interpolated from the 3 nearest cells (``"interp"``), plus the projected
    skip features (``skip=True``)."""

    def __init__(self, in_channels: int, skip_channels: int, out_channels: int, bias: bool = True, skip: bool = True,
                 backend: str = "map", norm_fn: Callable[[int], nn.Module] | None = None):
        super().__init__()
        if backend not in ("map", "interp"):
            raise ValueError(f"UnpoolWithSkip: backend={backend!r}: use 'map' or 'interp'")
        self.in_channels, self.skip_channels, self.out_channels = in_channels, skip_channels, out_channels
        self.skip, self.backend = skip, backend
        _add_projection(self, "proj", in_channels, out_channels, bias, norm_fn)
        _add_projection(self, "proj_skip", skip_channels, out_channels, bias, norm_fn)

    def forward(self, points: list, skip_points: list, cluster: torch.Tensor | None = None, prompt=None) -> list:
        coord, feat, offset = points
        skip_coord, skip_feat, skip_offset = skip_points
        feat = _project(self, "proj", feat, prompt)
        if self.backend == "map" and cluster is not None:
            feat = feat[cluster]
        else:
            feat = interpolation(coord, skip_coord, feat, offset, skip_offset)
        if self.skip:
            feat = feat + _project(self, "proj_skip", skip_feat, prompt)
        return [skip_coord, feat, skip_offset]


def _sequence_args(depth, embed_channels, groups, neighbours, qkv_bias, pe_multiplier, pe_bias, attn_drop_rate,
                   drop_path_rate, enable_checkpoint, norm_fn, grouped_weight) -> dict:
    return dict(depth=depth, embed_channels=embed_channels, groups=groups, neighbours=neighbours, qkv_bias=qkv_bias,
                pe_multiplier=pe_multiplier, pe_bias=pe_bias,
                attn_drop_rate=0.0 if attn_drop_rate is None else attn_drop_rate,
                drop_path_rate=0.0 if drop_path_rate is None else drop_path_rate,
                enable_checkpoint=enable_checkpoint, norm_fn=norm_fn or PointBatchNorm, grouped_weight=grouped_weight)


class Encoder(nn.Module):
    """Grid pooling (``down``), then a block sequence (``blocks``)."""

    def __init__(self, depth, in_channels, embed_channels, groups, grid_size=None, neighbours=16, qkv_bias=True,
                 pe_multiplier=False, pe_bias=True, attn_drop_rate=None, drop_path_rate=None, enable_checkpoint=False,
                 norm_fn=None, grouped_weight=False):
        super().__init__()
        self.down = GridPool(in_channels, embed_channels, grid_size, norm_fn or PointBatchNorm)
        self.blocks = BlockSequence(**_sequence_args(depth, embed_channels, groups, neighbours, qkv_bias,
                                                     pe_multiplier, pe_bias, attn_drop_rate, drop_path_rate,
                                                     enable_checkpoint, norm_fn, grouped_weight))

    def forward(self, points: list, prompt=None) -> tuple[list, torch.Tensor]:
        points, cluster = self.down(points, prompt=prompt)
        return self.blocks(points, prompt), cluster


class Decoder(nn.Module):
    """Un-pooling with the skip (``up``), then a block sequence (``blocks``)."""

    def __init__(self, in_channels, skip_channels, embed_channels, groups, depth, neighbours=16, qkv_bias=True,
                 pe_multiplier=False, pe_bias=True, attn_drop_rate=None, drop_path_rate=None, enable_checkpoint=False,
                 unpool_backend="map", norm_fn=None, grouped_weight=False):
        super().__init__()
        self.up = UnpoolWithSkip(in_channels, skip_channels, embed_channels, backend=unpool_backend, norm_fn=norm_fn)
        self.blocks = BlockSequence(**_sequence_args(depth, embed_channels, groups, neighbours, qkv_bias,
                                                     pe_multiplier, pe_bias, attn_drop_rate, drop_path_rate,
                                                     enable_checkpoint, norm_fn, grouped_weight))

    def forward(self, points: list, skip_points: list, cluster: torch.Tensor, prompt=None) -> list:
        return self.blocks(self.up(points, skip_points, cluster, prompt), prompt)


class GVAPatchEmbed(nn.Module):
    """The stem: Linear(bias=False)-norm-ReLU to ``embed_channels``, then a
    block sequence at full resolution."""

    def __init__(self, depth, in_channels, embed_channels, groups, neighbours=16, qkv_bias=True, pe_multiplier=False,
                 pe_bias=True, attn_drop_rate=0.0, drop_path_rate=0.0, enable_checkpoint=False, norm_fn=None,
                 grouped_weight=False):
        super().__init__()
        self.in_channels, self.embed_channels = in_channels, embed_channels
        _add_projection(self, "proj", in_channels, embed_channels, False, norm_fn)
        self.blocks = BlockSequence(**_sequence_args(depth, embed_channels, groups, neighbours, qkv_bias,
                                                     pe_multiplier, pe_bias, attn_drop_rate, drop_path_rate,
                                                     enable_checkpoint, norm_fn, grouped_weight))

    def forward(self, points: list, prompt=None) -> list:
        coord, feat, offset = points
        return self.blocks([coord, _project(self, "proj", feat, prompt), offset], prompt)
