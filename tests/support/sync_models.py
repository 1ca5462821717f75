"""A point-cloud instance model without data-dependent shapes, for the host-sync
test of InsegTrainer (``tests/test_no_host_sync.py``): the shipped sparse models
build their kernel maps on the host, which a sync test of the trainer must not
be about."""

from __future__ import annotations

import torch
from torch import nn

from pimm.engines.registries import MODELS


@MODELS.register_module(force=True)
class PointwiseInstanceModel(nn.Module):
    """Per-point MLP: semantic logits and an offset vector per point; the loss is
    cross-entropy on ``segment`` (ignore -1) plus the offset norm on points that
    belong to an instance (masked by multiplication, never by indexing)."""

    def __init__(self, in_channels: int = 1, num_classes: int = 5, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_channels + 3, hidden), nn.ReLU(), nn.Linear(hidden, num_classes + 3))
        self.num_classes = num_classes

    def forward(self, batch: dict) -> dict:
        out = self.net(torch.cat([batch["feat"], batch["coord"]], 1))
        logits, offset = out[:, :self.num_classes], out[:, self.num_classes:]
        result = {"seg_logits": logits, "instance_pred": logits.argmax(1)}  # one instance per class
        if "segment" in batch:
            seg_loss = nn.functional.cross_entropy(logits, batch["segment"].long(), ignore_index=-1)
            in_instance = (batch["instance"] >= 0).to(offset.dtype)
            offset_loss = (offset.norm(dim=1) * in_instance).sum() / in_instance.sum().clamp_min(1.0)
            result.update(loss=seg_loss + offset_loss, seg_loss=seg_loss.detach(), offset_loss=offset_loss.detach())
        return result
