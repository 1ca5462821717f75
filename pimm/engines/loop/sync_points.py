"""The moments at which training may make the host wait for the device.

A training step queues device work only: losses, gradient norms and the other
per-step scalars stay on the device, and the host reads them at a few marked
moments, each entered as ``with host_sync("<why>"):``

* ``metric flush``: :meth:`pimm.engines.observe.metrics.MetricChannel.flush` (the log
  cadence, evaluations, checkpoints, the end) reads every buffered scalar in
  one transfer;
* ``evaluation``: a validation or test pass (evaluators read their results);
* ``checkpoint``: a save (states are snapshot to host memory) or a restore;
* ``rollout``: a GRPO rollout (its reward checks and global totals are read
  on the host, see :mod:`pimm.engines.trainers.grpo`).

Anything else in the step that reads a device value (``.item()``,
``bool(tensor)``, ``.cpu()``, ``.tolist()``, a boolean-mask index...) stalls
the host until the device catches up, every step. ``tests/test_no_host_sync.py``
runs whole trainings with every such read instrumented and fails on any read
outside these moments; ``bench/gpu_check.py`` runs the same under
``torch.cuda.set_sync_debug_mode("error")`` on a GPU.

Some syncs are what a user asked for and stay unmarked: ``empty_cache=True``
(``torch.cuda.empty_cache()`` after every step), the NaNGuard hook (it
decides on the host whether to skip the update), fp16 with a GradScaler
(torch's ``GradScaler.step`` reads its inf check on the host unless the
optimizer is fused, and the scheduler steps only after a real update).

The marker costs one list append and pop per moment (a few per logging
interval, never per step) and nothing else: only the test and the GPU check
look at it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

__all__ = ["host_sync", "sync_allowed", "open_moments", "on_moments"]

_open: list[str] = []  # the reasons of the moments entered and not yet left (innermost last)
_observers: list[Callable[[bool], None]] = []  # told when the first moment opens / the last one closes


class host_sync:  # noqa: N801  (used like a function: ``with host_sync("checkpoint"):``)
    """Context marking a moment where reading device values on the host is by design."""

    __slots__ = ("reason",)

    def __init__(self, reason: str):
        self.reason = reason

    def __enter__(self) -> "host_sync":
        if not _open and _observers:
            for observer in _observers:
                observer(True)
        _open.append(self.reason)
        return self

    def __exit__(self, *exc) -> None:
        _open.pop()
        if not _open and _observers:
            for observer in _observers:
                observer(False)


def sync_allowed() -> bool:
    """True inside a :class:`host_sync` moment (on any thread)."""
    return bool(_open)


def open_moments() -> tuple[str, ...]:
    """The reasons of the moments currently entered, outermost first."""
    return tuple(_open)


@contextlib.contextmanager
def on_moments(observer: Callable[[bool], None]) -> Iterator[None]:
    """Within this context, call ``observer(True)`` when a moment opens (none was
    open) and ``observer(False)`` when the last open one closes. ``bench/gpu_check.py``
    switches ``torch.cuda.set_sync_debug_mode`` between "error" and "default" with it."""
    _observers.append(observer)
    try:
        yield
    finally:
        _observers.remove(observer)
