"""EmptyCache: give cached CUDA memory back after every step and/or epoch
(upstream's ``empty_cache`` / ``empty_cache_per_epoch`` runtime keys, which
add it). It costs a device synchronisation each time; on CPU it does nothing."""

from __future__ import annotations

import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS

__all__ = ["EmptyCache"]


@HOOKS.register_module()
class EmptyCache(HookBase):
    """Call ``torch.cuda.empty_cache()`` after every step (``per_step``) and/or
    every epoch (``per_epoch``); a phase switched off is not dispatched at all."""
    priority = "LOWEST"

    def __init__(self, per_step: bool = False, per_epoch: bool = True):
        self.per_step, self.per_epoch = bool(per_step), bool(per_epoch)

    def overrides(self, phase: str) -> bool:
        # A phase that is switched off is not dispatched at all (no per-step cost).
        return {"after_step": self.per_step, "after_epoch": self.per_epoch}.get(phase, super().overrides(phase))

    def after_step(self):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def after_epoch(self):
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
