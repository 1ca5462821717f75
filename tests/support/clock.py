"""A fake wall clock for the CheckpointSaver's time cadence (imported via
``custom_imports``): no test depends on how fast the machine runs.

``FakeClock`` advances by ``seconds_per_step`` before every step (times
``speedup[rank]`` on that rank, so ranks can disagree about the time) and
hands itself to every CheckpointSaver as its ``clock``.
"""

from __future__ import annotations

from pimm.engines import HOOKS, HookBase
from pimm.engines.hooks.checkpoint import CheckpointSaver
from pimm.utils import comm

__all__ = ["FakeClock"]


@HOOKS.register_module(force=True)
class FakeClock(HookBase):
    priority = "HIGHEST"  # its before_train hands the clock over before the saver reads it

    def __init__(self, seconds_per_step: float = 20.0, speedup: dict | None = None):
        self.seconds_per_step = float(seconds_per_step)
        self.speedup = {int(rank): float(factor) for rank, factor in (speedup or {}).items()}
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def before_train(self):
        for hook in self.trainer.hooks:
            if isinstance(hook, CheckpointSaver):
                hook.clock = self

    def before_step(self):
        self.now += self.seconds_per_step * self.speedup.get(comm.get_rank(), 1.0)
