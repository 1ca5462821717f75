"""Crash injection inside a checkpoint save (imported via ``custom_imports``).

``KillAtStep`` (in ``toy.py``) stops a run *between* steps; the hook here
interrupts the checkpoint writer itself, which is where a non-atomic design
would leave a half-written checkpoint behind. It wraps
``pimm.engines.state.manager._save_synced`` (the one function every checkpoint
file goes through) for the save of one chosen step:

* ``signal_name="SIGKILL"``: write only the first half of ``file``'s bytes,
  fsync them, then SIGKILL the process: the on-disk state of a machine that
  died in the middle of ``torch.save``.
* any other signal (``"SIGTERM"``): deliver the signal to this process just
  before ``file`` is written, then write it normally: a second pre-emption
  signal arriving while a save is in progress.

Usage in a config::

    custom_imports = ["tests.support.toy", "tests.support.crash"]
    hooks = [..., dict(type="CrashDuringSave", step=15, file="common.pth")]
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import torch

import pimm.engines.state.manager as checkpoint_module
from pimm.engines import HOOKS, HookBase

__all__ = ["CrashDuringSave", "install_save_crash"]


def install_save_crash(step: int, file: str = "common.pth", signal_name: str = "SIGKILL"):
    """Wrap ``_save_synced`` so writing ``file`` of the step-``step`` checkpoint is
    interrupted by ``signal_name``. Returns a function that removes the wrapper."""
    original = checkpoint_module._save_synced
    prefix = f".tmp-step{step:09d}-"
    signum = getattr(signal, signal_name)

    def interrupted_save(obj, path):
        path = Path(path)
        if path.name != file or not path.parent.name.startswith(prefix):
            return original(obj, path)
        if signum == signal.SIGKILL:
            buffer = io.BytesIO()
            torch.save(obj, buffer)
            data = buffer.getvalue()
            with open(path, "wb") as fh:
                fh.write(data[: len(data) // 2])
                fh.flush()
                os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        # Python runs the handler at the next bytecode boundary, i.e. before the write.
        os.kill(os.getpid(), signum)
        return original(obj, path)

    checkpoint_module._save_synced = interrupted_save

    def remove() -> None:
        checkpoint_module._save_synced = original

    return remove


@HOOKS.register_module(force=True)
class CrashDuringSave(HookBase):
    """Installs :func:`install_save_crash` for the whole run."""

    def __init__(self, step: int, file: str = "common.pth", signal_name: str = "SIGKILL"):
        self.step, self.file, self.signal_name = step, file, signal_name
        self._remove = None

    def before_train(self):
        self._remove = install_save_crash(self.step, self.file, self.signal_name)

    def after_train(self):
        if self._remove is not None:
            self._remove()
            self._remove = None
