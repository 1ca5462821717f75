"""Testers: how ``tools/test.py`` (and the ``FinalEvaluator`` hook) score
weights on ``data.test``.

A config may name one, ``test = dict(type="SemSegTester", ...)`` (upstream
pimm's vocabulary); without it the evaluator hooks of the config are used.
A tester here is an evaluator configured for the test split: it builds that
evaluator (which takes its classes from ``data`` like any evaluator) and
the trainer runs it over the test loader with the weights loaded strictly.
"""

from __future__ import annotations

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError

__all__ = ["TesterBase"]


class TesterBase:
    """``evaluator``: the evaluator hook config; ``verbose``: log the resolved
    config before testing."""

    evaluator_type: str | None = None

    def __init__(self, verbose: bool = False, **evaluator_options):
        if not isinstance(verbose, bool):
            raise ConfigError(f"{type(self).__name__}: verbose must be True or False, got {verbose!r}")
        if self.evaluator_type is None:
            raise ConfigError(f"{type(self).__name__} names no evaluator (set evaluator_type)")
        self.verbose = verbose
        self.evaluator_cfg = dict(type=self.evaluator_type, **evaluator_options)

    def build_evaluator(self, cfg) -> EvaluatorBase:
        evaluator = HOOKS.build(self.evaluator_cfg)
        if not isinstance(evaluator, EvaluatorBase):
            raise ConfigError(f"{type(self).__name__}: {self.evaluator_type} is not an evaluator hook")
        evaluator.modify_config(cfg)
        evaluator.prefix = "test"
        return evaluator
