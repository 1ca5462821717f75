"""InsegTrainer: instance segmentation on point clouds.

The only difference from the DefaultTrainer is collation: instance ids are
made unique across the events of a batch (``inseg_collate_fn``, registered
by the data package) for training and evaluation alike, so per-event
instance targets survive batching. Resume is the DefaultTrainer's, exact.
"""

from __future__ import annotations

from pimm.engines.trainers.default import DefaultTrainer
from pimm.engines.registries import TRAINERS

__all__ = ["InsegTrainer"]


@TRAINERS.register_module()
class InsegTrainer(DefaultTrainer):
    """DefaultTrainer with ``inseg_collate_fn`` for training and validation
    (instance ids unique across the events of a batch); ``collate_fn`` and
    ``val_collate_fn`` override it."""

    default_collate_fn = "inseg_collate_fn"
