"""EarlyStopping: stop training when a monitored evaluation metric stops
improving, or when the learning rate has reached zero.

A metric's direction has one source of truth, the metric channel: an
evaluator declares ``val/<metric_name>`` (and ``val/loss`` as ``min``), and
best-checkpoint selection reads the same declaration. ``mode=None`` takes the
declared direction; a ``mode`` that contradicts it is a ConfigError; a
``mode`` for a metric nobody declared declares it.

The hook acts after every scheduled evaluation whose prefix is the
monitor's (``val`` for ``val/acc``, ``val_ema`` for ``val_ema/acc`` when
EMAHook evaluates the averaged weights). On-demand evaluations never count,
and neither do final ones: after the last step there is nothing left to stop,
and the final evaluation a requested stop makes is one the uninterrupted run
never had, so counting it would make a stopped-and-resumed run decide
differently.
``patience`` evaluations in a row without an improvement of more than
``min_delta`` stop the run.

Several metrics (``monitor=["val/acc", "val/loss"]``, as KonfAI's early
stopping on a sum of criteria): the hook watches one score, the sum of the
metrics each oriented so that larger is better, i.e. ``max`` metrics added
and ``min`` metrics subtracted (``val/acc - val/loss`` here); each metric's
direction is its declared one (or ``mode=[...]``, one per metric), the
score is maximised and ``min_delta`` applies to it. A NaN in any metric is
no improvement. All monitors must come from the same evaluation prefix. Evaluation metrics are identical on every rank,
so every rank decides the same at the same step and the stop needs no extra
communication (``request_stop(..., agreed=True)``); the trainer then commits
a final checkpoint and logs the reason. The best value and the wait count
are in every checkpoint, so a resumed run decides exactly as the
uninterrupted one.
"""

from __future__ import annotations

import math

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError
from pimm.engines.optim.parts import all_optimizers
from pimm.utils.domains import Choice, Count, Key, Names, NonNeg, Rule, Seq

__all__ = ["EarlyStopping"]


