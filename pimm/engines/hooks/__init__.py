"""Hooks that ship with the engine. Each owns one job; see ``base`` for the contract."""

from pimm.engines.hooks.base import PRIORITIES, HookBase
from pimm.engines.hooks.checkpoint import CheckpointLoader, CheckpointSaver
from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.hooks.information_writer import InformationWriter
from pimm.engines.hooks.live_control import LiveControl
from pimm.engines.hooks.on_demand import OnDemandValidation
from pimm.engines.hooks.progress import ProgressBar
from pimm.engines.hooks.timer import IterationTimer

__all__ = ["HookBase", "PRIORITIES", "CheckpointLoader", "CheckpointSaver", "EvaluatorBase", "InformationWriter",
           "LiveControl", "OnDemandValidation", "ProgressBar", "IterationTimer"]
