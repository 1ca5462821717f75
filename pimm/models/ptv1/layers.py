"""Point Transformer v1's layers (Zhao et al. 2021, as Pointcept / upstream
pimm build them): the vector self-attention over k nearest neighbours, the
bottleneck around it, and the transitions between levels (farthest point
sampling + kNN max-pooling down, inverse-distance interpolation up).

A level is the triple ``[p, x, o]``: coordinates (n, 3), features (n, c) and
the events' cumulative ends ``o`` (B,). Module and parameter names are
upstream's (``transformer.linear_p.0``, ``linear_w.2``, ``dec5.0.linear1.0``,
...), so its state dicts load as they are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..point_ops import offset2batch, scatter_mean
from ..pointops import farthest_point_sampling, interpolation, knn_query_and_group, strided_offset

__all__ = ["LayerNorm1d", "PointTransformerLayer", "TransitionDown", "TransitionUp", "Bottleneck"]


class LayerNorm1d(nn.BatchNorm1d):
    """Upstream's ``LayerNorm1d``: despite the name, a BatchNorm over the
    channels of (n, nsample, c) neighbourhoods."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input.transpose(1, 2).contiguous()).transpose(1, 2).contiguous()


class PointTransformerLayer(nn.Module):
    """Vector attention of each point over its ``nsample`` nearest points:
    weights ``softmax_j(MLP(k_j - q_i + pe_ij))`` per channel group, shared by
    ``share_planes`` groups of channels, applied to ``v_j + pe_ij``; ``pe``
    is an MLP of the neighbour's offset. Missing neighbours (an event smaller
    than ``nsample``) are zero rows that still take part, as upstream's do."""

    def __init__(self, in_planes: int, out_planes: int, share_planes: int = 8, nsample: int = 16):
        super().__init__()
        self.mid_planes = mid_planes = out_planes
        self.out_planes, self.share_planes, self.nsample = out_planes, share_planes, nsample
        self.linear_q = nn.Linear(in_planes, mid_planes)
        self.linear_k = nn.Linear(in_planes, mid_planes)
        self.linear_v = nn.Linear(in_planes, out_planes)
        self.linear_p = nn.Sequential(nn.Linear(3, 3), LayerNorm1d(3), nn.ReLU(inplace=True), nn.Linear(3, out_planes))
        group_planes = out_planes // share_planes
        self.linear_w = nn.Sequential(LayerNorm1d(mid_planes), nn.ReLU(inplace=True),
                                      nn.Linear(mid_planes, group_planes), LayerNorm1d(group_planes),
                                      nn.ReLU(inplace=True), nn.Linear(group_planes, group_planes))
        self.softmax = nn.Softmax(dim=1)

    def forward(self, pxo) -> torch.Tensor:
        p, x, o = pxo
        query, key, value = self.linear_q(x), self.linear_k(x), self.linear_v(x)
        key, idx = knn_query_and_group(key, p, o, new_xyz=p, new_offset=o, nsample=self.nsample, with_xyz=True)
        value, _ = knn_query_and_group(value, p, o, new_xyz=p, new_offset=o, idx=idx)
        n, nsample, channels = value.shape
        pos = self.linear_p(key[..., :3])  # (n, nsample, out_planes)
        pos_sum = pos.view(n, nsample, -1, self.mid_planes).sum(2)
        weight = self.softmax(self.linear_w(key[..., 3:] - query.unsqueeze(1) + pos_sum))  # (n, nsample, c / s)
        grouped = (value + pos).view(n, nsample, self.share_planes, channels // self.share_planes)
        return (grouped * weight.unsqueeze(2)).sum(1).reshape(n, channels)


class TransitionDown(nn.Module):
    """``stride`` 1: a pointwise Linear-BN-ReLU. Otherwise ``count // stride``
    points per event by farthest point sampling, each taking the max over its
    ``nsample`` nearest points of Linear-BN-ReLU of (offset, feature)."""

    def __init__(self, in_planes: int, out_planes: int, stride: int = 1, nsample: int = 16):
        super().__init__()
        self.stride, self.nsample = stride, nsample
        if stride != 1:
            self.linear = nn.Linear(3 + in_planes, out_planes, bias=False)
            self.pool = nn.MaxPool1d(nsample)
        else:
            self.linear = nn.Linear(in_planes, out_planes, bias=False)
        self.bn = nn.BatchNorm1d(out_planes)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, pxo):
        p, x, o = pxo
        if self.stride == 1:
            return [p, self.relu(self.bn(self.linear(x))), o]
        new_o = strided_offset(o, self.stride)
        new_p = p[farthest_point_sampling(p, o, new_o)]
        x, _ = knn_query_and_group(x, p, o, new_xyz=new_p, new_offset=new_o, nsample=self.nsample, with_xyz=True)
        x = self.relu(self.bn(self.linear(x).transpose(1, 2).contiguous()))  # (m, c, nsample)
        return [new_p, self.pool(x).squeeze(-1), new_o]


