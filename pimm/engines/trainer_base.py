"""The training lifecycle and hook dispatch, independent of models and data.

:class:`TrainerBase` knows only the loop::

    before_train
    for each remaining epoch:   before_epoch, (before_step, run_step, after_step)*, after_epoch
    after_train

Subclasses build the components and implement :meth:`run_step`. Hook
dispatch lists are computed once per phase, holding only the hooks that
override that phase, so the per-step cost is a couple of list iterations.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import defaultdict, deque

from pimm.engines.hooks.base import PHASES, HookBase, get_priority
from pimm.engines.preemption import PreemptionWatcher, TrainingPreempted
from pimm.engines.train_state import TrainState
from pimm.utils import comm
from pimm.utils.errors import UserError

__all__ = ["TrainerBase", "MetricStorage"]


class MetricStorage:
    """Windowed host-side averages (timings and the like) for log lines."""

    def __init__(self, window: int = 20):
        self._values: dict[str, deque] = defaultdict(lambda: deque(maxlen=window))

    def put(self, name: str, value: float) -> None:
        self._values[name].append(value)

    def avg(self, name: str, default: float = float("nan")) -> float:
        values = self._values.get(name)
        return sum(values) / len(values) if values else default

    def latest(self, name: str, default: float = float("nan")) -> float:
        values = self._values.get(name)
        return values[-1] if values else default


class TrainerBase:
    def __init__(self):
        self.hooks: list[HookBase] = []
        self._dispatch: dict[str, tuple] = {phase: () for phase in PHASES}
        self.train_state = TrainState()
        self.epoch = 0  # index of the epoch in progress (0-based)
        self.max_epoch = 0
        self.iters_per_epoch = 0
        self.samples_per_step = 0
        self.comm_info: dict = {}
        self.storage = MetricStorage()
        self.logger = logging.getLogger("pimm")
        self.checkpointer = None
        self.writer = None
        self.preemption: PreemptionWatcher | None = None

    # -- state views ----------------------------------------------------
    @property
    def global_step(self) -> int:
        return self.train_state.global_step

    @property
    def iter(self) -> int:
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
        self._dispatch = {
            phase: tuple(getattr(h, phase) for h in self.hooks if h.overrides(phase)) for phase in PHASES
        }

    def call_hooks(self, phase: str) -> None:
        for fn in self._dispatch[phase]:
            fn()

    # -- lifecycle ------------------------------------------------------
    def train(self) -> None:
        """Run training to ``max_epoch``. Failures are logged once with their
        traceback, writers are closed, and the exception propagates."""
        ok = False
        try:
            if self.preemption is not None:
                self.preemption.install()
            self.call_hooks("before_train")
            if self.train_state.epoch >= self.max_epoch:
                self.logger.info(
                    f"Nothing to train: {self.train_state.epoch} of {self.max_epoch} epochs are already done "
                    "(raise `epoch` to extend this run)"
                )
            while self.train_state.epoch < self.max_epoch:
                self.epoch = self.train_state.epoch
                self.call_hooks("before_epoch")
                self.run_epoch()
                self.train_state.epoch += 1
                self.train_state.iter_in_epoch = 0
                self.call_hooks("after_epoch")
            self.train_state.finished = True
            self.call_hooks("after_train")
            ok = True
        except (TrainingPreempted, UserError):
            ok = True  # an expected outcome, reported by the launcher
            raise
        except BaseException as err:
            self.logger.exception(f"Training failed at epoch {self.epoch + 1}, step {self.global_step}")
            err._pimm_logged = True  # the launcher must not log it a second time
            raise
        finally:
            if self.preemption is not None:
                self.preemption.uninstall()
            self.close(flush=ok or comm.get_world_size() == 1)

    def run_epoch(self) -> None:
        state = self.train_state
        before, after = self._dispatch["before_step"], self._dispatch["after_step"]
        preemption = self.preemption
        while state.iter_in_epoch < self.iters_per_epoch:
            for fn in before:
                fn()
            self.run_step()
            state.iter_in_epoch += 1
            state.global_step += 1
            state.samples_seen += self.samples_per_step
            for fn in after:
                fn()
            if preemption is not None and preemption.should_stop(state.global_step):
                self.on_preempted()

    def run_step(self) -> None:
        raise NotImplementedError

    def on_preempted(self) -> None:
        start = time.perf_counter()
        reason = self.preemption.received or "a signal on another rank"
        self.logger.warning(f"Pre-empted by {reason} at step {self.global_step}: saving a checkpoint")
        self.save_checkpoint()
        self.logger.warning(
            f"Checkpoint committed in {time.perf_counter() - start:.1f}s; exiting with code 75 "
            "(rerun with resume=True to continue)"
        )
        raise TrainingPreempted(reason)

    def save_checkpoint(self) -> None:
        raise NotImplementedError

    def close(self, flush: bool = True) -> None:
        if self.writer is not None:
            self.writer.close(flush=flush)
