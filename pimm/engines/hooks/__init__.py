"""Hooks that ship with the engine. Each owns one job; see ``base`` for the contract
and docs/hooks.md for every hook's options and an example."""

from pimm.engines.hooks.base import PRIORITIES, EvalRun, HookBase
from pimm.engines.hooks.checkpoint import CheckpointLoader, CheckpointSaver
from pimm.engines.hooks.crash import SimulateCrash
from pimm.engines.hooks.early_stopping import EarlyStopping
from pimm.engines.hooks.ema import EMAHook
from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.hooks.information_writer import InformationWriter
from pimm.engines.hooks.memory import EmptyCache
from pimm.engines.hooks.nan_guard import NaNGuard, NonFiniteStep
from pimm.engines.hooks.live_control import LiveControl
from pimm.engines.hooks.lr_plateau import ReduceLROnPlateau
from pimm.engines.hooks.on_demand import OnDemandValidation
from pimm.engines.hooks.progress import ProgressBar
from pimm.engines.hooks.timer import IterationTimer
from pimm.engines.hooks.upstream import FinalEvaluator, ModelHook
from pimm.engines.hooks.resources import ResourceUtilizationLogger
from pimm.engines.hooks.upstream_runtime import (CheckpointSaverIteration, DtypeOverrider, GradientNormLogger,
                                                 ParameterCounter, WandbNamer, WeightDecayExclusion,
                                                 WeightDecayScheduler)
from pimm.engines.hooks.upstream_diagnostics import GarbageHandler, LogitEntropyLogger, RuntimeProfiler

__all__ = ["HookBase", "EvalRun", "PRIORITIES", "CheckpointLoader", "CheckpointSaver", "EarlyStopping", "EMAHook",
           "EvaluatorBase", "InformationWriter", "IterationTimer", "NaNGuard", "NonFiniteStep", "ProgressBar",
           "EmptyCache", "ModelHook", "FinalEvaluator", "LiveControl", "OnDemandValidation",
           "ReduceLROnPlateau", "CheckpointSaverIteration", "DtypeOverrider", "GradientNormLogger",
           "ParameterCounter", "ResourceUtilizationLogger", "WandbNamer", "WeightDecayExclusion",
           "WeightDecayScheduler", "SimulateCrash", "GarbageHandler", "LogitEntropyLogger", "RuntimeProfiler"]
