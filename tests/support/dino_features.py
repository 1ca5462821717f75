"""``RandomDinoFeatures``: a stand-in for a data set whose events carry DINO
image features (pimm computes none), so ``DINOEnhancedSegmentor`` can train
in tests and in docs/models.md's example (imported via ``custom_imports``).

Per event: ``num_points`` feature points spread uniformly over the bounding
box of ``origin_coord`` (the frame the model matches in) as ``dino_coord``,
and ``dim`` standard-normal features each as ``dino_feat``, drawn from
numpy's global generator like pimm's augmentations (the loader seeds it)."""

from __future__ import annotations

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import PosInt, Size

__all__ = ["RandomDinoFeatures"]


@TRANSFORMS.register_module(force=True)
class RandomDinoFeatures:
    domains = dict(dim=Size, num_points=PosInt)

    def __init__(self, dim: int = 8, num_points: int = 64):
        self.dim, self.num_points = int(dim), int(num_points)

    def __call__(self, data: dict) -> dict:
        origin = np.asarray(data["origin_coord"], dtype=np.float32)
        low, high = origin.min(0), origin.max(0)
        out = dict(data)
        out["dino_coord"] = (low + np.random.rand(self.num_points, 3) * (high - low)).astype(np.float32)
        out["dino_feat"] = np.random.randn(self.num_points, self.dim).astype(np.float32)
        return out
