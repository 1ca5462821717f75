"""ReduceLROnPlateau: lower the learning rate when a monitored evaluation metric
stops improving, on top of the configured schedule.

torch's ``ReduceLROnPlateau`` replaces the schedule; this hook keeps it and
scales it (:func:`pimm.engines.scale_lr`): after the k-th reduction every
param group's lr is ``schedule(step) x factor**k``, so warm-up, decay and the
ratios between param groups go on. The scale is the scheduler's state, so a
resumed run has it without re-applying anything; the hook's own counters
(best value, evaluations without improvement, cooldown) are in every
checkpoint, so a killed and resumed run decides exactly as the uninterrupted
one.

Only scheduled evaluations count (not the final one, not on-demand ones, not
those of another prefix such as EMA weights unless the monitor names it):
they happen at the same steps in every run of a config, which is what makes
the decision reproducible. The options and their meaning are torch's.
"""

from __future__ import annotations

import math
import numbers

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.engines.optim.scheduler import _GroupStateMixin, scale_lr
from pimm.utils.errors import ConfigError
from pimm.engines.optim.parts import single_optimizer_problem
from pimm.utils.domains import Choice, Count, Key, LR, NonNeg, Real, Seq

__all__ = ["ReduceLROnPlateau", "counts_for_plateau"]


def counts_for_plateau(run, prefix: str) -> bool:
    """Whether the evaluation ``run`` (the :class:`~pimm.engines.hooks.base.EvalRun`
    handed to ``after_val``) is a scheduled one of ``prefix``."""
    return run.kind == "scheduled" and run.prefix == prefix


def _number(name: str, value, low: float, high: float | None = None, low_open: bool = False,
            high_open: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high))
    if not ok:
        bounds = f"{'(' if low_open else '['}{low:g}, {'inf' if high is None else f'{high:g}'}" \
                 f"{')' if high_open or high is None else ']'}"
        raise ConfigError(f"ReduceLROnPlateau: {name} must be a number in {bounds}, got {value!r}")
    return float(value)


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"ReduceLROnPlateau: {name} must be an integer >= 0 (evaluations), got {value!r}")
    return value


