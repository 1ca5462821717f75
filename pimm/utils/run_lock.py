"""One run at a time per ``save_path``: an exclusive lock on the run directory.

A run holds ``save_path/.lock`` from start to end. A second run on the same
directory stops with :class:`RunLockError` (exit 2) naming the holder: host,
pid, start time and command, read from the JSON record the holder writes
into the lock file.

Only one process of a run takes the lock: the launcher that starts the
ranks (``--num-gpus N``), or rank 0 under torchrun. The other ranks of the
same run do not take it; they are covered by the holder, which lives as long
as they do.

How the lock is held
--------------------
*flock* (the default wherever the file system supports it): the holder keeps
an ``fcntl.flock`` on the lock file. The kernel drops it when the process
dies, however it dies (``kill -9`` included), so on a local file system a
lock can never outlive its run. A run that finds the lock free but a record
left in the file (its holder died without releasing) takes it over and says
so. ``fcntl.flock`` is used rather than a library such as ``filelock``
because the cross-host rules below need the holder record and the
heartbeat, which such libraries do not keep.

*exclusive file* (fallback where ``flock`` is not supported, e.g. Lustre
mounted without ``flock``): the lock file is created with ``O_EXCL``; it
exists while the run holds it. A leftover file whose holder is on this host
and no longer running (checked by pid, process start time and boot id) is
taken over.

Across hosts (shared file systems)
----------------------------------
``flock`` on NFS is forwarded to the server and excludes other hosts when
the mount has locking (the default); on mounts with local-only locks
(NFS ``nolock``, Lustre ``localflock``) it does not, and in the fallback mode
no host can check another's processes. So the holder also *heartbeats*: a
background thread touches the lock file every ``heartbeat_s`` seconds. A
record from another host is trusted as long as its heartbeat is younger than
``stale_after_s``: the new run stops and says how to proceed (wait, or
delete the file if that run is known to be gone). A record whose heartbeat
is older is taken over, with a message.

A lock that holds while the run lasts
-----------------------------------
Beside the lock file, the holder keeps an ``flock`` on the run directory
itself (where the file system supports it). Deleting ``.lock`` by hand
cannot free that one: a second run started meanwhile is refused all the
same, and the holder's next heartbeat writes its ``.lock`` back.

The holder re-checks its record (the token in the file, not only that a
file exists) at every heartbeat and, through :func:`check_held`, before
every checkpoint commit. A lock found taken by another run (possible only
where the directory cannot be flocked: the exclusive-file mode, other
hosts) is *lost*: :func:`check_held` raises :class:`RunLockLost`, the
heartbeat calls ``on_lost``, and the run stops writing at once (exit 2):
never two writers in one directory.

A clean ``release()`` (also at normal interpreter exit) deletes the lock
file, so a finished run leaves only its results behind.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import secrets
import shlex
import socket
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from pimm.utils.lock_acquire import LockAcquisition
from pimm.utils.lock_holders import RunLockError, RunLockLost, _boot_id, _describe, _process_start

try:
    import fcntl
except ImportError:  # not on POSIX: only the exclusive-file mode exists
    fcntl = None

__all__ = ["RunLock", "RunLockError", "RunLockLost", "LOCK_NAME", "check_held"]

LOCK_NAME = ".lock"

_HELD: "weakref.WeakSet[RunLock]" = weakref.WeakSet()


def check_held(path: str | os.PathLike) -> None:
    """Raise :class:`RunLockLost` when a lock this process holds on ``path``
    or a folder above it (the run directory) is no longer its own. Called
    before a checkpoint is committed; a no-op in processes that hold no lock
    (the other ranks of a run, whose holder checks for them)."""
    target = Path(path).resolve()
    for lock in list(_HELD):
        directory = lock.directory.resolve()
        if target == directory or directory in target.parents:
            lock.check()


def _forget_in_child() -> None:
    # A forked child (a data-loader worker) shares the holder's open file and
    # so its flock: close the child's copy, so that a child outliving a killed
    # holder cannot keep the lock, and never release (delete) it from there.
    for lock in list(_HELD):
        lock._disown()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


class RunLock(LockAcquisition):
    """``with RunLock(save_path): ...`` or ``acquire()`` / ``release()``.

    ``mode``: "auto" (flock, else the exclusive file), "flock" or "exclusive".
    ``warn`` receives the one-line message when a stale lock is taken over
    (default: printed to stderr); it is also kept in ``took_over``.
    ``on_lost`` is called with the reason, once, when the heartbeat finds the
    lock taken by another run (see "A lock that holds" above).
    """

    def __init__(self, save_path: str | os.PathLike, *, mode: str = "auto", command: str | None = None,
                 heartbeat_s: float = 30.0, stale_after_s: float = 300.0,
                 warn: Callable[[str], None] | None = None, on_lost: Callable[[str], None] | None = None):
        if mode not in ("auto", "flock", "exclusive"):
            raise ValueError(f"RunLock mode must be 'auto', 'flock' or 'exclusive', got {mode!r}")
        self.directory = Path(save_path)
        self.path = self.directory / LOCK_NAME
        self.mode = mode
        self.command = command if command is not None else " ".join(shlex.quote(a) for a in sys.argv)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s
        self.warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr, flush=True))
        self.on_lost = on_lost  # called (from the heartbeat thread) once when the lock is found taken
        self.lost: str | None = None  # why the lock was lost, once it was
        self._dir_fd: int | None = None
        self.took_over: str | None = None
        self.used_mode: str | None = None  # "flock" or "exclusive" once held
        self._fd: int | None = None
        self._record: dict | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- public ------------------------------------------------------------
    @property
    def held(self) -> bool:
        return self._record is not None

    def acquire(self) -> "RunLock":
        """Take the lock or raise :class:`RunLockError` naming the holder."""
        if self.held:
            return self
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunLockError(f"cannot create the run directory {self.directory}: {err.strerror or err}") from None
        if self.path.is_dir() or (self.path.exists() and not self.path.is_file()):
            raise RunLockError(f"cannot lock {self.directory}: {self.path} is not a regular file (a "
                               f"{'directory' if self.path.is_dir() else 'special file'}); remove it and rerun")
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise RunLockError(f"save_path {self.directory} is not writable; choose a writable save_path")
        try:
            if self.mode != "exclusive" and fcntl is not None:
                self._lock_directory()
                if self._acquire_flock():
                    return self._started("flock")
                if self.mode == "flock":
                    raise RunLockError(f"file locks (flock) are not supported on the file system of "
                                       f"{self.directory}; use RunLock(mode='exclusive')")
            self._acquire_exclusive()
            return self._started("exclusive")
        except BaseException:
            self._unlock_directory()
            if self._fd is not None and self._record is None:
                os.close(self._fd)
                self._fd = None
            raise

    def release(self) -> None:
        """Give the lock up and delete the lock file (a no-op when not held)."""
        if not self.held:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._owns_file():
            try:
                self.path.unlink()
            except OSError:
                pass
        if self._fd is not None:
            os.close(self._fd)  # drops the flock
            self._fd = None
        self._unlock_directory()
        self._record = None
        _HELD.discard(self)
        atexit.unregister(self.release)

    def _disown(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
        self._record = None
        self._thread = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    # -- the directory lock ------------------------------------------------
    def _lock_directory(self) -> None:
        """flock the run directory (refused while another run holds it, even
        with its lock file deleted); silently skipped where unsupported."""
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                holder = self._read_record()
                if holder is None:
                    raise RunLockError(f"save_path {self.directory} is in use by another run (its {LOCK_NAME} was "
                                       "deleted, but the run still holds the directory); wait for it to end, stop "
                                       "it, or choose another save_path") from None
                raise RunLockError(self._busy_message(holder), holder) from None
            return  # not supported here (e.g. NFS): the lock file alone excludes
        self._dir_fd = fd

    def _unlock_directory(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    # -- re-checking the record ----------------------------------------------
    def check(self) -> None:
        """Raise :class:`RunLockLost` when the lock file now holds another
        run's record; a deleted lock file is written back (this run still
        holds it). A no-op when not held."""
        if not self.held:
            return
        if self.lost is None:
            self.lost = self._verify()
        if self.lost is not None:
            raise RunLockLost(self.lost)

    def _verify(self) -> str | None:
        """None while the lock is this run's; else why it is not."""
        token = self._record["token"]
        current = self._read_record()
        if current is not None and current.get("token") == token:
            if self.used_mode == "flock":
                try:
                    if os.stat(self.path).st_ino != os.fstat(self._fd).st_ino:
                        return f"{self.path} was replaced by another file while this run held it"
                except OSError:
                    pass
            return None
        if current is not None:
            return (f"the lock of save_path {self.directory} was taken by another run ({_describe(current)}) while "
                    "this one held it; this run stops writing to leave the directory to one writer")
        if not self.path.exists():
            return self._rewrite()
        return None  # an empty record: being written (a starting run would not get past the directory lock)

    def _rewrite(self) -> str | None:
        """Write the deleted lock file back; None on success, else why not."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            current = self._read_record()
            if current is None or current.get("token") == self._record["token"]:
                return None
            return (f"the lock of save_path {self.directory} was taken by another run ({_describe(current)}) "
                    "while this one held it; this run stops writing to leave the directory to one writer")
        except OSError:
            return None  # cannot write it back now (a full or read-only disk): retry at the next heartbeat
        if self.used_mode == "flock" and fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                pass
        os.pwrite(fd, (json.dumps(self._record) + "\n").encode(), 0)
        old, self._fd = self._fd, fd
        if old is not None:
            os.close(old)
        self.warn(f"{self.path} was deleted while this run held it; written back (delete a lock only when its run "
                  "is gone)")
        return None

    # -- shared ------------------------------------------------------------
    def _started(self, mode: str) -> "RunLock":
        self.used_mode = mode
        self._record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "started_unix": time.time(),
            "command": self.command,
            "mode": mode,
            "boot_id": _boot_id(),
            "pid_start": _process_start(os.getpid()),
            "token": secrets.token_hex(8),
        }
        data = (json.dumps(self._record) + "\n").encode()
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, data, 0)
            os.fsync(self._fd)
        except OSError as err:
            self._record = None
            raise RunLockError(f"cannot write {self.path}: {err.strerror or err}") from None
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="pimm-run-lock", daemon=True)
        self._thread.start()
        _HELD.add(self)
        atexit.register(self.release)
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # a transient file-system error must not kill the run (a deleted file is rewritten below)
            if self._record is not None:
                try:
                    self.lost = self.lost or self._verify()  # also when a commit's check found it first
                except Exception:  # the heartbeat must never die on a check
                    continue
                if self.lost is not None:
                    if self.on_lost is not None:
                        self.on_lost(self.lost)
                    return

    def _take_over(self, previous: dict) -> None:
        where = "this host" if not self._remote(previous) else f"host {previous.get('host', '?')}"
        self.took_over = (f"taking over the lock of {self.directory} left by pid {previous.get('pid', '?')} on "
                          f"{where} (started {previous.get('started', '?')}), which is no longer running")
        self.warn(self.took_over)

    def _busy_message(self, holder: dict | None, remote: bool = False) -> str:
        message = f"save_path {self.directory} is in use by another run ({_describe(holder)})"
        if remote:
            message += (f"; its host last touched the lock {self._age():.0f}s ago. Wait for it to end, or, if that "
                        f"run is gone, delete {self.path} (it is taken over by itself after "
                        f"{self.stale_after_s:.0f}s without a heartbeat)")
        else:
            message += "; wait for it to end, stop it, or choose another save_path"
        return message

    def _age(self) -> float:
        try:
            return max(0.0, time.time() - self.path.stat().st_mtime)
        except FileNotFoundError:
            return float("inf")

    def _fresh(self, fd: int) -> bool:
        return time.time() - os.fstat(fd).st_mtime < self.stale_after_s

    @staticmethod
    def _remote(holder: dict | None) -> bool:
        return bool(holder) and holder.get("host") != socket.gethostname()

    def _read_record(self) -> dict | None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return self._read_fd(fd)
        finally:
            os.close(fd)

    @staticmethod
    def _read_fd(fd: int) -> dict | None:
        try:
            data = os.pread(fd, 65536, 0)
            record = json.loads(data.decode()) if data.strip() else None
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _owns_file(self) -> bool:
        current = self._read_record()
        return bool(current) and current.get("token") == (self._record or {}).get("token")
