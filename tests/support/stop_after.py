"""``StopAfter``: a user-style hook (declared domains, as docs/config.md shows)
that asks the run to stop after ``steps`` optimizer steps, so a test can train
any shipped config for a few steps (imported via ``custom_imports``)."""

from __future__ import annotations

from pimm.engines import HOOKS, HookBase
from pimm.utils.domains import PosInt

__all__ = ["StopAfter"]


@HOOKS.register_module(force=True)
class StopAfter(HookBase):
    domains = dict(steps=PosInt)

    def __init__(self, steps: int = 2):
        self.steps = steps

    def after_step(self):
        if self.trainer.global_step >= self.steps:
            self.trainer.request_stop(f"StopAfter: {self.steps} steps", agreed=True)
