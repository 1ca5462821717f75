"""The training loop and hook dispatch, independent of models and data.

:class:`TrainerBase` is the loop and nothing else::

    restore()                                  # resume / warm start: every participant, hooks included
    after_load_checkpoint                      # (when something was restored)
    before_train
    open_outputs()                             # the metric sinks, before the first step
    try:
        while epoch < max_epoch:
            before_epoch
            while step_in_epoch < iters_per_epoch:
                before_step
                run_step()                     # subclass: forward, backward, after_backward, optimizer step
                after_step
                if a stop is agreed by all ranks: leave both loops
            after_epoch                        # (not for an epoch left by a stop)
        finish(stopped)                        # final evaluation if due; final checkpoint after a stop
    except exception:
        on_exception(exc)
        raise
    finally:
        after_train                            # always; trainer.outcome says how it ended
    pre-empted: raise TrainingPreempted        # the CLI exits 75; a requested stop returns (exit 0)
    Ctrl-C: raise TrainingInterrupted          # the CLI prints the resume command, exits 130

When the run fails, its first error is the one raised: an ``on_exception``
or ``after_train`` hook that then fails too is logged (its traceback in
train.log) and the other hooks of that phase still run.

A second Ctrl-C raises KeyboardInterrupt wherever the main thread is: the
run is ``aborted``, :meth:`abort_saves` abandons the checkpoint in flight
(never committed), and the CLI exits 130.

Subclasses build the components and implement :meth:`run_step`,
:meth:`restore`, :meth:`save_checkpoint` and :meth:`finish`. Hook dispatch
tuples are computed once per phase, holding only the hooks that override
it, so a phase no hook uses costs one empty-tuple iteration.
"""

from __future__ import annotations

import logging
import weakref

from pimm.engines.control import StopControl
from pimm.engines.loop.hook_contract import CommInfo, UpstreamTrainerView
from pimm.engines.hooks.base import PHASES, HookBase, get_priority
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.state.train_state import TrainState
from pimm.engines.observe.tracing import NULL_TRACER
from pimm.utils.errors import TrainingInterrupted, TrainingPreempted, UserError
from pimm.utils.logger import FILE_ONLY

__all__ = ["TrainerBase"]

OUTCOMES = ("running", "completed", "stopped", "preempted", "interrupted", "failed", "aborted")


