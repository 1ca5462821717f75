"""What every pimm learning-rate schedule shares: argument checks, per-group
state that survives a resume (step counters and ``lr_scale``, never the
config's hyperparameters), and the closed-form base whose lr is a function of
the step alone. The schedules themselves and the rules they follow are in
:mod:`pimm.engines.optim.scheduler`.
"""

from __future__ import annotations

import copy
import math
import numbers
from typing import Any

from torch.optim import Optimizer
from torch.optim import lr_scheduler as torch_sched

from pimm.utils.errors import CheckpointError, ConfigError


# The bounds of a schedule's accumulated lr scale: beyond them an lr is either
# meaningless (1e-300 is 0 in every optimizer's arithmetic, and a 0 scale can
# never be raised again by a relative change) or overflows to inf/NaN.
MIN_LR_SCALE, MAX_LR_SCALE = 1e-12, 1e12


def _check_total_steps(total_steps: Any) -> int:
    if isinstance(total_steps, bool) or not isinstance(total_steps, numbers.Integral) or total_steps <= 0:
        raise ConfigError(
            f"the schedule needs a positive number of optimizer steps, got total_steps={total_steps!r} "
            "(iterations per epoch × epochs: check epoch, batch_size and that the training set is not empty)"
        )
    return int(total_steps)


def _check_number(name: str, value: Any, low: float | None = None, high: float | None = None,
                  low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float, or ConfigError if it is not a number in the range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high or math.isnan(value):
        lo = "-inf" if low is None else f"{low:g}"
        hi = "inf" if high is None else f"{high:g}"
        bounds = f"{'(' if low_open else '['}{lo}, {hi}{')' if high_open else ']'}"
        raise ConfigError(f"{name} must be in {bounds}, got {value!r}")
    return value


def _check_scale(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
            or not MIN_LR_SCALE <= value <= MAX_LR_SCALE:
        raise ValueError(f"{what} must be a finite number in [{MIN_LR_SCALE:g}, {MAX_LR_SCALE:g}], got {value!r}")
    return float(value)


class _GroupStateMixin:
    """Resume by progress and lr scale only (see module doc)."""

    optimizer: Optimizer
    _PROGRESS = ("last_epoch", "_step_count")
    # Class default, so torch's __init__ (which already computes an lr) sees it.
    lr_scale: float = 1.0

    def _owned_group_keys(self) -> tuple[str, ...]:
        return ("lr", "initial_lr")

    def state_dict(self) -> dict[str, Any]:
        # Deep-copied so a kept state dict is a snapshot, not a view that keeps
        # changing while training goes on.
        state = copy.deepcopy(super().state_dict())  # type: ignore[misc]
        state["lr_scale"] = self.lr_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [k for k in self._PROGRESS if k not in state_dict]
        if missing:
            raise CheckpointError(f"scheduler state lacks {missing}: not a pimm/torch LR scheduler state")
        try:  # absent in checkpoints written before lr_scale existed: unscaled
            scale = _check_scale(state_dict.get("lr_scale", 1.0), "the checkpoint's scheduler lr_scale")
        except ValueError as err:
            raise CheckpointError(f"{err}: the scheduler state is damaged") from None
        for key in self._PROGRESS:
            setattr(self, key, state_dict[key])
        self.lr_scale = scale
        self._set_lrs()

    def _set_lrs(self) -> None:
        lrs = self.get_lr()  # type: ignore[attr-defined]
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def scale_lr(self, factor: float) -> float:
        """Multiply the lr of every param group, now and for the rest of the
        schedule, by ``factor``; returns the new accumulated ``lr_scale``.

        The factor must be a finite positive number, and the accumulated scale
        must stay within [MIN_LR_SCALE, MAX_LR_SCALE] with every group's lr
        finite; otherwise ValueError and nothing changes. The same factors in
        the same order give the same floats (exact resume relies on it)."""
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) or not math.isfinite(factor) \
                or factor <= 0:
            raise ValueError(f"an lr factor must be a finite positive number, got {factor!r}")
        new = self.lr_scale * float(factor)
        if not MIN_LR_SCALE <= new <= MAX_LR_SCALE:
            raise ValueError(f"scaling the lr by {factor:g} would make the schedule's scale {new:g}, outside "
                             f"[{MIN_LR_SCALE:g}, {MAX_LR_SCALE:g}] (the lr would be meaningless or overflow)")
        old = self.lr_scale
        self.lr_scale = new
        if not all(math.isfinite(lr) for lr in self.get_lr()):  # type: ignore[attr-defined]
            self.lr_scale = old
            raise ValueError(f"scaling the lr by {factor:g} would make it non-finite")
        self._set_lrs()
        return new


class _ClosedFormLR(_GroupStateMixin, torch_sched.LRScheduler):
    """Base for schedules where ``lr = f(base_lr, step)``; subclasses define ``_lr_at``."""

    def __init__(self, optimizer: Optimizer, total_steps: int):
        self.total_steps = _check_total_steps(total_steps)
        super().__init__(optimizer)

    def _lr_at(self, base_lr: float, step: int) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self._lr_at(base_lr, self.last_epoch) * self.lr_scale for base_lr in self.base_lrs]

    # Lets torch's deprecated ``step(epoch)`` path use the same formula.
    _get_closed_form_lr = get_lr
