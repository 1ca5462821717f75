"""ImageClassTrainer: dense ``(B, C, H, W)`` image batches.

Images collate with torch's default collate (stacking), which the
DefaultTrainer would also pick for a data set without its own
``collate_fn``; this trainer makes the choice explicit and refuses a
point-cloud collate by mistake.
"""

from __future__ import annotations

from pimm.engines.trainers.default import DefaultTrainer
from pimm.engines.registries import TRAINERS

__all__ = ["ImageClassTrainer"]


@TRAINERS.register_module()
class ImageClassTrainer(DefaultTrainer):
    """DefaultTrainer for dense image batches: torch's default (stacking)
    collate unless the config names one; everything else, resume included, is the
    DefaultTrainer's."""

    default_collate_fn = "default_collate"
