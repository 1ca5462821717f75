"""Structured step tracing: per-rank JSONL span records under ``save_path/trace/``.

Off by default (``structured_logging.enabled=True`` turns it on). Each rank
writes its own files, ``trace/rank{R:05d}-{seq:04d}.jsonl``; every file starts
with a metadata record, so any file can be read alone. One JSON object per line:

* ``{"ph": "M", "name": "process", "rank", "pid", "host", "attempt", "job", "world_size", "ts"}``
* ``{"ph": "X", "name", "rank", "step", "epoch", "ts", "dur"[, "thread"][, "args"]}``: a complete span
* ``{"ph": "B", ...}``: a long span that has started (written and flushed at
  once); its ``X`` record (same ``name`` and ``ts``) follows when it ends. A
  ``B`` without its ``X`` is a span that was still running when the file ends.
* ``{"ph": "i", "name", "rank", "step", "epoch", "ts", "args"}``: an instant
* ``{"ph": "C", "name", "rank", "step", "epoch", "ts", "args": {name: number}}``: a counter

``ts`` is Unix time in seconds (start of the span, a whole microsecond),
``dur`` seconds from that microsecond (so the end, too, is exact to the
microsecond and spans nest exactly; the export relies on it); ``step``
is the global optimizer step the record belongs to (0 before training),
``epoch`` is 1-based (0 before training).

Why our own writer rather than ``torch.profiler`` or ``logging``: the profiler
traces operators, costs far more than 3 % of a small step and is meant for a
few steps, not a whole run; a ``logging`` record costs several microseconds.
This one keeps the hot path to a clock read and a ``deque.append`` of a tuple
(about 1 us per span, see ``bench/tracing.py``); records are formatted with
f-strings and written in batches by a daemon thread every ``flush_every_s``
(``deque`` appends and pops are atomic, so the hot path takes no lock), and
synchronously on every ``B`` and instant record, so a killed run loses at most
the last ``flush_every_s`` of short spans and never hides what it was doing.
A kill can cut the last line; readers skip and count it.

A new attempt (a resumed run) continues with the next ``seq`` and never
truncates a file; a file that passes ``max_bytes`` is closed and the next
``seq`` opened; at most ``max_files`` per rank are kept (oldest deleted).

The module imports only the standard library.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import socket
import threading
import time
from collections import deque
from pathlib import Path
from time import perf_counter_ns

from pimm.utils.errors import ConfigError
from pimm.engines.observe.trace_options import TRACE_DIR, TRACING_DEFAULTS, trace_files, validate_options
from pimm.engines.observe.null_tracer import NULL_TRACER, NullTracer  # noqa: F401

__all__ = [
    "TRACING_DEFAULTS",
    "NULL_TRACER",
    "NullTracer",
    "Tracer",
    "build_tracer",
    "trace_files",
    "validate_options",
]

_logger = logging.getLogger("pimm")


class Tracer:
    """Writes one rank's trace records; see the module docstring for the format.

    Hot path (the loop sets ``tracer.step`` and ``tracer.epoch``)::

        t = tracer.now()
        batch = next(it)
        t = tracer.complete("data_fetch", t)   # returns the end time: chain spans
        out = model(batch)
        t = tracer.complete("forward", t)

    Elsewhere: ``with tracer.span("after_step"):`` (buffered ``X``),
    ``with tracer.long_span("evaluate"):`` or ``begin``/``end`` (``B`` flushed at
    once, then ``X``), ``instant("resume", from_step=10)``,
    ``counter("batch", samples=16, points=35210)``.

    Records are for the training thread; another thread may call ``complete``
    with ``thread="name"`` (written as a ``"thread"`` key) but not ``begin``/``end``.
    """

    enabled = True
    now = staticmethod(perf_counter_ns)

    def __init__(
        self,
        save_path: str | Path,
        rank: int = 0,
        world_size: int = 1,
        attempt: int = 0,
        job: str | None = None,
        max_bytes: int = TRACING_DEFAULTS["max_bytes"],
        max_files: int = TRACING_DEFAULTS["max_files"],
        flush_every_s: float = TRACING_DEFAULTS["flush_every_s"],
        trace_hooks: bool = False,
        batch_stats_every: int = 1,
    ):
        self.directory = Path(save_path) / TRACE_DIR
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.attempt = int(attempt)
        self.job = None if job is None else str(job)
        self.max_bytes = int(max_bytes)
        self.max_files = int(max_files)
        self.flush_every_s = float(flush_every_s)
        self.trace_hooks = bool(trace_hooks)
        self.batch_stats_every = int(batch_stats_every)
        self.step = 0
        self.epoch = 0
        self.path: Path | None = None  # the file being written
        # perf_counter_ns is monotonic (durations never go negative when NTP
        # steps the clock); this offset turns its readings into Unix time.
        self._unix_offset_ns = time.time_ns() - perf_counter_ns()
        self._queue: deque = deque()
        self._append = self._queue.append
        self._open: list[tuple] = []  # long spans begun and not ended: (name, step, epoch, t0, args)
        self._names: dict[str, str] = {}
        # Re-entrant: close() from a signal handler that interrupted flush() must not deadlock.
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._file = None
        self._bytes = 0
        self._failed = False
        self._closed = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            existing = trace_files(self.directory, self.rank)
            self._seq = existing[-1][1] + 1 if existing else 0
            self._open_file()
        except OSError as err:
            raise ConfigError(
                f"structured_logging: cannot write trace files in {self.directory}: {err}; "
                "fix the permissions or set structured_logging.enabled=False"
            ) from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_loop, name=f"pimm-tracer-{self.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- recording --------------------------------------------------------
    def complete(self, name: str, t0: int, args: dict | None = None, thread: str | None = None) -> int:
        """Record span ``name`` from ``t0`` (a ``now()`` reading, integer ns) to now; returns now."""
        t1 = perf_counter_ns()
        self._append(("X", name, self.step, self.epoch, t0, t1 - t0, args, thread))
        return t1

    def span(self, name: str, **args) -> "_Span":
        """Context manager recording a buffered ``X`` span (``args`` optional)."""
        return _Span(self, name, args or None)

    def long_span(self, name: str, **args) -> "_LongSpan":
        """Context manager for a span that must be visible while it runs (``B`` then ``X``)."""
        return _LongSpan(self, name, args)

    def begin(self, name: str, **args) -> None:
        """Start a long span: its ``B`` record reaches the OS before this returns."""
        t0 = perf_counter_ns()
        self._open.append((name, self.step, self.epoch, t0, args or None))
        self._append(("B", name, self.step, self.epoch, t0, None, args or None, None))
        self.flush()

    def end(self, name: str, **args) -> None:
        """End the most recent open long span ``name`` (extra ``args`` are merged into
        its own); its ``X`` record reaches the OS before this returns."""
        t1 = perf_counter_ns()
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == name:
                _, step, epoch, t0, begin_args = self._open.pop(i)
                merged = {**(begin_args or {}), **args} or None
                self._append(("X", name, step, epoch, t0, t1 - t0, merged, None))
                self.flush()  # a long span's end is as visible as its start: no false "still running"
                return
        _logger.warning(f"tracer: end({name!r}) without a matching begin; ignored")

    def instant(self, name: str, **args) -> None:
        """A point event (train_start, resume, preempted, ...); flushed at once."""
        self._append(("i", name, self.step, self.epoch, perf_counter_ns(), None, args, None))
        self.flush()

    def counter(self, name: str, **values) -> None:
        """Numeric series (e.g. ``counter("batch", samples=16, points=35210)``); buffered."""
        self._append(("C", name, self.step, self.epoch, perf_counter_ns(), None, values, None))

    # -- writing ------------------------------------------------------------
    def flush(self) -> None:
        """Format and write everything queued, then hand it to the OS."""
        if os.getpid() != self._pid:
            return  # a forked child (a data-loader worker) must not write the parent's file
        with self._lock:
            if self._file is None:
                self._queue.clear()
                return
            popleft = self._queue.popleft
            records = [popleft() for _ in range(len(self._queue))]
            if not records:
                return
            text = self._format_all(records)
            try:
                self._file.write(text)
                self._file.flush()
                self._bytes += len(text)
                if self._bytes >= self.max_bytes:
                    self._file.close()
                    self._seq += 1
                    self._open_file()
            except OSError as err:
                self._fail(err)

    def close(self) -> None:
        """Stop the flusher, write what is queued and close the file. Long spans
        still open stay open in the file (they were running when tracing ended)."""
        if self._closed or os.getpid() != self._pid:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        self.flush()
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                except OSError as err:
                    self._fail(err)
                self._file = None

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_every_s):
            try:
                self.flush()
            except Exception as err:  # a bug here must neither pass silently nor stop the training
                _logger.exception("tracer: flushing failed")
                with self._lock:
                    self._fail(err)
                return

    def _open_file(self) -> None:
        while True:  # "x": never truncate a file, even one another process just made
            self.path = self.directory / f"rank{self.rank:05d}-{self._seq:04d}.jsonl"
            try:
                self._file = open(self.path, "x", encoding="utf-8", buffering=1 << 20)
                break
            except FileExistsError:
                self._seq += 1
        meta = {
            "ph": "M", "name": "process", "rank": self.rank, "pid": self._pid, "host": socket.gethostname(),
            "attempt": self.attempt, "job": self.job, "world_size": self.world_size, "ts": round(time.time(), 6),
        }
        line = json.dumps(meta, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()
        self._bytes = len(line)
        for _, _, old in trace_files(self.directory, self.rank)[: -self.max_files]:
            old.unlink(missing_ok=True)

    def _fail(self, err: Exception) -> None:
        # Tracing is an observer: losing it must not stop the training it observes.
        if not self._failed:
            _logger.warning(f"tracer: writing {self.path} failed ({err}); structured tracing stops for this rank")
        self._failed = True
        self._append = _discard  # nothing queues up any more, so nothing grows
        self._queue.clear()
        try:
            self._file.close()
        except (OSError, AttributeError):
            pass
        self._file = None

    def _format_all(self, records: list) -> str:
        """JSON lines for ``records``. Times are integers with an exponent
        (``"ts":1733000000123456e-6``, ``"dur":1372e-9``): valid JSON numbers in
        seconds, and half the cost of formatting floats."""
        names = self._names
        offset_ns = self._unix_offset_ns
        lines = []
        for ph, name, step, epoch, t0, dur, args, thread in records:
            head = names.get(name)
            if head is None:
                head = names[name] = f'"name":{json.dumps(str(name))},"rank":{self.rank},"step":'
            # The loop sets ints; a numpy or tensor scalar (or a stray None) still gives valid JSON.
            if type(step) is not int:
                step = _int_text(step)
            if type(epoch) is not int:
                epoch = _int_text(epoch)
            if type(t0) is not int:
                t0, dur = int(t0), None if dur is None else int(dur)
            start = t0 + offset_ns
            line = f'{{"ph":"{ph}",{head}{step},"epoch":{epoch},"ts":{start // 1000}e-6'
            if dur is not None:
                # Measured from the whole microsecond ``ts`` names, so that the
                # end is exact in whole microseconds too: spans floored at both
                # ends nest exactly as they ran (a few hundred ns at most added).
                line += f',"dur":{dur + start % 1000}e-9'
            if thread is not None:
                line += f',"thread":{json.dumps(str(thread))}'
            if args:
                line += f',"args":{self._dump_args(args)}'
            lines.append(line + "}\n")
        return "".join(lines)

    def _dump_args(self, args: dict) -> str:
        if all(type(v) is int and type(k) is str for k, v in args.items()):  # counters: the per-step case
            keys = self._names
            parts = []
            for k, v in args.items():
                key = keys.get(("arg", k))
                if key is None:
                    key = keys[("arg", k)] = json.dumps(k)
                parts.append(f"{key}:{v}")
            return "{" + ",".join(parts) + "}"
        try:
            return json.dumps(args, separators=(",", ":"), allow_nan=False, default=str)
        except (TypeError, ValueError):  # NaN/inf (JSON has none: null, like metrics.jsonl) or odd keys
            return json.dumps(_jsonable(args), separators=(",", ":"), default=str)


def _discard(record) -> None:
    pass


class _Span:
    __slots__ = ("tracer", "name", "args", "t0")

    def __init__(self, tracer: Tracer, name: str, args: dict | None):
        self.tracer, self.name, self.args = tracer, name, args

    def __enter__(self):
        self.t0 = perf_counter_ns()
        return self

    def __exit__(self, exc_type, exc, tb):
        args = self.args if exc_type is None else {**(self.args or {}), "error": exc_type.__name__}
        self.tracer.complete(self.name, self.t0, args)
        return False


class _LongSpan:
    __slots__ = ("tracer", "name", "args")

    def __init__(self, tracer: Tracer, name: str, args: dict):
        self.tracer, self.name, self.args = tracer, name, args

    def __enter__(self):
        self.tracer.begin(self.name, **self.args)
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.tracer.end(self.name)
        else:
            self.tracer.end(self.name, error=exc_type.__name__)
        return False


def _int_text(value) -> str:
    try:
        return str(int(value))
    except (TypeError, ValueError, OverflowError):
        return "null"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def build_tracer(
    options: dict | None,
    save_path: str | Path,
    rank: int,
    world_size: int,
    attempt: int = 0,
    job: str | None = None,
) -> Tracer | None:
    """The rank's tracer for the ``structured_logging`` options, or None when tracing is off.

    ``attempt`` counts the run's starts (0 first, +1 per resume); ``job`` is the
    scheduler's id (``SLURM_JOB_ID`` / ``TORCHELASTIC_RUN_ID``) when known."""
    merged = validate_options(options)
    if not merged["enabled"]:
        return None
    return Tracer(
        save_path, rank=rank, world_size=world_size, attempt=attempt, job=job,
        max_bytes=merged["max_bytes"], max_files=merged["max_files"], flush_every_s=merged["flush_every_s"],
        trace_hooks=merged["trace_hooks"], batch_stats_every=merged["batch_stats_every"],
    )
