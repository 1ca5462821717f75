"""The value schedules Sonata's hyper-parameters follow (mask size and ratio,
teacher temperature, EMA momentum, mask jitter).

Each is a pure function of the optimizer step, so a resumed run recomputes
exactly the value the interrupted one would have used: there is no cursor to
save. The shape is the one upstream's ``CosineScheduler`` precomputes: a
linear ramp ``start -> base`` over ``warmup`` steps (``numpy.linspace``
including both ends), then a half cosine ``base -> final`` over the remaining
``total - warmup`` steps, and ``final`` from step ``total`` on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["cosine_value", "WarmupCosine"]


def cosine_value(step: int, total: int, base: float, final: float, start: float = 0.0, warmup: int = 0) -> float:
    """The scheduled value at 0-based ``step`` of a ``total``-step run."""
    step, total, warmup = int(step), int(total), max(0, int(warmup))
    if step >= total:
        return float(final)
    if step < warmup:
        if warmup == 1:
            return float(start)
        return float(start + (base - start) * step / (warmup - 1))
    length = total - warmup
    return float(final + 0.5 * (base - final) * (1.0 + math.cos(math.pi * (step - warmup) / length)))


@dataclass(frozen=True)
class WarmupCosine:
    """A schedule bound to its constants; ``warmup_ratio`` is a fraction of the
    run's total steps (upstream's ``int(total * ratio)``)."""

    start: float
    base: float
    final: float
    warmup_ratio: float = 0.0

    def __call__(self, step: int, total: int) -> float:
        return cosine_value(step, total, self.base, self.final, self.start, int(total * self.warmup_ratio))