@HOOKS.register_module()
class ReduceLROnPlateau(HookBase):
    """Options (torch's names and defaults):

    monitor: the metric to watch, e.g. ``"val/acc"``.
    mode: ``"max"``, ``"min"`` or None (the direction its evaluator declared).
    factor: the lr is multiplied by it at each reduction, in (0, 1).
    patience: evaluations without improvement tolerated; the next one reduces.
    threshold, threshold_mode: what counts as an improvement: ``"rel"`` beats
        the best by a fraction ``threshold``, ``"abs"`` by ``threshold``.
    cooldown: evaluations after a reduction during which nothing is counted.
    min_lr: no reduction takes a param group's lr below this (a number, or one
        per param group); the schedule's own decay may still go lower.
    """

    # After EMAHook (ABOVE_NORMAL), which declares the directions of val_ema/*; before
    # CheckpointSaver (LOW), so a checkpoint taken after an evaluation holds the decision.
    priority = "BELOW_NORMAL"

    domains = dict(monitor=Key, mode=Choice("min", "max") | None, factor=Real(0, 1, lo_open=True, hi_open=True),
                   patience=Count, threshold=NonNeg, threshold_mode=Choice("rel", "abs"), cooldown=Count,
                   min_lr=LR | Seq(LR))

    def __init__(self, monitor: str, mode: str | None = None, factor: float = 0.1, patience: int = 10,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0,
                 min_lr: float | list = 0.0):
        if not isinstance(monitor, str) or "/" not in monitor:
            raise ConfigError(f"ReduceLROnPlateau: monitor must be a metric name like 'val/acc', got {monitor!r}")
        if mode not in (None, "min", "max"):
            raise ConfigError(f"ReduceLROnPlateau: mode must be 'min', 'max' or None (the metric's declared "
                              f"direction), got {mode!r}")
        if threshold_mode not in ("rel", "abs"):
            raise ConfigError(f"ReduceLROnPlateau: threshold_mode must be 'rel' or 'abs', got {threshold_mode!r}")
        self.monitor, self.mode, self.threshold_mode = monitor, mode, threshold_mode
        self.factor = _number("factor", factor, 0.0, 1.0, low_open=True, high_open=True)
        self.patience, self.cooldown = _count("patience", patience), _count("cooldown", cooldown)
        self.threshold = _number("threshold", threshold, 0.0)
        if isinstance(min_lr, (list, tuple)):
            self.min_lr = [_number("min_lr", v, 0.0) for v in min_lr]
        else:
            self.min_lr = _number("min_lr", min_lr, 0.0)
        self.prefix = monitor.split("/", 1)[0]
        self.best: float | None = None
        self.best_step: int | None = None
        self.num_bad = 0  # counted evaluations since the last improvement
        self.cooldown_counter = 0
        self.reductions = 0

    # -- set-up -----------------------------------------------------------
    def before_train(self) -> None:
        """Check the scheduler and the evaluators; take the metric's declared direction."""
        trainer = self.trainer
        problem = single_optimizer_problem(trainer, "ReduceLROnPlateau")
        if problem:
            raise ConfigError(problem)
        if not isinstance(getattr(trainer, "scheduler", None), _GroupStateMixin):
            raise ConfigError(f"ReduceLROnPlateau needs one of pimm's schedulers (scheduler=dict(type=...)), not "
                              f"{type(getattr(trainer, 'scheduler', None)).__name__}")
        if not trainer.evaluators or not trainer.cfg.evaluate:
            why = "no evaluator hook is configured" if not trainer.evaluators else "evaluate=False"
            raise ConfigError(f"ReduceLROnPlateau(monitor={self.monitor!r}) has nothing to watch: {why}; add an "
                              "evaluator (e.g. dict(type='ClsEvaluator'))")
        groups = len(trainer.optimizer.param_groups)
        if isinstance(self.min_lr, list) and len(self.min_lr) != groups:
            raise ConfigError(f"ReduceLROnPlateau: min_lr has {len(self.min_lr)} values but the optimizer has "
                              f"{groups} param groups")
        self.mode = trainer.metrics.resolve_direction(self.monitor, self.mode, "ReduceLROnPlateau")

    # -- decisions ----------------------------------------------------------
    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than the threshold (NaN never does)."""
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.threshold_mode == "rel":
            margin = abs(self.best) * self.threshold
        else:
            margin = self.threshold
        return value > self.best + margin if self.mode == "max" else value < self.best - margin

    def after_val(self, metrics: dict, run) -> None:
        """Count a scheduled evaluation of the monitor's prefix; reduce after ``patience``."""
        trainer = self.trainer
        if not counts_for_plateau(run, self.prefix):
            return
        if self.monitor not in metrics:
            if all(e.last_step is not None for e in trainer.evaluators):
                present = sorted(k for k in metrics if k.startswith(self.prefix + "/"))
                raise ConfigError(f"ReduceLROnPlateau: no evaluator produces {self.monitor!r}; the metrics are: "
                                  f"{', '.join(present)}")
            return
        value = float(metrics[self.monitor])
        if self.improved(value):
            self.best, self.best_step, self.num_bad = value, trainer.global_step, 0
        else:
            self.num_bad += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad = 0
        if self.num_bad > self.patience:
            self._reduce(value)
            self.cooldown_counter, self.num_bad = self.cooldown, 0

    def _factor(self) -> float | None:
        """The factor that honours min_lr, or None when every group is already at it."""
        lrs = [group["lr"] for group in self.trainer.optimizer.param_groups]
        floors = self.min_lr if isinstance(self.min_lr, list) else [self.min_lr] * len(lrs)
        if all(lr <= floor for lr, floor in zip(lrs, floors)):
            return None
        need = max((floor / lr for lr, floor in zip(lrs, floors) if lr > 0), default=0.0)
        factor = max(self.factor, need)
        return factor if factor < 1.0 else None

    def _reduce(self, value: float) -> None:
        trainer = self.trainer
        factor = self._factor()
        best = "nothing yet" if self.best is None else f"{self.best:.4g} (step {self.best_step})"
        what = f"{self.monitor} {value:.4g} has not improved on {best} for {self.num_bad} evaluation(s)"
        if factor is None:
            trainer.logger.info(f"ReduceLROnPlateau: {what}; the lr is at min_lr, not reduced")
            return
        before = trainer.optimizer.param_groups[0]["lr"]
        try:
            scale = scale_lr(trainer.optimizer, trainer.scheduler, factor)
        except ValueError as err:
            trainer.logger.warning(f"ReduceLROnPlateau: {what}; the lr is not reduced: {err}")
            return
        self.reductions += 1
        trainer.logger.info(f"ReduceLROnPlateau: {what}: lr {before:.3e} -> {trainer.optimizer.param_groups[0]['lr']:.3e}"
                            f" (schedule x{scale:.4g}, reduction {self.reductions})")

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict:
        """The best value and the counters (the lr scale is the scheduler's state)."""
        return {"best": self.best, "best_step": self.best_step, "num_bad": self.num_bad,
                "cooldown_counter": self.cooldown_counter, "reductions": self.reductions}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s content."""
        self.best, self.best_step = state.get("best"), state.get("best_step")
        self.num_bad, self.cooldown_counter = state.get("num_bad", 0), state.get("cooldown_counter", 0)
        self.reductions = state.get("reductions", 0)
