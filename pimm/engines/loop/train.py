"""Upstream pimm's import path for the trainer registry: ``from pimm.engines.loop.train
import TRAINERS``. ``Trainer`` is upstream's name for the plain supervised trainer,
pimm's :class:`~pimm.engines.trainers.default.DefaultTrainer`."""

from pimm.engines.registries import TRAINERS
from pimm.engines.trainers.default import DefaultTrainer

Trainer = DefaultTrainer

__all__ = ["TRAINERS", "Trainer", "DefaultTrainer"]
