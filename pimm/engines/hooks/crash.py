"""``SimulateCrash``: die like a pre-empted or crashed job, for resume drills.

Upstream pimm's configs list it in a run that a test kills and resumes; it
fires only when asked (``step`` or ``$PIMM_SIMULATE_CRASH_STEP``), so the same
config trains normally otherwise. The exit is ``os._exit``: no hook's
``after_train``, no final checkpoint, no flushing, as with ``kill -9``; only
the last checkpoint that was *committed* survives, which is the point of the
drill.
"""

from __future__ import annotations

import os

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Int, PosInt
from pimm.utils.errors import ConfigError

__all__ = ["SimulateCrash", "CRASH_STEP_ENV", "crash_step_from_env"]

CRASH_STEP_ENV = "PIMM_SIMULATE_CRASH_STEP"


@HOOKS.register_module()
class SimulateCrash(HookBase):
    """Exit the process with ``exit_code`` after it has run ``step`` training steps.

    Args:
        step: how many steps this process runs before dying (upstream's
            meaning: a resumed run counts from its own start, so resuming with
            the same setting dies again only if ``step`` more steps remain);
            ``None`` reads ``$PIMM_SIMULATE_CRASH_STEP`` (upstream's switch)
            and does nothing when it is unset.
        exit_code: the process's exit status (137, as a SIGKILL'd process).
        wait_for_commit: first wait for the checkpoint being written in the
            background, so which checkpoints survive does not depend on how
            fast the disk is (upstream saves synchronously).
    """

    priority = "LOWEST"
    domains = dict(step=PosInt | None, exit_code=Int(1, 255))

    def __init__(self, step: int | None = None, exit_code: int = 137, wait_for_commit: bool = True):
        self.step = step if step is not None else crash_step_from_env()  # checked where the hook is built
        self.exit_code, self.wait_for_commit = exit_code, bool(wait_for_commit)

    def before_train(self):
        if self.step is not None:
            self.trainer.logger.info("SimulateCrash: the process will exit with %d after %d step(s)", self.exit_code,
                                     self.step)
        self.steps_run = 0

    def after_step(self):
        if self.step is None:
            return
        self.steps_run += 1
        if self.steps_run == self.step:
            if self.wait_for_commit:
                self.trainer.checkpointer.wait()
            os._exit(self.exit_code)


def crash_step_from_env() -> int | None:
    """``$PIMM_SIMULATE_CRASH_STEP`` as a step count (None when unset); anything
    but a positive integer is a ConfigError: 0 or -1 would crash at once or
    never, neither of which is a drill."""
    raw = os.environ.get(CRASH_STEP_ENV)
    if raw is None:
        return None
    try:
        step = int(raw.strip())
    except ValueError:
        step = None
    if step is None or step < 1:
        raise ConfigError(f"${CRASH_STEP_ENV}={raw!r} must be a positive number of steps (the process exits after "
                          "running that many); unset it to train normally")
    return step
