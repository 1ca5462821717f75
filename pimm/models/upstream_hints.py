"""What to use instead of the models and losses upstream pimm registers that
pimm does not build: naming one in a config is one line saying so (the
registry's hint), never a bare "unknown type". A name that gets built later
is found first; its hint is then never shown."""

from __future__ import annotations

from pimm.engines.registries import MODELS

from .losses import LOSSES

__all__ = ["MODEL_HINTS", "LOSS_HINTS"]

_SPARSE_UNET = "use SparseUNet (pimm's pure-PyTorch sparse-convolution U-Net, docs/models.md) under DefaultSegmentor"
_PTV3 = "use PT-v3m2 (or PT-v3m1) under DefaultSegmentorV2 (docs/models.md)"
_DETECTOR = ("an older version of upstream's Panda detector; pimm builds its successors detector-v4 and "
             "detector-v5 (docs/models.md), or use PointGroupLite / PointGroupAffinity with InsSegTester")

MODEL_HINTS = {
    "DINOEnhancedSegmentor": ("needs per-point DINO image features (dino_coord, dino_feat), which no pimm data set "
                              "provides; use DefaultSegmentorV2"),
    "LitePT": _PTV3,
    "PG-v1m1": "use PointGroupLite (upstream's PointGroup idea: semantic + centroid offsets, then clustering)",
    "SpUNetNoSkipBase": _SPARSE_UNET,
    "detector-v3m2": _DETECTOR,
}
for _name in ("MinkUNet14", "MinkUNet14A", "MinkUNet14B", "MinkUNet14C", "MinkUNet14D", "MinkUNet18", "MinkUNet18A",
              "MinkUNet18B", "MinkUNet18D", "MinkUNet34", "MinkUNet34A", "MinkUNet34B", "MinkUNet34C", "MinkUNet50",
              "MinkUNet101", "SpUNet-v1m1", "SpUNet-v1m2", "SpUNet-v1m3"):
    MODEL_HINTS[_name] = _SPARSE_UNET
for _name in ("PT-v2m1", "PT-v2m2", "PT-v2m3", "Volt-v1m1", "Volt-v1m2",
              "PointTransformer-Cls26", "PointTransformer-Cls38", "PointTransformer-Cls50",
              "PointTransformer-PartSeg26", "PointTransformer-PartSeg38", "PointTransformer-PartSeg50",
              "PointTransformer-Seg26", "PointTransformer-Seg38", "PointTransformer-Seg50"):
    MODEL_HINTS[_name] = _PTV3

LOSS_HINTS: dict[str, str] = {}  # every loss upstream registers is built

for _name, _hint in MODEL_HINTS.items():
    MODELS.add_hint(_name, _hint)
for _name, _hint in LOSS_HINTS.items():
    LOSSES.add_hint(_name, _hint)
