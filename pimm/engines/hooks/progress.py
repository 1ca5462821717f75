"""ProgressBar: a tqdm bar per epoch on an interactive terminal only.

Log files and CI output never get one: the hook stays inert unless rank 0's
stderr is a TTY.
"""

from __future__ import annotations

import sys

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils import comm

__all__ = ["ProgressBar"]


@HOOKS.register_module()
class ProgressBar(HookBase):
    """A tqdm bar per epoch on rank 0 when stderr is a terminal (``force=True``:
    always); otherwise inert."""
    priority = "LOW"

    def __init__(self, force: bool = False):
        self.force = force
        self._bar = None

    @property
    def enabled(self) -> bool:
        """Shown only on rank 0 and on a terminal (or when forced)."""
        return comm.is_main_process() and (self.force or sys.stderr.isatty())

    def before_epoch(self):
        if not self.enabled:
            return
        from tqdm import tqdm

        trainer = self.trainer
        self._bar = tqdm(total=trainer.iters_per_epoch, initial=trainer.iter, leave=False, dynamic_ncols=True,
                         desc=f"epoch {trainer.epoch + 1}/{trainer.max_epoch}", file=sys.stderr)

    def after_step(self):
        if self._bar is not None:
            self._bar.update(1)

    def after_epoch(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    after_train = after_epoch