class TransitionUp(nn.Module):
    """The decoder's entry. The head (``out_planes=None``) appends to every
    point the MLP of its event's mean feature (and, with
    ``num_shape_classes``, a 1024-wide embedding of the event's shape class,
    as part segmentation does); the others add the coarser level's features,
    interpolated onto this level, to this level's own."""

    def __init__(self, in_planes: int, out_planes: int | None = None, num_shape_classes: int | None = None):
        super().__init__()
        self.num_shape_classes = num_shape_classes if out_planes is None else None
        if out_planes is None:
            extra = 1024 if self.num_shape_classes is not None else 0
            self.linear1 = nn.Sequential(nn.Linear(2 * in_planes + extra, in_planes), nn.BatchNorm1d(in_planes),
                                         nn.ReLU(inplace=True))
            self.linear2 = nn.Sequential(nn.Linear(in_planes, in_planes), nn.ReLU(inplace=True))
            if self.num_shape_classes is not None:
                self.linear3 = nn.Sequential(nn.Linear(self.num_shape_classes, 1024), nn.ReLU(inplace=True))
        else:
            self.linear1 = nn.Sequential(nn.Linear(out_planes, out_planes), nn.BatchNorm1d(out_planes),
                                         nn.ReLU(inplace=True))
            self.linear2 = nn.Sequential(nn.Linear(in_planes, out_planes), nn.BatchNorm1d(out_planes),
                                         nn.ReLU(inplace=True))

    def forward(self, pxo1, pxo2=None, shape_class: torch.Tensor | None = None) -> torch.Tensor:
        if pxo2 is None:
            _, x, o = pxo1
            batch = offset2batch(o.long(), x.shape[0])
            parts = [x, self.linear2(scatter_mean(x, batch, o.numel())).index_select(0, batch)]
            if self.num_shape_classes is not None:
                onehot = F.one_hot(shape_class.long(), self.num_shape_classes).to(x.dtype)
                parts.append(self.linear3(onehot).index_select(0, batch))
            return self.linear1(torch.cat(parts, 1))
        p1, x1, o1 = pxo1
        p2, x2, o2 = pxo2
        return self.linear1(x1) + interpolation(p2, p1, self.linear2(x2), o2, o1)


class Bottleneck(nn.Module):
    """Linear-BN-ReLU, :class:`PointTransformerLayer`-BN-ReLU, Linear-BN, plus the input, ReLU."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, share_planes: int = 8, nsample: int = 16):
        super().__init__()
        self.linear1 = nn.Linear(in_planes, planes, bias=False)
        self.bn1 = nn.BatchNorm1d(planes)
        self.transformer = PointTransformerLayer(planes, planes, share_planes, nsample)
        self.bn2 = nn.BatchNorm1d(planes)
        self.linear3 = nn.Linear(planes, planes * self.expansion, bias=False)
        self.bn3 = nn.BatchNorm1d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, pxo):
        p, x, o = pxo
        out = self.relu(self.bn1(self.linear1(x)))
        out = self.relu(self.bn2(self.transformer([p, out, o])))
        out = self.bn3(self.linear3(out))
        return [p, self.relu(out + x), o]
