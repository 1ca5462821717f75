"""Testers: how ``tools/test.py`` (and the ``FinalEvaluator`` hook) score
weights on ``data.test``.

:class:`Tester` is what ``tools/test.py`` (and ``test_only=True``) builds
instead of a trainer: the model, the test loader and the evaluators from the
same builders as the trainer the config names (its
``default_collate_fn`` included), and nothing a training needs, so no
trainer is ever half-built.

A config may name a test evaluator, ``test = dict(type="SemSegTester", ...)`` (upstream
pimm's vocabulary); without it the evaluator hooks of the config are used.
A tester here is an evaluator configured for the test split: it builds that
evaluator (which takes its classes from ``data`` like any evaluator) and
the trainer runs it over the test loader with the weights loaded strictly.
"""

from __future__ import annotations

import logging
import weakref
from pathlib import Path

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.run.parallel import full_parameters
from pimm.engines.loop.prepare import prepare_config
from pimm.engines.registries import HOOKS, TRAINERS
from pimm.engines.run.runtime import apply_process_settings
from pimm.engines.trainers.builders import ComponentBuilders
from pimm.engines.trainers.evaluation import TestScoring
from pimm.utils import comm
from pimm.utils.errors import ConfigError

__all__ = ["Tester", "TesterBase"]


class Tester(ComponentBuilders, TestScoring):
    """Scores ``cfg.weight`` on ``data.test``: ``Tester(cfg).test()``.

    ``hooks``: the built hooks (the command line builds them while preparing
    the config); None prepares the config here as the command line does. Of
    the hooks only the evaluators are used. ``collate_fn`` /
    ``val_collate_fn``: the trainer options of the same names; the other
    ``train`` options concern training and are ignored here.
    """

    global_step = 0  # no training step: test_metrics.json names the weight file instead

    def __init__(self, cfg, hooks=None, collate_fn=None, val_collate_fn=None, **train_options):
        self.rank, self.world_size = comm.get_rank(), comm.get_world_size()
        if hooks is None:
            hooks = prepare_config(cfg, self.world_size, mode="test")
        self.cfg = cfg
        self.logger = logging.getLogger("pimm")
        apply_process_settings(cfg)
        trainer_type = (cfg.get("train") or {}).get("type", "DefaultTrainer")
        trainer_cls = TRAINERS.get(trainer_type) if trainer_type in TRAINERS else None
        self.default_collate_fn = getattr(trainer_cls, "default_collate_fn", None)
        self.options = dict(collate_fn=collate_fn, val_collate_fn=val_collate_fn, iters_per_epoch=None,
                            find_unused_parameters=False)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.save_path = Path(cfg.save_path)
        self._val_loader = self._test_loader = None
        self.evaluators = [h for h in hooks if isinstance(h, EvaluatorBase)]
        proxy = weakref.proxy(self)
        for evaluator in self.evaluators:
            evaluator.trainer = proxy  # evaluate() moves batches with to_device and runs under autocast
        self.model_without_ddp = self.build_model().to(self.device)
        self.model = self.model_without_ddp
        self.autocast = self._build_autocast()
        if self.evaluators or cfg.get("test") is not None:
            self._check_eval_split("test")

    def full_parameters(self, model: torch.nn.Module | None = None):
        """A no-op context here: the tested model is not sharded."""
        return full_parameters(self.model_without_ddp if model is None else model)

    def test(self, weight=None) -> dict:
        """Score ``weight`` (default ``cfg.weight``) on the test split; the weights
        must fit the model exactly. Writes ``save_path/test_metrics.json``."""
        weight = self.cfg.weight if weight is None else weight
        if weight is None:
            raise ConfigError("testing needs the weights to evaluate: weight=PATH/model_best.pth")
        return super().test(weight)


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
        """The evaluator hook this tester names, configured for ``cfg`` with prefix ``test``."""
        evaluator = HOOKS.build(self.evaluator_cfg)
        if not isinstance(evaluator, EvaluatorBase):
            raise ConfigError(f"{type(self).__name__}: {self.evaluator_type} is not an evaluator hook")
        evaluator.modify_config(cfg)
        evaluator.prefix = "test"
        return evaluator
