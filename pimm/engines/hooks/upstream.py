"""Hooks of upstream pimm's default runtime that pimm provides.

* ``ModelHook``: a model that is itself a :class:`HookBase` gets the phases.
* ``FinalEvaluator(test_last=False)``: after training, score
  ``model/model_best.pth`` (or the last weights) on ``data.test`` with the
  config's tester (``test = dict(...)``) or its evaluators, and write
  ``test_metrics.json`` as ``tools/test.py`` does.

(Upstream's ``InstanceSegmentationEvaluator`` is in :mod:`pimm.evaluation.panoptic`,
its ``AttentionMaskAnnealingHook`` in :mod:`pimm.engines.hooks.upstream_diagnostics`.)
"""

from __future__ import annotations

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS

__all__ = ["ModelHook", "FinalEvaluator"]

_FORWARDED = ("before_train", "before_epoch", "before_step", "after_step", "after_epoch", "after_train")


@HOOKS.register_module()
class ModelHook(HookBase):
    """Forwards the loop's phases to the model when the model is a hook."""

    def __init__(self):
        self._model_hook: HookBase | None = None

    def before_train(self):
        model = self.trainer.model_without_ddp
        if isinstance(model, HookBase):
            model.trainer = self.trainer
            self._model_hook = model
            model.before_train()

    def _forward(phase):
        def call(self):
            if self._model_hook is not None:
                getattr(self._model_hook, phase)()
        call.__name__ = phase
        call.__doc__ = f"The model's ``{phase}`` (when the model is a hook)."
        return call

    before_epoch = _forward("before_epoch")
    before_step = _forward("before_step")
    after_step = _forward("after_step")
    after_epoch = _forward("after_epoch")
    after_train = _forward("after_train")
    del _forward


@HOOKS.register_module()
class FinalEvaluator(HookBase):
    """After a completed (or requested-stop) run with ``evaluate=True``: score the
    best model (``test_last=True``: the last weights) on ``data.test``."""

    priority = "LOWEST"  # after every other hook's after_train

    def __init__(self, test_last: bool = False):
        if not isinstance(test_last, bool):
            raise ValueError(f"test_last must be True or False, got {test_last!r}")
        self.test_last = test_last

    def after_train(self):
        trainer = self.trainer
        if trainer.outcome not in ("completed", "stopped") or not trainer.cfg.evaluate:
            return
        best = trainer.save_path / "model" / "model_best.pth"
        weight = None if self.test_last or not best.is_file() else best
        if weight is None and not self.test_last:
            trainer.logger.info("FinalEvaluator: no model_best.pth (no evaluator selects a best model); testing the "
                                "last weights")
        trainer.test(weight)


