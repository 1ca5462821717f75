"""Trainers, one a module. Each is short because the engine's seams carry it:
:class:`DefaultTrainer` builds everything and runs a supervised step through
:class:`~pimm.engines.optim.step.OptimStep`; the others override a builder or
the step."""

from pimm.engines.trainers.default import DefaultTrainer
from pimm.engines.trainers.gan import GANTrainer
from pimm.engines.trainers.grpo import GRPOTrainer
from pimm.engines.trainers.image_class import ImageClassTrainer
from pimm.engines.trainers.inseg import InsegTrainer
from pimm.engines.trainers.multi_dataset import MultiDatasetTrainer

__all__ = ["DefaultTrainer", "GANTrainer", "GRPOTrainer", "ImageClassTrainer", "InsegTrainer", "MultiDatasetTrainer"]
