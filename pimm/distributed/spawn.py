"""``--num-gpus N``: start N local worker processes, torchrun-style.

Each child re-runs the same script with ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, so the code path is
the one torchrun takes. On a CPU-only Linux machine a child is a fork of
this process that then runs the script as ``__main__`` (it skips importing
torch and pimm again: see :mod:`pimm.distributed.forked_main`); elsewhere, or
with ``PIMM_RANK_START=exec``, a fresh interpreter. The parent forwards pre-emption signals and Ctrl-C
to every child and, if one child fails, stops the others instead of leaving
them blocked in a collective. The children run in a process group of their
own, so a Ctrl-C in the terminal reaches each of them once (through the
parent), not twice (a second SIGINT means "abort now"); on Linux they are
killed when the parent dies, as they were when they shared its group. The children's stderr passes through the parent,
which prints an ``error:`` line that several ranks report only once (bad
input is usually seen by every rank alike).
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from pimm.distributed.forked_main import can_fork_ranks, fork_main
from pimm.utils.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

__all__ = ["spawn_local", "free_port"]

_FORWARDED = ("SIGTERM", "SIGHUP", "SIGINT", "SIGUSR1", "SIGUSR2")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_STOPPED = (0, EXIT_PREEMPTED, EXIT_INTERRUPTED)  # exits that are not failures


def _aggregate(codes: list[int]) -> int:
    if all(c == 0 for c in codes):
        return 0
    if all(c in _STOPPED for c in codes):  # a pre-emption outranks a Ctrl-C: a job wrapper must requeue
        return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else EXIT_INTERRUPTED
    # Killed ranks (negative codes) are victims; report the rank that failed first-hand.
    failures = [c for c in codes if c not in _STOPPED and c > 0]
    if 2 in failures:
        return 2
    return failures[0] if failures else 1


def _report_killed(rank: int, code: int, log_path: str | None) -> None:
    """A rank killed by a signal cannot say so itself: the launcher does, on
    stderr and in the run's log."""
    try:
        name = f" ({signal.Signals(-code).name})"
    except ValueError:
        name = ""
    hint = "; out of memory? (see dmesg)" if -code == getattr(signal, "SIGKILL", 9) else ""
    message = f"rank {rank} was killed by signal {-code}{name}{hint}"
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    if log_path:
        try:
            with open(log_path, "a") as fh:
                fh.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')} ERROR] [launcher] {message}\n")
        except OSError:
            pass


def spawn_local(command: list[str], nprocs: int, grace_s: float = 10.0, env: dict | None = None,
                log_path: str | None = None, abort: threading.Event | None = None,
                preload: tuple[str, ...] = ()) -> int:
    """Run ``command`` (argv, without the interpreter) in ``nprocs`` ranks with
    ``env`` added; return the aggregate exit code (0, 75 when all stopped for
    pre-emption, else the failure). A rank killed by a signal (not by this
    launcher) is reported on stderr and appended to ``log_path``. Ranks that
    are forked find the modules in ``preload`` imported (once, here). An interrupt
    of this process while ``abort`` is set (the run lock was lost) kills the
    ranks at once instead of passing a Ctrl-C on."""
    port = free_port()
    children = []
    seen_errors: set[str] = set()
    lock = threading.Lock()
    pumps = []
    fork = can_fork_ranks(command)
    if fork:
        for name in preload:
            try:
                importlib.import_module(name)
            except ImportError:  # an optional extra: the rank that needs it reports it
                pass
    for rank in range(nprocs):
        child_env = dict(os.environ, **(env or {}), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                         LOCAL_WORLD_SIZE=str(nprocs), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if fork:
            child = fork_main(command, child_env, in_child=_die_with_parent())
        else:
            child = subprocess.Popen([sys.executable, *command], env=child_env, stderr=subprocess.PIPE,
                                     process_group=0, preexec_fn=_die_with_parent())
        children.append(child)
    for child in children:  # after every fork: a preexec_fn is safe only while no thread of ours runs
        pump = threading.Thread(target=_pump_stderr, args=(child.stderr, seen_errors, lock), daemon=True)
        pump.start()
        pumps.append(pump)

    def forward(signum, frame):
        if signum == signal.SIGINT and abort is not None and abort.is_set():
            raise KeyboardInterrupt  # below: every rank is killed, nothing more is written
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {}
    for name in _FORWARDED:
        if hasattr(signal, name):
            signum = getattr(signal, name)
            previous[signum] = signal.signal(signum, forward)
    try:
        failed_at = None
        reported: set[int] = set()
        killed_by_us = False
        while True:
            codes = [child.poll() for child in children]
            for rank, code in enumerate(codes):
                if code is not None and code < 0 and rank not in reported and not killed_by_us:
                    reported.add(rank)
                    _report_killed(rank, code, log_path)
            if all(c is not None for c in codes):
                for pump in pumps:
                    pump.join(timeout=5)
                return _aggregate(codes)
            failure = any(c not in (None, *_STOPPED) for c in codes)
            if failure and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > grace_s:
                # A failed rank leaves the others waiting in a collective forever.
                killed_by_us = True
                for child in children:
                    if child.poll() is None:
                        child.kill()
            time.sleep(0.1)
    except KeyboardInterrupt:  # not Ctrl-C (forwarded above): the run lock was lost, stop every writer now
        for child in children:
            if child.poll() is None:
                child.kill()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _die_with_parent():
    """A ``preexec_fn`` that has the child killed when the parent dies (Linux's
    PR_SET_PDEATHSIG), or None elsewhere. Resolved here, in the parent: the
    child only makes the one C call between fork and exec."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_death_signal():
        prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before the call: nothing would kill us
            os._exit(1)
    return set_death_signal


def _pump_stderr(stream, seen_errors: set, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        with lock:
            if line.startswith("error: "):
                if line in seen_errors:
                    continue
                seen_errors.add(line)
            sys.stderr.write(line)
            sys.stderr.flush()
    stream.close()
