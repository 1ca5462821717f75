"""A small CNN for classifying unrolled water-Cherenkov ring images.

Sized to train in about a minute on two CPU cores (see ``configs/rings``): a
stem convolution, a few stride-2 stages of 3x3 conv + norm + ReLU, global
average pooling and a linear head. The image's column axis is the detector
azimuth ``phi``, which is periodic, so convolutions pad it circularly: a ring
that straddles the seam of the unrolled barrel looks the same to the network
as one in the middle. The row axis (height ``z``) ends at the caps and is
zero-padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.utils.errors import UserError
from pimm.utils.config_domains import answers_with
from pimm.utils.domains import Choice, Int, MAX_SIZE, Real, Size

__all__ = ["RingCNN", "ConvNormAct"]


class ConvNormAct(nn.Module):
    """3x3 conv (circular padding along width if asked) + norm + ReLU."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, norm: str, circular_width: bool):
        super().__init__()
        self.circular_width = circular_width
        # Height is zero-padded by the conv itself; width is padded by hand below,
        # circularly when asked (one concatenation, cheaper than F.pad twice).
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size=3, stride=stride, padding=(1, 0), bias=False)
        if norm == "bn":
            self.norm = nn.BatchNorm2d(out_ch)
        else:  # "gn": batch-size independent, for tiny per-rank batches
            self.norm = nn.GroupNorm(max(1, out_ch // 8), out_ch)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.circular_width:
            x = torch.cat([x[..., -1:], x, x[..., :1]], dim=-1)
        else:
            x = F.pad(x, (1, 1))
        return self.act(self.norm(self.conv(x)))


@MODELS.register_module()
class RingCNN(nn.Module):
    """Image classifier for ``CherenkovRingDataset``-style inputs.

    Args:
        in_channels: image channels (2 for charge + time, 1 for charge only).
        num_classes: output classes.
        width: channels after the stem; each stage doubles them (capped at ``8*width``).
        depth: number of stride-2 stages (each halves H and W).
        stem_stride: stride of the stem conv; 2 quarters the cost of everything
            after it, for large images on a CPU.
        blocks_per_stage: conv blocks per stage (the first one downsamples).
        norm: ``"bn"`` (BatchNorm) or ``"gn"`` (GroupNorm).
        circular_phi: pad the width (phi) axis circularly.
        dropout: dropout before the linear head.

    ``forward(input_dict)`` takes ``img`` (B,C,H,W) and optionally ``label`` (B,);
    returns ``cls_logits`` (B,num_classes) and, with labels, the cross-entropy ``loss``.
    """

    domains = dict(in_channels=Size, num_classes=Int(1, MAX_SIZE), width=Size, depth=Int(1, 64),
                   stem_stride=Int(1, 16), blocks_per_stage=Int(1, 64), norm=Choice("bn", "gn"),
                   dropout=Real(0, 1, hi_open=True))
    output_classes = answers_with("num_classes")  # the columns of cls_logits

    def __init__(
        self,
        in_channels: int = 2,
        num_classes: int = 2,
        width: int = 16,
        depth: int = 3,
        stem_stride: int = 1,
        blocks_per_stage: int = 1,
        norm: str = "bn",
        circular_phi: bool = True,
        dropout: float = 0.0,
    ):
        super().__init__()
        for name, value, low in (
            ("in_channels", in_channels, 1),
            ("num_classes", num_classes, 2),
            ("width", width, 1),
            ("depth", depth, 1),
            ("stem_stride", stem_stride, 1),
            ("blocks_per_stage", blocks_per_stage, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise UserError(f"RingCNN: {name} must be an integer >= {low}, got {value!r}")
        if norm not in ("bn", "gn"):
            raise UserError(f"RingCNN: norm must be 'bn' or 'gn', got {norm!r}")
        if not 0.0 <= dropout < 1.0:
            raise UserError(f"RingCNN: dropout must be in [0, 1), got {dropout!r}")
        self.in_channels = in_channels
        self.num_classes = num_classes

        layers = [ConvNormAct(in_channels, width, stem_stride, norm, circular_phi)]
        channels = width
        for _ in range(depth):
            out = min(channels * 2, 8 * width)
            layers.append(ConvNormAct(channels, out, 2, norm, circular_phi))
            layers.extend(ConvNormAct(out, out, 1, norm, circular_phi) for _ in range(blocks_per_stage - 1))
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(channels, num_classes))

    def forward(self, input_dict: dict) -> dict:
        img = input_dict["img"]
        if img.dim() != 4 or img.shape[1] != self.in_channels:
            raise UserError(
                f"RingCNN: expected img of shape (B, {self.in_channels}, H, W), got {tuple(img.shape)}; "
                "set model.in_channels to the dataset's channel count"
            )
        feats = self.features(img).mean(dim=(2, 3))
        logits = self.head(feats)
        out = {"cls_logits": logits}
        label = input_dict.get("label")
        if label is not None:
            out["loss"] = F.cross_entropy(logits, label.long().view(-1))
        return out
