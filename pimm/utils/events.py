"""Upstream pimm's (detectron2's) event storage, for code that imports it:
``from pimm.utils.events import EventStorage, get_event_storage, AverageMeter``.

An :class:`EventStorage` collects named scalars during a loop; used as a
context manager it is what :func:`get_event_storage` returns inside the
``with`` block, and :class:`JSONWriter` appends what was put since its last
write as one JSON line per iteration. Each history is an :class:`AverageMeter`
(``val``, ``avg``, ``total``, ``count``, upstream's fields).

Inside a pimm training run, hooks have ``trainer.storage`` instead: the same
calls (``put_scalar``, ``history(name).avg``, ``reset_histories``), bound to
the trainer's step and shared on its metric channel
(:mod:`pimm.engines.loop.hook_contract`). TensorBoard and W&B are written by
the run itself (``trainer.writer``), so upstream's ``TensorboardXWriter``,
``WandbWriter`` and ``CommonMetricPrinter`` are not here.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
from collections import defaultdict, deque
from typing import Any

__all__ = ["get_event_storage", "EventStorage", "AverageMeter", "HistoryBuffer", "EventWriter", "JSONWriter"]

_STORAGES: list["EventStorage"] = []

#: how many recent values an AverageMeter keeps for ``median`` (the smoothing of ``latest_with_smoothing_hint``)
_RECENT = 1000


def get_event_storage() -> "EventStorage":
    """The innermost :class:`EventStorage` entered with ``with``."""
    if not _STORAGES:
        raise RuntimeError("get_event_storage() is called outside a `with EventStorage(...):` block (in a pimm "
                           "hook, use self.trainer.storage)")
    return _STORAGES[-1]


def _number(name: str, value: Any) -> float:
    """``value`` as a float (a one-element tensor or array included); a ValueError naming ``name`` if it is not one."""
    if not isinstance(value, (int, float)) and callable(getattr(value, "item", None)):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            pass
    if not isinstance(value, (int, float)):
        raise ValueError(f"put_scalar({name!r}, ...) takes a number, got {value!r} ({type(value).__name__})")
    return float(value)


class AverageMeter:
    """One scalar's values since the last :meth:`reset`: ``val`` (the newest),
    ``total`` (sum of ``value * n``), ``count`` (sum of ``n``), ``avg``."""

    def __init__(self):
        self._recent: deque = deque(maxlen=_RECENT)
        self.reset()

    def reset(self) -> None:
        """Forget every value."""
        self.val = 0
        self.avg = 0
        self.total = 0
        self.count = 0
        self._recent.clear()

    def update(self, val: float, n: int = 1) -> None:
        """Add ``n`` observations of ``val``."""
        self.val = val
        self.total += val * n
        self.count += n
        self.avg = self.total / self.count if self.count else 0
        self._recent.append(val)

    def median(self, window_size: int) -> float:
        """The median of the newest ``window_size`` values (NaN before any)."""
        values = list(self._recent)[-window_size:]
        return statistics.median(values) if values else math.nan


class HistoryBuffer:
    """A series of ``(value, iteration)`` pairs, at most ``max_length`` kept
    (the oldest dropped), with window statistics and the mean of all values ever added."""

    def __init__(self, max_length: int = 1000000) -> None:
        self._max_length = max_length
        self._data: deque = deque(maxlen=max_length)
        self._count = 0
        self._global_avg = 0.0

    def update(self, value: float, iteration: float | None = None) -> None:
        """Add ``value`` at ``iteration`` (default: how many values came before)."""
        self._data.append((value, self._count if iteration is None else iteration))
        self._count += 1
        self._global_avg += (value - self._global_avg) / self._count

    def latest(self) -> float:
        """The newest value."""
        return self._data[-1][0]

    def median(self, window_size: int) -> float:
        """The median of the newest ``window_size`` values."""
        return statistics.median(v for v, _ in list(self._data)[-window_size:])

    def avg(self, window_size: int) -> float:
        """The mean of the newest ``window_size`` values."""
        return statistics.fmean(v for v, _ in list(self._data)[-window_size:])

    def global_avg(self) -> float:
        """The mean of every value added, the dropped ones included."""
        return self._global_avg

    def values(self) -> list[tuple[float, float]]:
        """The kept ``(value, iteration)`` pairs, oldest first."""
        return list(self._data)


class EventStorage:
    """Named scalars put during a loop at iteration :attr:`iter` (see the module docstring)."""

    def __init__(self, start_iter: int = 0):
        self._history: defaultdict[str, AverageMeter] = defaultdict(AverageMeter)
        self._smoothing_hints: dict[str, bool] = {}
        self._latest_scalars: dict[str, tuple[float, int]] = {}
        self._iter = int(start_iter)
        self._current_prefix = ""
        self._vis_data: list = []
        self._histograms: list = []

    def put_scalar(self, name: str, value: Any, n: int = 1, smoothing_hint: bool = False) -> None:
        """Add ``n`` observations of ``value`` to ``history(name)`` (inside a
        :meth:`name_scope`, the name is prefixed). ``smoothing_hint``: whether
        writers should show the median of recent values; it must stay the same for a name."""
        name = self._current_prefix + name
        value = _number(name, value)
        self._history[name].update(value, n)
        self._latest_scalars[name] = (value, self._iter)
        hint = self._smoothing_hints.setdefault(name, bool(smoothing_hint))
        if hint != bool(smoothing_hint):
            raise ValueError(f"put_scalar({name!r}, ...): smoothing_hint={smoothing_hint} differs from the "
                             f"{hint} it was first put with")

    def put_scalars(self, *, smoothing_hint: bool = False, **scalars: Any) -> None:
        """:meth:`put_scalar` for each keyword."""
        for name, value in scalars.items():
            self.put_scalar(name, value, smoothing_hint=smoothing_hint)

    def history(self, name: str) -> AverageMeter:
        """The history of ``name`` (a KeyError if nothing was put under it)."""
        if name not in self._history:
            raise KeyError(f"no history for {name!r} (known: {', '.join(sorted(self._history)) or 'none'})")
        return self._history[name]

    def histories(self) -> dict[str, AverageMeter]:
        """Every history by name."""
        return self._history

    def latest(self) -> dict[str, tuple[float, int]]:
        """``{name: (newest value, iteration it was put at)}``."""
        return self._latest_scalars

    def latest_with_smoothing_hint(self, window_size: int = 20) -> dict[str, tuple[float, int]]:
        """:meth:`latest`, with the median of the newest ``window_size`` values for smoothed names."""
        return {name: (self._history[name].median(window_size) if self._smoothing_hints[name] else value, itr)
                for name, (value, itr) in self._latest_scalars.items()}

    def smoothing_hints(self) -> dict[str, bool]:
        """``{name: smoothing_hint}``."""
        return self._smoothing_hints

    def step(self) -> None:
        """Move to the next iteration."""
        self._iter += 1

    @property
    def iter(self) -> int:
        """The current iteration."""
        return self._iter

    @iter.setter
    def iter(self, value: int) -> None:
        self._iter = int(value)

    @property
    def iteration(self) -> int:
        """:attr:`iter` (its older name)."""
        return self._iter

    def __enter__(self) -> "EventStorage":
        _STORAGES.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if _STORAGES and _STORAGES[-1] is self:
            _STORAGES.pop()

    @contextlib.contextmanager
    def name_scope(self, name: str):
        """Within the block, every name put is prefixed with ``name/``."""
        previous, self._current_prefix = self._current_prefix, name.rstrip("/") + "/"
        try:
            yield
        finally:
            self._current_prefix = previous

    def clear_images(self) -> None:
        """Forget the images put for visualisation."""
        self._vis_data = []

    def clear_histograms(self) -> None:
        """Forget the histograms put for visualisation."""
        self._histograms = []

    def reset_history(self, name: str) -> None:
        """Clear one history (KeyError if unknown)."""
        self.history(name).reset()

    def reset_histories(self) -> None:
        """Clear every history."""
        for history in self._history.values():
            history.reset()


class EventWriter:
    """Writes what an :class:`EventStorage` holds somewhere: :meth:`write`
    (called periodically, inside the storage's ``with``) and :meth:`close`."""

    def write(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JSONWriter(EventWriter):
    """Appends to ``json_file`` one JSON object per iteration holding the
    scalars put at it since the last :meth:`write` (``"iteration"`` included);
    smoothed names are written as the median of ``window_size`` values."""

    def __init__(self, json_file: str | os.PathLike, window_size: int = 20):
        self._file_handle = open(json_file, "a", encoding="utf-8")
        self._window_size = window_size
        self._last_write = -1

    def write(self) -> None:
        by_iteration: defaultdict[int, dict] = defaultdict(dict)
        for name, (value, itr) in get_event_storage().latest_with_smoothing_hint(self._window_size).items():
            if itr > self._last_write:
                by_iteration[itr][name] = value
        for itr in sorted(by_iteration):
            self._file_handle.write(json.dumps({**by_iteration[itr], "iteration": itr}, sort_keys=True) + "\n")
        if by_iteration:
            self._last_write = max(by_iteration)
        self._file_handle.flush()
        os.fsync(self._file_handle.fileno())

    def close(self) -> None:
        self._file_handle.close()
