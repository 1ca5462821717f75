"""Graceful pre-emption: turn SIGTERM (and friends) into "checkpoint, exit 75".

The signal handler only sets a flag, so a second signal during the save
changes nothing. Ranks agree on stopping at the same step boundary through a
tiny all-reduce that runs every ``check_every`` steps (never per step when
distributed); a single process checks its flag every step for free.
"""

from __future__ import annotations

import signal
from typing import Iterable

from pimm.utils import comm
from pimm.utils.errors import ConfigError

__all__ = ["PreemptionWatcher", "TrainingPreempted", "EXIT_PREEMPTED"]

EXIT_PREEMPTED = 75


class TrainingPreempted(Exception):
    """Raised after the pre-emption checkpoint is committed."""


class PreemptionWatcher:
    def __init__(self, signals: Iterable[str] = ("SIGTERM",), check_every: int = 10):
        self.signal_names = list(signals)
        for name in self.signal_names:
            if not hasattr(signal, str(name)):
                raise ConfigError(f"preempt_signals: unknown signal {name!r} (use names like 'SIGTERM', 'SIGUSR2')")
        self.check_every = max(1, int(check_every))
        self.requested = False
        self.received: str | None = None
        self._previous: dict = {}
        self._distributed = comm.get_world_size() > 1

    def _handler(self, signum, frame) -> None:
        self.requested = True
        if self.received is None:
            self.received = signal.Signals(signum).name

    def install(self) -> None:
        for name in self.signal_names:
            signum = getattr(signal, name)
            try:
                self._previous[signum] = signal.signal(signum, self._handler)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def should_stop(self, global_step: int) -> bool:
        """Call at every step boundary; True on all ranks at the same step."""
        if not self._distributed:
            return self.requested
        if global_step % self.check_every:
            return False
        return comm.any_rank(self.requested)
