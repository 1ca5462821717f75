"""Point Transformer v1 under upstream pimm's names: ``PointTransformer-Seg26``,
``-Seg38``, ``-Seg50`` (semantic segmentation), ``-PartSeg26/38/50`` (part
segmentation, optionally told each event's shape class) and ``-Cls26/38/50``
(one label per event).

Upstream's fixed design: five levels 32, 64, 128, 256, 512 wide, the first
at full resolution and each next one keeping a quarter of every event's
points (farthest point sampling), 8 neighbours at the first level and 16
below, 8 channel groups sharing an attention weight. The number is the
depth: bottlenecks per level (1, 1, 1, 1, 1), (1, 2, 2, 2, 2) or
(1, 2, 3, 5, 2) in the encoder (one fewer per level in the classifiers);
the segmenters' decoders have one per level. The only arguments are
upstream's ``in_channels`` and ``num_classes`` (and ``num_shape_classes``).

``forward(data_dict)`` reads ``coord`` (N, 3), ``feat`` and ``offset`` and
returns logits: (N, num_classes) per point, or (B, num_classes) per event
for the classifiers (``out_channels`` is ``num_classes``). Every event needs
at least 256 points (4 samplings of a quarter); a smaller one is a one-line
error (upstream's sampling kernel would write into the next event's slots).
"""

from __future__ import annotations

import torch
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.domains import MAX_SIZE, Int, Size
from pimm.utils.errors import UserError

from ..point_ops import offset2batch, scatter_mean
from .layers import Bottleneck, TransitionDown, TransitionUp

__all__ = ["PointTransformerSeg", "PointTransformerPartSeg", "PointTransformerCls", "VARIANTS"]

PLANES = (32, 64, 128, 256, 512)
STRIDES = (1, 4, 4, 4, 4)
NSAMPLES = (8, 16, 16, 16, 16)
SHARE_PLANES = 8
DEPTHS = {26: (1, 1, 1, 1, 1), 38: (1, 2, 2, 2, 2), 50: (1, 2, 3, 5, 2)}
MIN_POINTS = 4 ** 4


class _PointTransformerV1(nn.Module):
    """The encoder shared by the three tasks (``enc1`` ... ``enc5``)."""

    name = "PointTransformer"
    blocks: tuple[int, ...] = DEPTHS[26]
    block_offset = 0  # the classifiers' encoders have one bottleneck fewer per level
    _feature_note = ""  # what the features are, for the width error
    domains = dict(in_channels=Size, num_classes=Int(1, MAX_SIZE))

    def __init__(self, in_channels: int, num_classes: int):
        super().__init__()
        self.in_channels, self.num_classes = int(in_channels), int(num_classes)
        self.out_channels = self.num_classes
        self.in_planes = self.in_channels
        for level in range(5):
            self.add_module(f"enc{level + 1}", self._make_enc(PLANES[level], self.blocks[level] - self.block_offset,
                                                              STRIDES[level], NSAMPLES[level]))

    def _make_enc(self, planes: int, blocks: int, stride: int, nsample: int) -> nn.Sequential:
        layers = [TransitionDown(self.in_planes, planes * Bottleneck.expansion, stride, nsample)]
        self.in_planes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.in_planes, self.in_planes, SHARE_PLANES, nsample) for _ in range(blocks)]
        return nn.Sequential(*layers)

    def _levels(self, data_dict: dict, x0: torch.Tensor) -> list[list[torch.Tensor]]:
        """The five encoder levels' ``[p, x, o]``."""
        p0, o0 = data_dict["coord"], data_dict["offset"].int()
        if x0.shape[1] != self.in_channels:
            raise UserError(f"{self.name}: in_channels={self.in_channels} but the batch's features have "
                            f"{x0.shape[1]} channels{self._feature_note}")
        counts = torch.diff(o0.long(), prepend=o0.new_zeros(1).long())
        if counts.numel() and int(counts.min()) < MIN_POINTS:
            event = int(torch.argmin(counts))
            raise UserError(f"{self.name}: event {event} of the batch has {int(counts[event])} points; its four "
                            f"samplings of a quarter need at least {MIN_POINTS} points in every event")
        levels, pxo = [], [p0, x0, o0]
        for level in range(5):
            pxo = getattr(self, f"enc{level + 1}")(pxo)
            levels.append(pxo)
        return levels


