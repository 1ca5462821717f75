"""OnDemandValidation: evaluate the current weights when a signal arrives.

``kill -USR1 <pid>`` (the signal is configurable) makes the run evaluate at
the next step boundary with every evaluator hook, as
``trainer.validate(kind="on_demand")``: the metrics are logged and written
like any evaluation's, and nothing else happens: no best model, no early
stopping decision, no evaluator state change (the end-of-training
evaluation still runs), and the evaluation runs inside ``fork_rng``, so
training continues bit-identically to a run that never got the signal.

Which step boundary: in a single process, the one after the signal; with
several processes the ranks agree every ``check_every`` steps (one tiny
all-reduce, as for pre-emption signals), so a signal that reached any rank
evaluates on all of them at the same step. ``--num-gpus`` forwards SIGUSR1
from the launcher to every rank, and data-loader workers ignore it.

The handler is installed when the hooks are configured (before data sets
are built, so a signal during a long start-up is served at the first step
rather than killing the process) and removed when training ends. A signal
this platform lacks (Windows has no SIGUSR1) turns the hook into a no-op
with a warning; a name that is no signal anywhere is a ConfigError.
"""

from __future__ import annotations

import logging
import signal as signal_module

from pimm.engines.control import STANDARD_PREEMPT
from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils import comm
from pimm.utils.errors import ConfigError
from pimm.utils.rng import fork_rng
from pimm.utils.domains import PosInt, Signal

__all__ = ["OnDemandValidation", "validate_on_demand"]

# Signals that exist on some platform; one of these missing here is a platform
# limitation (a warning), any other unknown name a typo (an error).
_PLATFORM_SIGNALS = frozenset({
    "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGALRM", "SIGCONT", "SIGWINCH", "SIGINFO", "SIGPWR", "SIGURG",
    "SIGVTALRM", "SIGPROF", "SIGTSTP", "SIGTTIN", "SIGTTOU", "SIGXCPU", "SIGXFSZ", "SIGIO", "SIGPOLL", "SIGSYS",
    "SIGTRAP", "SIGEMT", "SIGLOST", "SIGSTKFLT", "SIGBREAK",
})
_UNCATCHABLE = frozenset({"SIGKILL", "SIGSTOP"})


def validate_on_demand(trainer, why: str) -> dict | None:
    """Evaluate now with every evaluator, metrics only (see the module
    docstring); a collective: every rank calls it at the same step. Returns
    the metrics, or None when there is nothing to do."""
    evaluators = list(getattr(trainer, "evaluators", ()))
    step = trainer.global_step
    if not evaluators:
        trainer.logger.warning(f"On-demand evaluation at step {step} ({why}) skipped: the run has no evaluator hook")
        return None
    if ((getattr(trainer, "cfg", None) or {}).get("data") or {}).get("val") is None:
        trainer.logger.warning(f"On-demand evaluation at step {step} ({why}) skipped: data.val is not set")
        return None
    if all(getattr(e, "last_step", None) == step for e in evaluators):
        trainer.logger.info(f"On-demand evaluation at step {step} ({why}) skipped: the weights of this step were "
                            "just evaluated")
        return None
    trainer.logger.info(f"On-demand evaluation at step {step} ({why})")
    # kind="on_demand": the evaluators' schedules and last_step stay as they were
    # (EvaluatorBase.mark_evaluated), so the end-of-training evaluation still runs.
    with fork_rng():  # also covers building the validation loader on first use
        return trainer.validate(evaluators, kind="on_demand")


def resolve_signal(name, key: str = "signal") -> int | None:
    """The signal number for ``name``; None when this platform lacks it."""
    if not isinstance(name, str) or not name.startswith("SIG") or (
            not hasattr(signal_module, name) and name not in _PLATFORM_SIGNALS):
        raise ConfigError(f"{key}={name!r} is not a signal name; use e.g. 'SIGUSR1' or 'SIGUSR2'")
    if name in _UNCATCHABLE:
        raise ConfigError(f"{key}={name!r} cannot be caught by a process; use e.g. 'SIGUSR1'")
    return getattr(signal_module, name, None)


@HOOKS.register_module()
class OnDemandValidation(HookBase):
    """``signal``: the signal name (default SIGUSR1); ``check_every``: steps
    between the cross-rank agreements when distributed."""

    # After the scheduled evaluators (an evaluation they just ran is not
    # repeated), before CheckpointSaver (LOW).
    priority = "BELOW_NORMAL"

    domains = dict(signal=Signal(portable=True), check_every=PosInt)

    def __init__(self, signal: str = "SIGUSR1", check_every: int = 10):
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
            raise ConfigError(f"OnDemandValidation: check_every={check_every!r} must be a positive integer")
        self.signal_name = signal
        self.signum = resolve_signal(signal, "OnDemandValidation signal")
        self.check_every = check_every
        self._received = 0  # signals counted by the handler
        self._served = 0
        self._previous = None
        self._installed = False

    def modify_config(self, cfg) -> None:
        """Refuse a signal that also pre-empts; install the handler early (start-up)."""
        if self.signal_name in (*STANDARD_PREEMPT, *(cfg.get("preempt_signals") or ())):
            raise ConfigError(f"OnDemandValidation signal {self.signal_name} is also in preempt_signals; a signal "
                              "either pre-empts or evaluates: choose another one (e.g. 'SIGUSR1')")
        self._install()

    def _on_signal(self, signum, frame) -> None:
        self._received += 1

    def _install(self) -> None:
        if self.signum is None or self._installed:
            return
        try:
            self._previous = signal_module.signal(self.signum, self._on_signal)
            self._installed = True
        except ValueError:  # not the main thread (an embedded or threaded caller)
            logging.getLogger("pimm").warning(f"OnDemandValidation: cannot listen for {self.signal_name} outside "
                                              "the main thread; the hook does nothing")

    def before_train(self) -> None:
        """Warn on a platform without the signal; install the handler if not yet done."""
        if self.signum is None:
            self.trainer.logger.warning(f"OnDemandValidation: this platform has no {self.signal_name}; the hook "
                                        "does nothing (choose another signal to use it here)")
        self._install()  # a signal that came during start-up is served at the first step boundary

    def after_step(self) -> None:
        """Serve a signal received since the last step (agreed across ranks)."""
        trainer = self.trainer
        if trainer.control.distributed:
            if trainer.global_step % self.check_every:
                return
            requested = comm.any_rank(self._received > self._served)
        elif self._received == self._served:
            return
        else:
            requested = True
        self._served = self._received
        if requested:
            validate_on_demand(trainer, f"{self.signal_name} received")

    def after_train(self) -> None:
        """Put the previous signal handler back."""
        if self._installed:
            signal_module.signal(self.signum, self._previous if self._previous is not None else signal_module.SIG_DFL)
            self._installed = False
