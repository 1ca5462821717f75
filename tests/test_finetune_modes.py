"""Upstream's three fine-tuning modes of ``DefaultSegmentorV2`` + PT-v3m2, as
its ``semseg-pt-v3m2-pilarnet-ft-5cls-{lin,dec,fft}`` configs set them, trained
a few steps with the optimizer the trainer builds (AdamW with weight decay,
upstream's ``param_dicts``):

* lin: ``freeze_backbone=True`` + ``enc_mode=True``: only the linear head on
  the concatenated encoder features trains; the backbone stays bit-identical
  and in eval mode;
* dec: ``freeze_encoder=True``: embedding and encoder stay bit-identical, the
  decoder and head train;
* fft: everything trains.
"""

from __future__ import annotations

import torch

from pimm.engines.optim import build_optimizer
from pimm.engines.registries import MODELS
from tests.test_ptv3 import TINY, lartpc_like_batch

ENC_CHANNELS = (8, 16)


def build(**overrides):
    backbone = dict(TINY, enc_depths=(1, 1), enc_channels=ENC_CHANNELS, drop_path=0.3,
                    **overrides.pop("backbone", {}))
    torch.manual_seed(0)
    return MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone=backbone,
                             criteria=[dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
                                       dict(type="LovaszLoss", mode="multiclass", loss_weight=1 / 20,
                                            ignore_index=-1, class_weights=None)],
                             **overrides))


def train_steps(model, param_dicts=None, steps=3):
    """Snapshots of every parameter before and after a few AdamW steps."""
    optimizer = build_optimizer(dict(type="AdamW", lr=0.01, weight_decay=0.04), model, param_dicts)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    for step in range(steps):
        out = model(lartpc_like_batch(seed=step))
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return before, after


def changed(before, after, prefix):
    names = [n for n in before if n.startswith(prefix)]
    assert names, prefix
    return {n for n in names if not torch.equal(before[n], after[n])}, names


def test_lin_frozen_encoder_only_backbone_with_a_linear_head():
    width = sum(ENC_CHANNELS)  # upstream's 1232 = 48 + 96 + 192 + 384 + 512
    model = build(backbone_out_channels=width, freeze_backbone=True, backbone=dict(enc_mode=True, traceable=True))
    assert model.seg_head.in_features == width and "dec" not in dict(model.backbone.named_children())
    assert not any(p.requires_grad for p in model.backbone.parameters())
    before, after = train_steps(model, param_dicts=[dict(keyword="block", lr=0.00015)])
    assert not model.backbone.training  # train() every epoch leaves it in eval mode (no drop path)
    moved, names = changed(before, after, "backbone.")
    assert not moved, sorted(moved)[:5]
    moved, names = changed(before, after, "seg_head.")
    assert moved == set(names)


def test_dec_frozen_encoder_trainable_decoder():
    model = build(backbone_out_channels=8, backbone=dict(freeze_encoder=True))
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("backbone.embedding.", "backbone.enc.")) for n in frozen)
    assert all(not p.requires_grad for n, p in model.named_parameters()
               if n.startswith(("backbone.embedding.", "backbone.enc.")))
    before, after = train_steps(model, param_dicts=[dict(keyword="dec0.block0.", lr=0.002)])
    for prefix in ("backbone.embedding.", "backbone.enc."):
        moved, _ = changed(before, after, prefix)
        assert not moved, sorted(moved)[:5]
    moved, names = changed(before, after, "backbone.dec.")
    assert moved == set(names)
    moved, names = changed(before, after, "seg_head.")
    assert moved == set(names)


def test_fft_trains_every_parameter():
    model = build(backbone_out_channels=8, freeze_backbone=False, backbone=dict(freeze_encoder=False))
    before, after = train_steps(model, param_dicts=[dict(keyword="enc0.block0.", lr=1e-4),
                                                     dict(keyword="dec0.block0.", lr=1e-3)])
    moved, names = changed(before, after, "")
    assert moved == set(names)
