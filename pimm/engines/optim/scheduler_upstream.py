"""The schedules upstream pimm registers that pimm's core set lacks
(``CosineAnnealingLR``, ``ExpLR``, ``MultiStepWithWarmupLR``), and upstream's
``last_epoch`` argument on every registered schedule (and ``OneCycleLR``'s
``pct_start`` given as a number of warm-up steps, a value > 1).

They follow the rules of :mod:`pimm.engines.scheduler`: the lr is a closed
form of the step and each group's base lr (so ``param_dicts`` ratios hold,
``scale_lr`` works and a resumed run continues bit-identically from the
checkpoint's step counter), ``total_steps`` comes from the trainer.

``last_epoch`` means what it means in torch (and upstream): the index of the
last step already taken. ``-1`` (the default) starts the schedule at step 0;
``k >= 0`` starts it at step ``k + 1`` — the first lr is the schedule's value
there — and each param group's ``initial_lr`` (set by a previous scheduler)
is its base lr, or its current lr where none was set (torch would stop with a
KeyError). On resume, the checkpoint's step counter wins over ``last_epoch``,
as over every progress counter.
"""

from __future__ import annotations

import bisect
import inspect
import math
import numbers
from typing import Sequence

from torch.optim import Optimizer

from pimm.engines import scheduler as _core
from pimm.engines.registries import SCHEDULERS
from pimm.utils.domains import Int, LR, Real, Seq
from pimm.utils.errors import ConfigError

__all__ = ["CosineAnnealingLR", "ExpLR", "MultiStepWithWarmupLR", "LAST_EPOCH_DOMAIN"]

LAST_EPOCH_DOMAIN = Int(-1)


def _check_last_epoch(last_epoch) -> int:
    if isinstance(last_epoch, bool) or not isinstance(last_epoch, numbers.Integral) or last_epoch < -1:
        raise ConfigError(f"last_epoch must be an integer >= -1 (-1: start at step 0), got {last_epoch!r}")
    return int(last_epoch)


def _start_at(scheduler, optimizer: Optimizer, last_epoch: int, init, *args, reset_lr: bool = True,
              **kwargs) -> None:
    """Run the parent ``init`` and then, for ``last_epoch >= 0``, move the
    schedule to step ``last_epoch + 1`` (torch's meaning), keeping each
    group's ``initial_lr`` as its base lr (``reset_lr``)."""
    if last_epoch >= 0 and reset_lr:
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
            group["lr"] = group["initial_lr"]
    init(*args, **kwargs)
    if last_epoch >= 0:
        scheduler.last_epoch = last_epoch + 1
        scheduler._set_lrs()


class _UpstreamClosedForm(_core._ClosedFormLR):
    domains = dict(last_epoch=LAST_EPOCH_DOMAIN)

    def __init__(self, optimizer: Optimizer, total_steps: int, last_epoch: int = -1):
        _start_at(self, optimizer, _check_last_epoch(last_epoch), super().__init__, optimizer, total_steps)


@SCHEDULERS.register_module()
class CosineAnnealingLR(_UpstreamClosedForm):
    """Half a cosine from each group's lr down to ``eta_min`` over the run:
    ``eta_min + (lr - eta_min) (1 + cos(pi step / total_steps)) / 2`` (torch's
    ``CosineAnnealingLR`` with ``T_max = total_steps``, as upstream)."""

    domains = dict(eta_min=LR)

    def __init__(self, optimizer: Optimizer, total_steps: int, eta_min: float = 0.0, last_epoch: int = -1):
        self.eta_min = _core._check_number("eta_min", eta_min, 0.0)
        super().__init__(optimizer, total_steps, last_epoch)

    def _lr_at(self, base_lr: float, step: int) -> float:
        return self.eta_min + (base_lr - self.eta_min) * (1.0 + math.cos(math.pi * step / self.total_steps)) / 2.0


@SCHEDULERS.register_module()
class ExpLR(_UpstreamClosedForm):
    """``lr * gamma ** (step / total_steps)``: a smooth exponential decay that
    reaches ``gamma * lr`` at the end of training."""

    domains = dict(gamma=Real(0, 1, lo_open=True))

    def __init__(self, optimizer: Optimizer, total_steps: int, gamma: float = 0.9, last_epoch: int = -1):
        self.gamma = _core._check_number("gamma", gamma, 0.0, 1.0, low_open=True)
        super().__init__(optimizer, total_steps, last_epoch)

    def _lr_at(self, base_lr: float, step: int) -> float:
        return base_lr * self.gamma ** (step / self.total_steps)


