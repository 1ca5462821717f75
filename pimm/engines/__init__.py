"""The engine: trainer lifecycle, hooks, the optimizer step, the metric
channel, checkpointing and the registries.

Users import from here::

    from pimm.engines import TRAINERS, TrainerBase, DefaultTrainer, HOOKS, HookBase
"""

from pimm.engines.registries import (COLLATE_FNS, DATASETS, HOOKS, MODELS, OPTIMIZERS, SCHEDULERS, TRAINERS,
                                     TRANSFORMS)
from pimm.engines.hooks import *  # noqa: F401,F403  (registers the built-in hooks)
from pimm.engines.hooks import EvalRun, EvaluatorBase, HookBase
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.optim.step import OptimStep, StepResult
from pimm.engines.optim.scheduler import scale_lr
from pimm.engines.loop.trainer_base import TrainerBase
from pimm.engines.optim import scheduler_upstream  # noqa: F401  (upstream's extra schedules; last_epoch)
from pimm.engines.trainers import DefaultTrainer, GRPOTrainer, ImageClassTrainer, InsegTrainer, MultiDatasetTrainer

__all__ = ["TRAINERS", "HOOKS", "OPTIMIZERS", "SCHEDULERS", "MODELS", "DATASETS", "TRANSFORMS", "COLLATE_FNS",
           "TrainerBase", "DefaultTrainer", "GRPOTrainer", "ImageClassTrainer", "InsegTrainer", "MultiDatasetTrainer", "HookBase",
           "EvalRun", "EvaluatorBase", "MetricChannel", "OptimStep", "StepResult", "scale_lr"]