class TrainerBase(UpstreamTrainerView):
    """The loop (see the module docstring). Attributes every hook may read:

    ``train_state`` (epoch, step in epoch, global step, samples seen),
    ``epoch`` (0-based index of the epoch in progress), ``max_epoch``,
    ``iters_per_epoch``, ``metrics`` (the metric channel), ``comm_info``
    (this step's ``input_dict``, ``model_output_dict``, ``loss`` and ``iter``),
    ``step_result`` (the last update's grad norm, whether it stepped, its lr),
    ``logger``, ``outcome``; and upstream's ``storage``, ``best_metric_value``,
    ``start_epoch``, ``comm_info["iter_info"]`` (:mod:`pimm.engines.loop.hook_contract`)."""

    #: The metric a user watches to judge this kind of training, with the
    #: direction that is better: on the console line and in the end-of-run summary.
    headline_metric: tuple[str, str] = ("train/loss", "min")

    def __init__(self):
        self.hooks: list[HookBase] = []
        self._dispatch: dict[str, tuple] = {phase: () for phase in PHASES}
        self.train_state = TrainState()
        self.epoch = 0
        self.max_epoch = 0
        self.iters_per_epoch = 0
        self.samples_per_step = 0
        self.comm_info: dict = CommInfo(iter_info="")
        self.step_result = None
        self.metrics = MetricChannel()
        self.logger = logging.getLogger("pimm")
        self.control = StopControl(preempt_signals=())
        self.outcome = "running"
        self.tracer = NULL_TRACER  # structured step tracing (pimm.engines.observe.tracing), off by default

    # -- state views ----------------------------------------------------
    @property
    def global_step(self) -> int:
        """Optimizer steps completed in the whole run."""
        return self.train_state.global_step

    @property
    def iter(self) -> int:
        """Optimizer steps completed in the current epoch."""
        return self.train_state.iter_in_epoch

    # -- hooks ----------------------------------------------------------
    def register_hooks(self, hooks: list[HookBase]) -> None:
        """Add hooks; they run by ascending priority, ties in registration order."""
        proxy = weakref.proxy(self)
        for hook in hooks:
            if not isinstance(hook, HookBase):
                raise UserError(f"hooks: {hook!r} is not a HookBase subclass instance")
            hook.priority = get_priority(hook.priority)
            hook.trainer = proxy
        self.hooks = sorted(self.hooks + list(hooks), key=lambda h: h.priority)
        traced = self.tracer.enabled and self.tracer.trace_hooks
        self._dispatch = {
            phase: tuple(_traced_hook(self.tracer, h, phase) if traced else h.phase_callable(phase)
                         for h in self.hooks if h.overrides(phase))
            for phase in PHASES
        }

    def call_hooks(self, phase: str, *args) -> None:
        """Run ``phase`` on every hook that overrides it, in priority order."""
        fns = self._dispatch[phase]
        if fns and self.tracer.enabled:
            t0 = self.tracer.now()
            for fn in fns:
                fn(*args)
            self.tracer.complete(phase, t0)
            return
        for fn in fns:
            fn(*args)

    # -- control --------------------------------------------------------
    def request_stop(self, reason: str, agreed: bool = False) -> None:
        """Ask the run to stop at the next step boundary, with a final checkpoint
        and exit code 0. ``agreed=True`` when every rank makes the same request
        at the same step (then no collective is needed to agree on it)."""
        if not self.control.pending:
            self.logger.info(f"Stop requested at step {self.global_step}: {reason}")
        self.control.request(reason, agreed=agreed)

    # -- lifecycle ------------------------------------------------------
    def train(self) -> None:
        """Run training to ``max_epoch`` or until a stop (see the module docstring)."""
        tracer = self.tracer
        looping = False
        try:
            self.control.install()
            restored = self.restore()
            self.epoch = self.start_epoch = self.train_state.epoch
            self.metrics.step, self.metrics.epoch = self.train_state.global_step, self.train_state.epoch + 1
            if self.headline_metric[0].startswith("train/"):  # the trainer's own series: no hook may publish it
                self.metrics.reserve(self.headline_metric[0], f"{type(self).__name__}'s own per-step series")
            if restored:
                tracer.instant("resume", from_step=self.train_state.global_step)
                self.call_hooks("after_load_checkpoint")
            tracer.step, tracer.epoch = self.train_state.global_step, self.train_state.epoch + 1
            tracer.instant("train_start")
            self.call_hooks("before_train")
            if self.train_state.epoch >= self.max_epoch:
                self.logger.info(
                    f"Nothing to train: {self.train_state.epoch} of {self.max_epoch} epochs are already done "
                    "(raise `epoch` to extend this run)"
                )
            looping = True
            self.open_outputs()
            stopped = self._run_epochs()
            if stopped:
                tracer.instant(self._stop_kind(), reason=self.control.describe())
            self.finish(stopped)
            self.outcome = self._stop_kind() if stopped else "completed"
        except KeyboardInterrupt as exc:  # a second Ctrl-C (or a lost run lock): stop now, commit nothing new
            self.outcome = "aborted"
            self.logger.warning(f"Aborted at epoch {self.epoch + 1}, step {self.global_step}: no new checkpoint "
                                "(the last committed one stays)")
            self.abort_saves()
            self._call_hooks_after_failure("on_exception", exc)
            raise
        except BaseException as exc:
            self.outcome = "failed"
            if not isinstance(exc, UserError):
                self.logger.exception(f"Training failed at epoch {self.epoch + 1}, step {self.global_step}")
                exc._pimm_logged = True  # the launcher must not log it a second time
            elif looping:  # bad input found mid-run (not a refused start): its line in train.log too
                self.logger.error(f"error: {exc} (at epoch {self.epoch + 1}, step {self.global_step})",
                                  extra=FILE_ONLY)
            if looping:  # a refused start writes nothing into save_path
                self.report_failure(exc)
            self._call_hooks_after_failure("on_exception", exc)
            raise
        finally:
            try:
                if self.outcome in ("failed", "aborted"):
                    self._call_hooks_after_failure("after_train")
                else:
                    self.call_hooks("after_train")
            finally:
                tracer.instant("train_end", outcome=self.outcome)
                self.control.uninstall()
                try:
                    self.close()
                except Exception:
                    if self.outcome not in ("failed", "aborted"):
                        raise
                    # A full disk fails the writers' flush too: keep the first error, not this one.
                    self.logger.error("Closing after the failure failed as well", exc_info=True, extra=FILE_ONLY)
                tracer.close()
        if self.outcome == "preempted":
            raise TrainingPreempted(self.control.describe())
        if self.outcome == "interrupted":
            raise TrainingInterrupted(self.control.describe())

    def _call_hooks_after_failure(self, phase: str, *args) -> None:
        """``phase`` on every hook once the run has failed: the run's first error
        is the one reported, so a hook that fails too is logged (train.log, with
        its traceback) and the next hook still runs."""
        for fn in self._dispatch[phase]:
            try:
                fn(*args)
            except Exception as err:  # noqa: BLE001  (the run's own error is on its way up)
                hook = getattr(fn, "__self__", None)
                name = type(hook).__name__ if hook is not None else getattr(fn, "__qualname__", phase)
                line = f"{name}.{phase} failed too, after the run failed: {type(err).__name__}: {err}"
                self.logger.warning(f"{line} (traceback in train.log; the run's own error is the one reported)")
                self.logger.error(line, exc_info=True, extra=FILE_ONLY)

    def _stop_kind(self) -> str:
        """The outcome of a stop: "preempted", "interrupted" (Ctrl-C) or "stopped" (a request)."""
        control = self.control
        return "preempted" if control.preempted else "interrupted" if control.interrupted else "stopped"

    def _run_epochs(self) -> bool:
        """The epoch loop; True when it was left by a stop."""
        state = self.train_state
        while state.epoch < self.max_epoch:
            self.epoch = state.epoch
            self.metrics.epoch = self.tracer.epoch = state.epoch + 1
            self.comm_info["epoch"], self.comm_info["iter_per_epoch"] = state.epoch, self.iters_per_epoch  # upstream's
            self.call_hooks("before_epoch")
            if self.run_epoch():
                return True
            state.epoch += 1
            state.iter_in_epoch = 0
            self.call_hooks("after_epoch")
            self.reset_epoch_histories()  # upstream's trainer.storage holds one epoch
            # Every rank or none enters the check (it may be a collective): a signal that reached one rank
            # during after_epoch must not send that rank alone into the all-reduce.
            control = self.control
            if state.epoch < self.max_epoch and (control.pending or control.distributed) and \
                    control.should_stop(state.global_step):
                return True
        return False

    def run_epoch(self) -> bool:
        """The step loop of one epoch; True when it was left by a stop.

        There is one loop, traced or not. With tracing off ``self.tracer`` is
        the no-op :data:`~pimm.engines.observe.tracing.NULL_TRACER`, which every other
        call site uses unguarded; here, the hottest spot, its calls sit behind
        one local flag: five no-op calls per step cost about 1 us (measured
        against this loop without them), a flag test next to nothing."""
        state, tracer, control = self.train_state, self.tracer, self.control
        traced = tracer.enabled  # off: the tracer is the no-op NULL_TRACER and these lines are skipped
        before, after = self._dispatch["before_step"], self._dispatch["after_step"]
        distributed = control.distributed
        samples_per_step = self.samples_per_step
        info, metrics = self.comm_info, self.metrics
        store = dict.__setitem__  # the trainer's own keys skip CommInfo's check (it is for hooks' values)
        while state.iter_in_epoch < self.iters_per_epoch:
            if traced:
                tracer.step = state.global_step + 1
                start = t = tracer.now()
            store(info, "iter_info", "")  # upstream's log-line text, appended to by this step's hooks
            for fn in before:
                fn()
            if traced and before:
                tracer.complete("before_step", t)
            self.run_step()
            if traced:
                t = tracer.now()
            state.iter_in_epoch += 1
            state.global_step += 1
            state.samples_seen += samples_per_step
            store(info, "iter", state.iter_in_epoch)
            metrics.step = state.global_step
            for fn in after:
                fn()
            if traced:
                if after:
                    tracer.complete("after_step", t)
                tracer.complete("step", start)
            if (control.pending or distributed) and control.should_stop(state.global_step):
                return True
        return False

    # -- for subclasses -------------------------------------------------
    def run_step(self) -> None:
        """One optimizer step (forward, backward, ``after_backward``, update)."""
        raise NotImplementedError

    def restore(self) -> bool:
        """Restore state (resume or warm start) before any hook runs; True if anything was restored."""
        return False

    def open_outputs(self) -> None:
        """Open the run's output files before the first step (after restore and ``before_train``)."""

    def finish(self, stopped: bool) -> None:
        """End of training: evaluate the final weights if due; on a stop, commit a final checkpoint."""

    def save_checkpoint(self) -> None:
        """Commit a resumable checkpoint of this step (a collective: every rank calls it)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (writers, loader workers); called once at the end."""

    def report_failure(self, exc: BaseException) -> None:
        """Record a failure where the user looks (the dashboards); must not raise."""

    def abort_saves(self) -> None:
        """A second Ctrl-C: abandon any checkpoint being written, uncommitted; must not raise."""


def _traced_hook(tracer, hook, phase: str):
    """``hook.<phase>`` recording its own span (``structured_logging.trace_hooks``)."""
    fn = hook.phase_callable(phase)
    name = f"{phase}:{type(hook).__name__}"

    def traced(*args):
        t0 = tracer.now()
        try:
            return fn(*args)
        finally:
            tracer.complete(name, t0)
    traced.__self__ = hook  # dispatch introspection (which hook a phase calls) keeps working
    return traced