@HOOKS.register_module()
class EarlyStopping(HookBase):
    """Options:

    monitor: the metric to watch, e.g. ``"val/acc"``, or a list of them (their sum, each
        oriented by its direction; see the module docstring); None: only ``stop_on_zero_lr``.
    mode: ``"max"``, ``"min"`` or None (the direction its evaluator declared); with
        several monitors, None or a list with one of those per monitor.
    patience: evaluations in a row without improvement before stopping.
    min_delta: an improvement must beat the best by more than this.
    stop_on_zero_lr: also stop once every param group's learning rate is 0.
    """

    # After EMAHook (ABOVE_NORMAL), which declares the directions of val_ema/*.
    priority = "BELOW_NORMAL"

    domains = dict(monitor=Key | Names | None, mode=Choice("min", "max") | Seq(Choice("min", "max") | None) | None,
                   patience=Count, min_delta=NonNeg)
    domain_rules = (Rule(lambda a: not isinstance(a.mode, (list, tuple)) or (
        isinstance(a.monitor, (list, tuple)) and len(a.mode) == len(a.monitor)), "mode", "one direction per monitor"),)

    def __init__(self, monitor: str | None = None, mode: str | None = None, patience: int = 5,
                 min_delta: float = 0.0, stop_on_zero_lr: bool = False):
        monitors = list(monitor) if isinstance(monitor, (list, tuple)) else [monitor] if monitor is not None else []
        if isinstance(monitor, (list, tuple)) and not monitor:
            raise ValueError("monitor=[] watches nothing: give metric names like ['val/acc', 'val/loss'] or None")
        if any(not isinstance(m, str) or "/" not in m for m in monitors):
            raise ValueError(f"monitor must be a metric name like 'val/acc' or a list of them, got {monitor!r}")
        if len(set(monitors)) != len(monitors):
            raise ValueError(f"monitor lists a metric twice: {monitor!r}")
        if len({m.split("/", 1)[0] for m in monitors}) > 1:
            raise ValueError(f"monitor={monitor!r} mixes evaluation prefixes; every metric must come from the same "
                             "evaluation (e.g. all val/*)")
        modes = list(mode) if isinstance(mode, (list, tuple)) else [mode] * max(1, len(monitors))
        if isinstance(mode, (list, tuple)) and len(mode) != len(monitors):
            raise ValueError(f"mode={mode!r} must give one direction per monitor ({len(monitors)})")
        if len(monitors) > 1 and isinstance(mode, str):
            raise ValueError(f"mode={mode!r} with several monitors: give one direction per metric, e.g. "
                             "mode=['max', 'min'], or None for their declared directions")
        if any(m not in (None, "min", "max") for m in modes):
            raise ValueError(f"mode must be 'min', 'max' or None (the metric's declared direction), got {mode!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"patience must be a positive integer (evaluations), got {patience!r}")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or not min_delta >= 0:
            raise ValueError(f"min_delta must be a number >= 0, got {min_delta!r}")
        if not isinstance(stop_on_zero_lr, bool):
            raise ValueError(f"stop_on_zero_lr must be True or False, got {stop_on_zero_lr!r}")
        if monitor is None and not stop_on_zero_lr:
            raise ValueError("give a monitor (e.g. monitor='val/acc') or stop_on_zero_lr=True: otherwise "
                             "EarlyStopping never stops anything")
        self.monitors, self.modes = monitors, modes[:len(monitors)]
        self.monitor = "+".join(monitors) if monitors else None  # the watched score's name in messages
        self.mode = self.modes[0] if len(monitors) == 1 else ("max" if monitors else mode)
        self.patience = patience
        self.min_delta, self.stop_on_zero_lr = float(min_delta), stop_on_zero_lr
        self.prefix = monitors[0].split("/", 1)[0] if monitors else None
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0  # evaluations since the last improvement
        self._keys_seen: set[str] = set()

    # -- set-up -----------------------------------------------------------
    def before_train(self) -> None:
        """Check the monitor against the declared metrics and take its direction."""
        if self.monitor is None:
            return
        trainer = self.trainer
        if not trainer.evaluators or not trainer.cfg.evaluate:
            why = "no evaluator hook is configured" if not trainer.evaluators else "evaluate=False"
            raise ConfigError(f"EarlyStopping(monitor={self.monitor!r}) has nothing to watch: {why}; add an "
                              "evaluator (e.g. dict(type='ClsEvaluator')) or drop the monitor")
        # Every evaluation declares <prefix>/loss before this hook's before_train
        # (evaluators when they are built, EMAHook at ABOVE_NORMAL).
        prefixes = {name.split("/", 1)[0] for name in trainer.metrics.declared() if name.endswith("/loss")}
        if self.prefix not in prefixes:
            raise ConfigError(f"EarlyStopping: no evaluation publishes {self.prefix}/* metrics (monitor="
                              f"{self.monitor!r}); evaluations publish under: {', '.join(sorted(prefixes))}")
        self.modes = [trainer.metrics.resolve_direction(name, mode, "EarlyStopping", " if an evaluator publishes it")
                      for name, mode in zip(self.monitors, self.modes)]
        if len(self.monitors) == 1:
            self.mode = self.modes[0]
        else:
            terms = " ".join(("+" if m == "max" else "-") + name for name, m in zip(self.monitors, self.modes))
            self.monitor = f"score({terms})"
            trainer.logger.info(f"EarlyStopping watches {self.monitor}, the sum of its metrics oriented so that "
                                "larger is better (maximised)")

    # -- decisions ----------------------------------------------------------
    def improved(self, value: float) -> bool:
        """Whether ``value`` beats the best so far by more than ``min_delta``."""
        if value is None or math.isnan(value):
            return False
        if self.best is None:
            return True
        if self.mode == "max":
            return value > self.best + self.min_delta
        return value < self.best - self.min_delta

    def after_val(self, metrics: dict, run) -> None:
        """Count a scheduled evaluation with the monitor's prefix; stop after ``patience``."""
        trainer = self.trainer
        if self.monitor is None or run.prefix != self.prefix or run.kind != "scheduled":
            return
        missing = [name for name in self.monitors if name not in metrics]
        if missing:
            self._check_monitor_exists(metrics, missing[0])
            return
        value = self.score(metrics)
        step = trainer.global_step
        if self.improved(value):
            self.best, self.best_step, self.wait = value, step, 0
            return
        self.wait += 1
        trainer.logger.info(f"EarlyStopping: {self.monitor} {value:.4f} is no improvement on {self.best:.4f} "
                            f"(step {self.best_step}) for {self.wait}/{self.patience} evaluation(s)")
        if self.wait >= self.patience:
            trainer.request_stop(f"early stopping: {self.monitor} has not improved on {self.best:.4f} (step "
                                 f"{self.best_step}) for {self.wait} evaluations (patience {self.patience}, "
                                 f"min_delta {self.min_delta:g})", agreed=True)

    def score(self, metrics: dict) -> float:
        """The watched value: the metric itself, or for several the sum of each
        metric oriented so that larger is better (``max`` ones added, ``min`` ones
        subtracted)."""
        if len(self.monitors) == 1:
            return float(metrics[self.monitors[0]])
        return math.fsum(float(metrics[name]) * (1.0 if mode == "max" else -1.0)
                         for name, mode in zip(self.monitors, self.modes))

    def _check_monitor_exists(self, metrics: dict, monitor: str) -> None:
        """A monitor no evaluator produces is a config error, raised once every
        evaluator has reported at least once (evaluators may run on different
        schedules)."""
        self._keys_seen.update(k for k in metrics if k.startswith(self.prefix + "/"))
        if all(e.last_step is not None for e in self.trainer.evaluators):
            raise ConfigError(f"EarlyStopping: no evaluator produces {monitor!r}; the metrics are: "
                              f"{', '.join(sorted(self._keys_seen))}")

    def after_step(self) -> None:
        """``stop_on_zero_lr``: stop once every param group's lr is 0."""
        if not self.stop_on_zero_lr:
            return
        trainer = self.trainer
        if trainer.global_step >= trainer.max_epoch * trainer.iters_per_epoch:
            return  # the last step: the run completes anyway
        # The rates the next step would use: at 0 nothing would change any more.
        if all(group["lr"] <= 0.0 for optimizer in all_optimizers(trainer) for group in optimizer.param_groups):
            trainer.request_stop(f"early stopping: the learning rate reached 0 at step {trainer.global_step}",
                                 agreed=True)

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict:
        """The best value, its step and the wait count."""
        return {"best": self.best, "best_step": self.best_step, "wait": self.wait}

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`."""
        self.best, self.best_step, self.wait = state.get("best"), state.get("best_step"), state.get("wait", 0)
