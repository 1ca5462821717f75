"""The engine: trainer lifecycle, hooks, checkpointing and the registries.

Users import from here::

    from pimm.engines import TRAINERS, TrainerBase, DefaultTrainer, HOOKS, HookBase
"""

from pimm.engines.registries import (COLLATE_FNS, DATASETS, HOOKS, MODELS, OPTIMIZERS, SCHEDULERS, TRAINERS,
                                     TRANSFORMS)
from pimm.engines.hooks import *  # noqa: F401,F403  (registers the built-in hooks)
from pimm.engines.hooks import HookBase, EvaluatorBase
from pimm.engines.trainer_base import TrainerBase
from pimm.engines.default_trainer import DefaultTrainer
from pimm.engines.grpo_trainer import GRPOTrainer
from pimm.engines.image_class_trainer import ImageClassTrainer
from pimm.engines.inseg_trainer import InsegTrainer
from pimm.engines.multi_dataset_trainer import MultiDatasetTrainer

__all__ = ["TRAINERS", "HOOKS", "OPTIMIZERS", "SCHEDULERS", "MODELS", "DATASETS", "TRANSFORMS", "COLLATE_FNS",
           "TrainerBase", "DefaultTrainer", "GRPOTrainer", "ImageClassTrainer", "InsegTrainer", "MultiDatasetTrainer", "HookBase", "EvaluatorBase"]