class _Segmenter(_PointTransformerV1):
    """Encoder, then a decoder back up the five levels (``dec5`` ... ``dec1``)
    and the per-point classifier ``cls``."""

    @classmethod
    def output_classes(cls, args: dict) -> int | None:
        """Per-point class logits: what ``DefaultSegmentor`` without ``num_classes`` (upstream's form) reads."""
        return args.get("num_classes")

    def __init__(self, in_channels: int, num_classes: int, num_shape_classes: int | None):
        super().__init__(in_channels, num_classes)
        self.num_shape_classes = num_shape_classes
        self.dec5 = self._make_dec(PLANES[4], NSAMPLES[4], is_head=True, num_shape_classes=num_shape_classes)
        for level in (3, 2, 1, 0):
            self.add_module(f"dec{level + 1}", self._make_dec(PLANES[level], NSAMPLES[level]))
        self.cls = nn.Sequential(nn.Linear(PLANES[0], PLANES[0]), nn.BatchNorm1d(PLANES[0]), nn.ReLU(inplace=True),
                                 nn.Linear(PLANES[0], self.num_classes))

    def _make_dec(self, planes: int, nsample: int, is_head: bool = False,
                  num_shape_classes: int | None = None) -> nn.Sequential:
        layers = [TransitionUp(self.in_planes, None if is_head else planes * Bottleneck.expansion, num_shape_classes)]
        self.in_planes = planes * Bottleneck.expansion
        layers.append(Bottleneck(self.in_planes, self.in_planes, SHARE_PLANES, nsample))
        return nn.Sequential(*layers)

    def _shape_class(self, data_dict: dict) -> torch.Tensor | None:
        return None

    def forward(self, data_dict: dict) -> torch.Tensor:
        shape_class = self._shape_class(data_dict)
        levels = self._levels(data_dict, data_dict["feat"])
        p, x, o = levels[4]
        head = self.dec5[0]([p, x, o], shape_class=shape_class)
        coarse = [p, self.dec5[1:]([p, head, o])[1], o]
        for level in (3, 2, 1, 0):
            dec = getattr(self, f"dec{level + 1}")
            p, x, o = levels[level]
            coarse = [p, dec[1:]([p, dec[0]([p, x, o], coarse), o])[1], o]
        return self.cls(coarse[1])


class PointTransformerSeg(_Segmenter):
    """Semantic segmentation (upstream's default 13 classes)."""

    def __init__(self, in_channels: int = 6, num_classes: int = 13):
        super().__init__(in_channels, num_classes, None)


class PointTransformerPartSeg(_Segmenter):
    """Segmentation into parts (upstream's default 50 classes).
    With ``num_shape_classes``, each event's shape class (``cls_token`` (B,)
    in the batch) enters the head as a 1024-wide embedding of its one-hot.
    Without it the head is the segmenter's (upstream's code would crash)."""

    domains = dict(num_shape_classes=Int(1, MAX_SIZE) | None)

    def __init__(self, in_channels: int = 6, num_classes: int = 50, num_shape_classes: int | None = None):
        super().__init__(in_channels, num_classes, num_shape_classes)

    def _shape_class(self, data_dict: dict) -> torch.Tensor | None:
        if self.num_shape_classes is None:
            return None
        if "cls_token" not in data_dict:
            raise UserError(f"{self.name}: num_shape_classes={self.num_shape_classes} needs each event's shape "
                            "class as 'cls_token' (B,) in the batch")
        token = torch.as_tensor(data_dict["cls_token"], device=data_dict["coord"].device).reshape(-1).long()
        events = data_dict["offset"].numel()
        if token.numel() != events or (token.numel() and (int(token.min()) < 0
                                                          or int(token.max()) >= self.num_shape_classes)):
            raise UserError(f"{self.name}: cls_token must hold one shape class in [0, {self.num_shape_classes}) "
                            f"per event ({events} events), got {token.tolist()[:8]}")
        return token


class PointTransformerCls(_PointTransformerV1):
    """Encoder, per-event mean of the last level, upstream's MLP head
    (512-256-128 with BatchNorm and dropout 0.5). The input features are
    ``cat(coord, feat)`` (``coord`` alone with ``in_channels=3``)."""

    block_offset = 1
    _feature_note = " (coord and feat together, as upstream concatenates them)"

    def __init__(self, in_channels: int = 6, num_classes: int = 40):
        super().__init__(in_channels, num_classes)
        self.cls = nn.Sequential(nn.Linear(PLANES[4], 256), nn.BatchNorm1d(256), nn.ReLU(inplace=True),
                                 nn.Dropout(p=0.5), nn.Linear(256, 128), nn.BatchNorm1d(128), nn.ReLU(inplace=True),
                                 nn.Dropout(p=0.5), nn.Linear(128, self.num_classes))

    def forward(self, data_dict: dict) -> torch.Tensor:
        coord = data_dict["coord"]
        x0 = coord if self.in_channels == 3 else torch.cat((coord, data_dict["feat"]), 1)
        p, x, o = self._levels(data_dict, x0)[4]
        return self.cls(scatter_mean(x, offset2batch(o.long(), x.shape[0]), o.numel()))


def _variant(task: type, depth: int) -> type:
    name = f"PointTransformer-{task.__name__.removeprefix('PointTransformer')}{depth}"
    doc = f"``{name}``: :class:`{task.__name__}` with {DEPTHS[depth]} bottlenecks per level."
    variant = type(f"{task.__name__}{depth}", (task,), dict(name=name, blocks=DEPTHS[depth], __doc__=doc,
                                                              __module__=__name__))
    return MODELS.register_module(name)(variant)


#: Upstream's nine registered names -> their classes.
VARIANTS = {cls.name: cls for cls in (_variant(task, depth) for task in (PointTransformerSeg, PointTransformerPartSeg,
                                                                         PointTransformerCls) for depth in DEPTHS)}
