"""IterationTimer: step time and ETA, shared through the metric channel
(``time/step``, ``time/eta``; the trainer publishes ``time/data``)."""

from __future__ import annotations

import time

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Count

__all__ = ["IterationTimer"]


@HOOKS.register_module()
class IterationTimer(HookBase):
    """Publish ``time/step`` and ``time/eta`` each step.

    ``time/step`` is the step alone. The ETA is based on wall-clock time per
    step since the first ``warmup_iter`` steps (start-up, compilation,
    allocator warm-up), so evaluations, checkpoints and logging between steps
    count in it as often as they have occurred so far."""
    # Before the writers (NORMAL) so a log line at this step sees this step's timing.
    priority = "HIGH"

    domains = dict(warmup_iter=Count)

    def __init__(self, warmup_iter: int = 1):
        if isinstance(warmup_iter, bool) or not isinstance(warmup_iter, int) or warmup_iter < 0:
            raise ValueError(f"warmup_iter must be an integer >= 0, got {warmup_iter!r}")
        self.warmup_iter = warmup_iter
        self._step_start = 0.0
        self._timed_steps = 0
        self._timed_since = 0.0  # wall clock at the end of the warm-up steps
        self._train_start = time.perf_counter()

    def before_train(self):
        self._train_start = time.perf_counter()

    def before_step(self):
        self._step_start = time.perf_counter()

    def after_step(self):
        now = time.perf_counter()  # one clock read serves the step time and the ETA
        trainer = self.trainer
        metrics = trainer.metrics
        metrics.record("time/step", now - self._step_start)
        self._timed_steps += 1
        if self._timed_steps == self.warmup_iter:
            self._timed_since = now
        elif self._timed_steps > self.warmup_iter:  # the first steps pay for start-up
            if self.warmup_iter == 0 and self._timed_steps == 1:
                self._timed_since = self._step_start
            mean = (now - self._timed_since) / (self._timed_steps - self.warmup_iter)
            remaining = (trainer.max_epoch - trainer.epoch) * trainer.iters_per_epoch - trainer.iter
            metrics.record("time/eta", mean * remaining)

    def after_train(self):
        elapsed = time.perf_counter() - self._train_start
        self.trainer.logger.info(f"Training time: {elapsed:.1f}s for {self._timed_steps} step(s) in this process")
