"""Stopping a run cleanly: requests from hooks and pre-emption signals.

Anything may ask the trainer to stop: a hook (early stopping, live control)
calls ``trainer.request_stop(reason)``; a pre-emption signal (SIGTERM, or
whatever ``preempt_signals`` names) sets a flag from its handler, which does
nothing else, so a second signal during the final save changes nothing.

All ranks must stop at the same step boundary. A request made on every rank
at the same step (``agreed=True``: e.g. early stopping decides on metrics that
are identical on all ranks) takes effect at once. Anything else (a signal
reaches ranks at different moments; a request from one rank) is agreed through
one tiny all-reduce every ``check_every`` steps; a single process needs no
agreement and checks its flags every step for free.

Which signals do what (docs/contract.md, "Signals"), whatever the hooks:
SIGTERM and SIGHUP always pre-empt (checkpoint, exit 75), as does every
signal in ``preempt_signals``; SIGUSR1 asks for an evaluation, which the
OnDemandValidation hook serves when configured; without it the signal is
logged and ignored (its default action would kill the process without a
checkpoint). SIGINT (Ctrl-C) is a stop like a pre-emption, by the same flag
and the same agreement, but ends with exit 130; a second SIGINT aborts at
once (KeyboardInterrupt: the save in flight is abandoned uncommitted, the
last committed checkpoint stays).

When the trainer stops, it commits a final checkpoint, runs ``after_train``
and then either returns (a requested stop: exit code 0) or raises
:class:`~pimm.utils.errors.TrainingPreempted` (a signal: exit code 75, rerun
with ``resume=True``) or :class:`~pimm.utils.errors.TrainingInterrupted`
(Ctrl-C: exit code 130).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable, Iterable

import torch

from pimm.utils import comm
from pimm.utils.errors import ConfigError

__all__ = ["StopControl", "resolve_signals", "STANDARD_PREEMPT", "ignore_unhandled_usr1", "ABORT_NOW"]

#: Signals that always mean "checkpoint and exit 75" (a batch system's
#: pre-emption, a closed terminal), added to ``preempt_signals``.
STANDARD_PREEMPT = ("SIGTERM", "SIGHUP")

# Flags combined into one all-reduce (MAX): a pre-emption outranks a Ctrl-C,
# which outranks a request (a job that is pre-empted must say 75 to be requeued).
_NONE, _REQUESTED, _INTERRUPTED, _PREEMPTED = 0, 1, 2, 3

#: Set (from any thread) before ``_thread.interrupt_main()`` when the process must
#: stop at once rather than finish the step (the run lock was taken by another run):
#: the SIGINT handler then raises KeyboardInterrupt even on a first interrupt.
ABORT_NOW = threading.Event()


def resolve_signals(names: Iterable[str], key: str = "preempt_signals") -> list[int]:
    """Signal numbers for names like ``"SIGTERM"``; unknown names are a ConfigError."""
    numbers = []
    for name in names:
        if not isinstance(name, str) or not name.startswith("SIG") or not hasattr(signal, name):
            raise ConfigError(f"{key}: unknown signal {name!r} (use names like 'SIGTERM', 'SIGUSR2')")
        numbers.append(getattr(signal, name))
    return numbers


def _log_ignored_usr1(signum, frame) -> None:
    # Logged from a thread: a handler that writes while the interrupted main
    # thread is inside a write to the same stream would fail (reentrant call).
    message = (f"{signal.Signals(signum).name} received: no hook serves it (add dict(type='OnDemandValidation') to "
               "hooks to evaluate on demand); ignored")
    threading.Thread(target=logging.getLogger("pimm").warning, args=(message,), daemon=True).start()


def ignore_unhandled_usr1() -> object | None:
    """Route SIGUSR1 to a log line when nothing else listens for it (its
    default action kills the process without a checkpoint). Returns the
    previous handler when this installed one, else None."""
    usr1 = getattr(signal, "SIGUSR1", None)
    if usr1 is None:
        return None
    try:
        current = signal.getsignal(usr1)
        if current not in (signal.SIG_DFL, None):
            return None  # a hook (OnDemandValidation) or the embedding program listens
        return signal.signal(usr1, _log_ignored_usr1)
    except ValueError:  # not the main thread
        return None


class StopControl:
    """The trainer's stop flags: requests (:meth:`request`) and pre-emption
    signals, agreed across ranks at a step boundary (see the module docstring).

    Args:
        preempt_signals: signal names that mean "checkpoint and exit 75"
            (SIGTERM and SIGHUP always do, :data:`STANDARD_PREEMPT`).
        check_every: steps between the all-reduces that agree on a stop when
            several processes run (a single process checks every step).

    The loop reads only ``pending`` per step; ``reason`` is the first request's
    reason and ``preempted`` tells a signal from a request.
    """
    def __init__(self, preempt_signals: Iterable[str] = ("SIGTERM",), check_every: int = 10):
        names = [n for n in STANDARD_PREEMPT if hasattr(signal, n)]
        names += [n for n in preempt_signals if n not in names]
        self.signals = resolve_signals(names)
        self.check_every = max(1, int(check_every))
        self.distributed = comm.get_world_size() > 1
        self.pending = False  # any local flag set: the only thing the loop reads per step
        self.reason: str | None = None
        self.preempted = False
        self.interrupted = False  # a Ctrl-C (SIGINT) asked for the stop (here or, agreed, on another rank)
        self._sigint_received = False  # this process got one: the next one aborts
        self._agreed = False
        self._signal_name: str | None = None
        self._previous: dict = {}
        self._ballots: list[tuple[int, Callable[[], bool], Callable[[], None]]] = []

    # -- requests -------------------------------------------------------
    def request(self, reason: str, agreed: bool = False) -> None:
        """Record a stop request (the first reason wins); ``agreed``: every rank asks at the same step."""
        if self.reason is None:
            self.reason = reason
        self._agreed = self._agreed or agreed
        self.pending = True

    def _on_signal(self, signum, frame) -> None:
        if self._signal_name is None:
            self._signal_name = signal.Signals(signum).name
        self.preempted = True
        self.pending = True

    def _on_interrupt(self, signum, frame) -> None:
        if self._sigint_received or ABORT_NOW.is_set():
            raise KeyboardInterrupt  # the second Ctrl-C: abort now, whatever runs
        self._sigint_received = True
        self.interrupted = True
        self.pending = True
        message = ("Ctrl-C: finishing this step, then saving a checkpoint and exiting (press Ctrl-C again to abort "
                   "at once, without a new checkpoint)")
        threading.Thread(target=logging.getLogger("pimm").warning, args=(message,), daemon=True).start()

    def install(self) -> None:
        """Listen for the pre-emption signals and Ctrl-C, and log-and-ignore an unserved SIGUSR1."""
        if signal.SIGINT not in self.signals:
            try:
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_interrupt)
            except ValueError:  # not the main thread
                pass
        for signum in self.signals:
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                pass
        previous = ignore_unhandled_usr1()
        if previous is not None:
            self._previous[signal.SIGUSR1] = previous

    def uninstall(self) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    # -- the step-boundary check ------------------------------------------
    def add_ballot(self, every: int, vote: Callable[[], bool], on_agreed: Callable[[], None]) -> None:
        """Agree on one more flag across ranks, in the stop check's all-reduce
        (no collective of its own): every ``every`` steps each rank casts
        ``vote()`` (e.g. True on rank 0 only, when its clock says a save is due),
        and when any rank voted True, ``on_agreed()`` runs on every rank at that
        step boundary. The check then also runs at those steps. Used only when
        several processes run (a single process decides alone)."""
        self._ballots.append((max(1, int(every)), vote, on_agreed))

    def should_stop(self, global_step: int) -> bool:
        """True on every rank at the same step boundary once a stop is due."""
        if not self.distributed:
            return self.pending
        if self._agreed:  # requested on every rank at this very step: no collective needed
            return True
        ballots = [b for b in self._ballots if global_step % b[0] == 0] if self._ballots else ()
        if global_step % self.check_every and not ballots:
            return False
        local = (_PREEMPTED if self.preempted else _INTERRUPTED if self.interrupted
                 else _REQUESTED if self.pending else _NONE)
        flags = torch.tensor([float(local), *(1.0 if vote() else 0.0 for _, vote, _ in ballots)])
        agreed_flags = comm.all_reduce(flags, op="max").tolist()  # one transfer for all flags
        agreed = int(agreed_flags[0])
        if agreed == _NONE:
            for (_, _, on_agreed), flag in zip(ballots, agreed_flags[1:]):
                if flag:
                    on_agreed()
            return False
        if agreed == _PREEMPTED:
            self.preempted = True
        elif agreed == _INTERRUPTED:
            self.interrupted = True
        elif self.reason is None:
            self.reason = "a stop requested on another rank"
        self.pending = True
        return True

    def describe(self) -> str:
        """Why the run stops, in words (for logs and the attempt record)."""
        if self.preempted:
            return f"pre-empted by {self._signal_name or 'a signal on another rank'}"
        if self.interrupted:
            return "interrupted by Ctrl-C (SIGINT)"
        return self.reason or "stop requested"
