"""Learning-rate schedules stepped once per optimizer step.

``build_scheduler(cfg, optimizer, total_steps)`` builds ``cfg["type"]`` from
SCHEDULERS; the trainer supplies ``total_steps`` (iterations per epoch ×
epochs), so configs state schedules in fractions of training and stay valid
when the dataset, batch size or epoch count changes.

Every schedule here is a closed-form function of the step count and each
group's base lr (``initial_lr``), so each param group keeps its own lr and the
ratios between groups set by ``param_dicts`` are preserved. Because the lr is
never derived from the previous lr, a scheduler rebuilt from its config and
given ``load_state_dict`` continues with bit-identical values.

Resume follows the engine's rule (the checkpoint wins for state, the config
for hyperparameters): ``load_state_dict`` takes only the schedule's progress
(its step counters) from the checkpoint and keeps every parameter the config
built (length, warm-up, milestones, base lrs), then sets each group's lr (and
a cycled momentum) for the restored step. With an unchanged config that is
exactly the lr the uninterrupted run has at that step; after ``epoch`` was
raised, the longer schedule continues from the same step.

Changing the lr while training (a plateau hook, LiveControl, your own hook)
goes through :func:`scale_lr`: every scheduler here multiplies the schedule's
lr by a factor ``lr_scale`` (1 unless scaled), so the schedule keeps its shape
(lr = schedule(step) x lr_scale) and the ratios between param groups hold.
``lr_scale`` is scheduler *state*, like its step counter: it is saved with the
scheduler and restored on resume, so a decision taken before a checkpoint
needs no re-application, and it is not a config change. (Writing
``param_groups[i]["lr"]`` directly is undone by the next scheduler step.)
"""

from __future__ import annotations

import bisect
import inspect
import math
import numbers
from typing import Any, Sequence

from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched

from pimm.engines.registries import SCHEDULERS
from pimm.utils.errors import ConfigError
from pimm.utils.domains import Choice, Count, LR, MAX_REAL, Positive, Prob, Real, Rule, Seq
# The shared base; its names stay importable from here (hooks and plug-ins check isinstance(_GroupStateMixin)).
from pimm.engines.optim.lr_schedule_base import (MAX_LR_SCALE, MIN_LR_SCALE, _check_number,  # noqa: F401
                                                 _check_scale, _check_total_steps, _ClosedFormLR, _GroupStateMixin)

__all__ = [
    "build_scheduler",
    "OneCycleLR",
    "MultiStepLR",
    "CosineWarmupLR",
    "PolyLR",
    "ConstantLR",
    "scale_lr",
    "MIN_LR_SCALE",
    "MAX_LR_SCALE",
]
@SCHEDULERS.register_module(["CosineWarmupLR", "WarmupCosineLR"])
class CosineWarmupLR(_ClosedFormLR):
    """Linear warm-up from ``warmup_start_factor × lr`` to ``lr`` over the first
    ``warmup_steps`` (or ``warmup_ratio × total_steps``) steps, then half a
    cosine down to ``min_lr_ratio × lr`` (or the absolute ``eta_min``) at
    ``total_steps``."""

    domains = dict(warmup_steps=Count | None, warmup_ratio=Real(0, 1, hi_open=True) | None,
                   warmup_start_factor=Real(0, 1, lo_open=True), min_lr_ratio=Prob | None, eta_min=LR | None)

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        warmup_steps: int | None = None,
        warmup_ratio: float | None = None,
        warmup_start_factor: float = 0.001,
        min_lr_ratio: float | None = None,
        eta_min: float | None = None,
    ):
        total = _check_total_steps(total_steps)
        if warmup_steps is not None and warmup_ratio is not None:
            raise ConfigError("set warmup_steps or warmup_ratio, not both")
        if warmup_ratio is not None:
            warmup_steps = round(_check_number("warmup_ratio", warmup_ratio, 0.0, 1.0, high_open=True) * total)
        elif warmup_steps is None:
            warmup_steps = 0
        elif isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
            raise ConfigError(f"warmup_steps must be an integer >= 0, got {warmup_steps!r}")
        if warmup_steps >= total:
            raise ConfigError(
                f"warm-up ({warmup_steps} steps) must be shorter than training ({total} steps); "
                "lower warmup_steps / warmup_ratio"
            )
        if min_lr_ratio is not None and eta_min is not None:
            raise ConfigError("set min_lr_ratio or eta_min, not both")
        self.warmup_steps = int(warmup_steps)
        self.warmup_start_factor = _check_number("warmup_start_factor", warmup_start_factor, 0.0, 1.0)
        self.min_lr_ratio = _check_number("min_lr_ratio", 0.0 if min_lr_ratio is None else min_lr_ratio, 0.0, 1.0)
        self.eta_min = None if eta_min is None else _check_number("eta_min", eta_min, 0.0)
        super().__init__(optimizer, total)

    def _lr_at(self, base_lr: float, step: int) -> float:
        if step < self.warmup_steps:
            start = self.warmup_start_factor
            return base_lr * (start + (1.0 - start) * step / self.warmup_steps)
        floor = base_lr * self.min_lr_ratio if self.eta_min is None else self.eta_min
        decay_steps = self.total_steps - self.warmup_steps
        progress = min(step - self.warmup_steps, decay_steps) / decay_steps
        return floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