@SCHEDULERS.register_module()
class MultiStepWithWarmupLR(_UpstreamClosedForm):
    """A linear warm-up then step decay, both in fractions of training.

    Multiplier at step ``s`` (``T = total_steps``): ``gamma ** k`` with ``k``
    the number of milestones ``m`` (fractions, so at step ``m * T``) with
    ``s >= m * T``; times, while ``s <= warmup_rate * T``, the warm-up
    coefficient ``1 - (1 - s / (warmup_rate * T)) (1 - warmup_scale)``, which
    rises linearly from ``warmup_scale`` to 1. ``warmup_rate=0``: no warm-up
    (upstream divides by zero at step 0)."""

    domains = dict(milestones=Seq(Real(0, 1), min_len=1), gamma=Real(0, 10), warmup_rate=Real(0, 1),
                   warmup_scale=Real(0, 1))

    def __init__(self, optimizer: Optimizer, milestones: Sequence[float], total_steps: int, gamma: float = 0.1,
                 warmup_rate: float = 0.05, warmup_scale: float = 1e-6, last_epoch: int = -1):
        total = _core._check_total_steps(total_steps)
        if isinstance(milestones, (str, bytes)) or not isinstance(milestones, Sequence) or not milestones:
            raise ConfigError(f"milestones must be a non-empty list of fractions of training, got {milestones!r}")
        rates = [_core._check_number("milestone", m, 0.0, 1.0) for m in milestones]
        if any(b < a for a, b in zip(rates, rates[1:])):
            raise ConfigError(f"milestones must be increasing, got {list(milestones)!r}")
        self.milestones = [rate * total for rate in rates]
        self.gamma = _core._check_number("gamma", gamma, 0.0)
        self.warmup_rate = _core._check_number("warmup_rate", warmup_rate, 0.0, 1.0)
        self.warmup_scale = _core._check_number("warmup_scale", warmup_scale, 0.0, 1.0)
        super().__init__(optimizer, total, last_epoch)

    def _lr_at(self, base_lr: float, step: int) -> float:
        factor = self.gamma ** bisect.bisect_right(self.milestones, step)
        warmup_end = self.warmup_rate * self.total_steps
        if warmup_end > 0 and step <= warmup_end:
            factor *= 1.0 - (1.0 - step / warmup_end) * (1.0 - self.warmup_scale)
        return base_lr * factor


def _with_last_epoch(core_cls):
    """``core_cls`` (a schedule of :mod:`pimm.engines.scheduler`) taking
    upstream's ``last_epoch`` too, registered in its place."""

    reset_lr = core_cls is not _core.OneCycleLR  # its base lrs come from max_lr, not initial_lr

    def __init__(self, optimizer: Optimizer, *args, last_epoch: int = -1, **kwargs):
        _start_at(self, optimizer, _check_last_epoch(last_epoch), core_cls.__init__, self, optimizer,
                  *args, reset_lr=reset_lr, **kwargs)

    core_sig = inspect.signature(core_cls.__init__)
    params = [p for p in core_sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    params.append(inspect.Parameter("last_epoch", inspect.Parameter.KEYWORD_ONLY, default=-1))
    __init__.__signature__ = core_sig.replace(parameters=params)
    cls = type(core_cls.__name__, (core_cls,), {
        "__init__": __init__, "__doc__": core_cls.__doc__, "__module__": __name__,
        "domains": dict(last_epoch=LAST_EPOCH_DOMAIN),
    })
    return cls


def _onecycle_steps_as_fraction(cls):
    """Upstream's OneCycleLR also takes ``pct_start`` as a number of warm-up
    steps (a value > 1); it becomes the fraction of ``total_steps``."""
    core_init = cls.__init__

    def __init__(self, optimizer: Optimizer, total_steps: int, *args, pct_start: float = 0.3, **kwargs):
        if not isinstance(pct_start, bool) and isinstance(pct_start, numbers.Real) and pct_start > 1:
            total = _core._check_total_steps(total_steps)
            if int(pct_start) >= total:
                raise ConfigError(f"pct_start={pct_start!r}: warm-up steps must be fewer than the run's {total} steps")
            pct_start = int(pct_start) / total
        core_init(self, optimizer, total_steps, *args, pct_start=pct_start, **kwargs)

    __init__.__signature__ = inspect.signature(core_init)
    cls.__init__ = __init__
    cls.domains = dict(cls.domains, pct_start=Real(0, 1, lo_open=True, hi_open=True) | Int(2))
    return cls


def _register_last_epoch_variants() -> dict[str, type]:
    made: dict[str, type] = {}
    for core_cls in (_core.MultiStepLR, _core.PolyLR, _core.ConstantLR, _core.CosineWarmupLR, _core.OneCycleLR):
        names = [n for n in SCHEDULERS.keys() if SCHEDULERS.find(n) is core_cls]
        variant = _with_last_epoch(core_cls)
        if core_cls is _core.OneCycleLR:
            variant = _onecycle_steps_as_fraction(variant)
        SCHEDULERS.register_module(names, force=True, module=variant)
        made[core_cls.__name__] = variant
    return made


_LAST_EPOCH_VARIANTS = _register_last_epoch_variants()