@SCHEDULERS.register_module()
class PolyLR(_ClosedFormLR):
    """``lr × (1 - step / total_steps) ** power`` (held at the end value after)."""

    domains = dict(power=Real(0, 100, lo_open=True))

    def __init__(self, optimizer: Optimizer, total_steps: int, power: float = 0.9):
        self.power = _check_number("power", power, 0.0)
        super().__init__(optimizer, total_steps)

    def _lr_at(self, base_lr: float, step: int) -> float:
        return base_lr * (1.0 - min(step, self.total_steps) / self.total_steps) ** self.power


@SCHEDULERS.register_module(["Constant", "ConstantLR"])
class ConstantLR(_ClosedFormLR):
    """The configured lr for the whole run (``total_steps`` only validated)."""

    def _lr_at(self, base_lr: float, step: int) -> float:
        return base_lr


@SCHEDULERS.register_module()
class MultiStepLR(_ClosedFormLR):
    """Multiply the lr by ``gamma`` at each milestone.

    Milestones are fractions of training in (0, 1) (``[0.6, 0.8]``: at 60 % and
    80 % of ``total_steps``) or ints (absolute optimizer steps, not epochs).
    Fractions are rounded to the nearest step, at least 1."""

    domains = dict(milestones=Seq(Positive, min_len=1), gamma=Real(0, 10))

    def __init__(self, optimizer: Optimizer, total_steps: int, milestones: Sequence[float | int], gamma: float = 0.1):
        total = _check_total_steps(total_steps)
        if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence) or not milestones:
            raise ConfigError(f"milestones must be a non-empty list of fractions in (0, 1) or step numbers, got {milestones!r}")
        steps: list[int] = []
        for value in milestones:
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                if value <= 0:
                    raise ConfigError(f"milestone {value!r} must be a positive step number")
                steps.append(int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
                if not 0.0 < value < 1.0:
                    raise ConfigError(
                        f"milestone {value!r} is not a fraction of training in (0, 1); "
                        "give fractions like 0.6 or integer step numbers"
                    )
                steps.append(max(1, math.floor(value * total + 0.5)))
            else:
                raise ConfigError(f"milestone {value!r} must be a number")
        kinds = {isinstance(value, numbers.Integral) for value in milestones}
        if len(kinds) > 1:
            raise ConfigError(f"milestones mix fractions and step numbers: {list(milestones)!r}; use one kind")
        # Checked on the values as written: two fractions may round to the same
        # step on a very short run, which then simply applies gamma twice.
        if any(b <= a for a, b in zip(milestones, milestones[1:])):
            raise ConfigError(f"milestones must be strictly increasing, got {list(milestones)!r}")
        self.milestones = steps
        self.gamma = _check_number("gamma", gamma, 0.0)
        super().__init__(optimizer, total)

    def _lr_at(self, base_lr: float, step: int) -> float:
        return base_lr * self.gamma ** bisect.bisect_right(self.milestones, step)


@SCHEDULERS.register_module()
class OneCycleLR(_GroupStateMixin, torch_sched.OneCycleLR):
    """torch's OneCycleLR with the peak taken from the optimizer.

    ``max_lr`` defaults to each group's configured lr. A single number is the
    default group's peak (group 0); other groups get it scaled by their lr
    ratio to that group, so ``param_dicts`` ratios hold. A list gives one peak
    per group. ``total_steps`` comes from the trainer; stepping exactly
    ``total_steps`` times is fine, once more raises ``ValueError``."""

    domains = dict(max_lr=LR | Seq(LR) | None, pct_start=Real(0, 1, lo_open=True, hi_open=True),
                   anneal_strategy=Choice("cos", "linear"), base_momentum=Prob, max_momentum=Prob,
                   div_factor=Real(1, MAX_REAL), final_div_factor=Real(1, MAX_REAL))
    domain_rules = (Rule(lambda a: a.base_momentum <= a.max_momentum, "base_momentum", "a value <= max_momentum"),)

    def __init__(
        self,
        optimizer: Optimizer,
        total_steps: int,
        max_lr: float | Sequence[float] | None = None,
        pct_start: float = 0.3,
        anneal_strategy: str = "cos",
        cycle_momentum: bool = True,
        base_momentum: float = 0.85,
        max_momentum: float = 0.95,
        div_factor: float = 25.0,
        final_div_factor: float = 1e4,
        three_phase: bool = False,
    ):
        total = _check_total_steps(total_steps)
        group_lrs = [group["lr"] for group in optimizer.param_groups]
        if max_lr is None:
            max_lrs = list(group_lrs)
        elif isinstance(max_lr, numbers.Real) and not isinstance(max_lr, bool):
            reference = group_lrs[0]
            if reference == 0 and any(lr != 0 for lr in group_lrs):
                raise ConfigError("cannot scale a single max_lr by group when the default group's lr is 0; give a list")
            max_lrs = [float(max_lr) if reference == 0 else max_lr * lr / reference for lr in group_lrs]
        elif isinstance(max_lr, Sequence) and not isinstance(max_lr, str):
            if len(max_lr) != len(group_lrs):
                raise ConfigError(f"max_lr has {len(max_lr)} values but the optimizer has {len(group_lrs)} param groups")
            max_lrs = [_check_number("max_lr", v, 0.0) for v in max_lr]
        else:
            raise ConfigError(f"max_lr must be a number, a list or None, got {max_lr!r}")
        pct_start = _check_number("pct_start", pct_start, 0.0, 1.0, low_open=True, high_open=True)
        if anneal_strategy not in ("cos", "linear"):
            raise ConfigError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        div_factor = _check_number("div_factor", div_factor, 0.0, low_open=True)
        final_div_factor = _check_number("final_div_factor", final_div_factor, 0.0, low_open=True)
        if cycle_momentum and "momentum" not in optimizer.defaults and "betas" not in optimizer.defaults:
            raise ConfigError(
                f"{type(optimizer).__name__} has neither momentum nor betas to cycle; set cycle_momentum=False"
            )
        super().__init__(
            optimizer,
            max_lr=max_lrs,
            total_steps=total,
            pct_start=pct_start,
            anneal_strategy=anneal_strategy,
            cycle_momentum=cycle_momentum,
            base_momentum=base_momentum,
            max_momentum=max_momentum,
            div_factor=div_factor,
            final_div_factor=final_div_factor,
            three_phase=three_phase,
        )

    def _owned_group_keys(self) -> tuple[str, ...]:
        keys = ("lr", "initial_lr", "max_lr", "min_lr")
        if self.cycle_momentum:
            keys += ("max_momentum", "base_momentum", "betas" if self.use_beta1 else "momentum")
        return keys

    def get_lr(self) -> list[float]:
        # Same interpolation as torch's, except that a phase of zero length
        # (pct_start * total_steps == 1, e.g. 0.05 of 20 steps) counts as
        # finished instead of dividing 0 by 0.
        step = self.last_epoch
        if step > self.total_steps:
            raise ValueError(f"Tried to step {step} times. The specified number of total steps is {self.total_steps}")
        lrs = []
        for group in self.optimizer.param_groups:
            start_step = 0.0
            for i, phase in enumerate(self._schedule_phases):
                end_step = phase["end_step"]
                if step <= end_step or i == len(self._schedule_phases) - 1:
                    span = end_step - start_step
                    pct = (step - start_step) / span if span != 0 else 1.0
                    lrs.append(self._anneal_func(group[phase["start_lr"]], group[phase["end_lr"]], pct)
                               * self.lr_scale)
                    if self.cycle_momentum:
                        momentum = self._anneal_func(
                            group[phase["start_momentum"]], group[phase["end_momentum"]], pct
                        )
                        if self.use_beta1:
                            group["betas"] = (momentum, *group["betas"][1:])
                        else:
                            group["momentum"] = momentum
                    break
                start_step = end_step
        return lrs


def scale_lr(optimizer: Optimizer, scheduler: Any, factor: float) -> float:
    """Multiply the learning rate by ``factor`` from now on, keeping the
    schedule's shape: every param group's lr becomes ``schedule(step) x
    lr_scale`` with ``lr_scale`` multiplied by ``factor``. Returns the new
    accumulated scale.

    The scale is part of the scheduler's state: it is saved in every
    checkpoint and restored on resume, so a hook that decided to lower the lr
    does not re-apply anything after a resume, and the resume does not report
    it as a config change. ``scheduler`` must be one of pimm's schedulers
    (``scheduler.scale_lr``); a torch scheduler is a TypeError. ValueError
    (nothing changed) when ``factor`` is not a finite positive number or the
    accumulated scale would leave [MIN_LR_SCALE, MAX_LR_SCALE].

    Example, in a hook: ``scale_lr(self.trainer.optimizer, self.trainer.scheduler, 0.5)``.
    """
    if not isinstance(scheduler, _GroupStateMixin):
        raise TypeError(f"scale_lr needs one of pimm's schedulers (pimm.engines.optim.scheduler), not "
                        f"{type(scheduler).__name__}")
    if scheduler.optimizer is not optimizer:
        raise ValueError("scale_lr: the scheduler does not drive this optimizer")
    return scheduler.scale_lr(factor)


def _accepts(scheduler_type: Any, name: str) -> bool:
    """Whether the scheduler constructor takes ``name`` (or ``**kwargs``)."""
    target = SCHEDULERS.get(scheduler_type) if isinstance(scheduler_type, str) else scheduler_type
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def build_scheduler(cfg: dict, optimizer: Optimizer, total_steps: int) -> torch_sched.LRScheduler:
    """Build ``cfg["type"]`` from SCHEDULERS for ``optimizer``.

    ``total_steps`` (optimizer steps of the whole run) is passed to every
    scheduler whose constructor takes it; configs must not set it themselves.
    Build the scheduler, then load optimizer and scheduler state on resume.
    """
    if not isinstance(cfg, dict) or "type" not in cfg:
        raise ConfigError(f"scheduler must be a dict(type=..., ...), got {cfg!r}")
    total = _check_total_steps(total_steps)
    for key in ("optimizer", "total_steps"):
        if key in cfg:
            raise ConfigError(
                f"scheduler.{key} is filled in by the trainer (total_steps = iterations per epoch × epochs); remove it"
            )
    default_args: dict[str, Any] = {"optimizer": optimizer}
    if _accepts(cfg["type"], "total_steps"):
        default_args["total_steps"] = total
    return SCHEDULERS.build(cfg, default_args=default_args)
