"""How a :class:`~pimm.utils.run_lock.RunLock` is taken: ``flock`` on the lock
file where the file system supports it, else an exclusively created file whose
holder is judged alive or stale from its record. A mixin of ``RunLock``, which
owns the record (``_read_record``, ``_take_over``, ``_busy_message``).
"""

from __future__ import annotations

import errno
import os
import socket
import time

from pimm.utils.lock_holders import _NO_FLOCK, RunLockError, _boot_id, _pid_alive, _process_start

try:
    import fcntl
except ImportError:  # not on POSIX: only the exclusive-file mode exists
    fcntl = None

__all__ = ["LockAcquisition"]


class LockAcquisition:
    """The two ways of taking the lock file (see the module docstring)."""

    # -- flock -------------------------------------------------------------
    def _acquire_flock(self) -> bool:
        """True when held; False when flock is unsupported here; raises when busy."""
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as err:
                raise RunLockError(f"cannot create {self.path}: {err.strerror or err}; choose a writable "
                                   "save_path") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in _NO_FLOCK:
                    return False
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self._read_record()
                    raise RunLockError(self._busy_message(holder), holder) from None
                raise RunLockError(f"cannot lock {self.path}: {err.strerror or err}") from None
            # The previous holder may have deleted the file between our open
            # and our flock: then we locked a file nobody else will see.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = self._read_fd(fd)
            if previous and previous.get("host") != socket.gethostname() and self._fresh(fd):
                # Another host's run may hold it where flock is not shared between hosts.
                os.close(fd)
                raise RunLockError(self._busy_message(previous, remote=True), previous)
            self._fd = fd
            if previous:
                self._take_over(previous)
            return True

    # -- exclusive file ----------------------------------------------------
    def _acquire_exclusive(self) -> None:
        for _ in range(100):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = self._read_record()
                if self._holder_alive(holder):
                    raise RunLockError(self._busy_message(holder, remote=self._remote(holder)), holder) from None
                # Stale: remove it only if it is still the file we judged.
                if holder is not None and self._read_record() == holder:
                    try:
                        self.path.unlink()
                    except FileNotFoundError:
                        pass
                    self._take_over(holder)
                elif holder is None:
                    time.sleep(0.05)  # being written right now
                continue
            except OSError as err:
                raise RunLockError(f"cannot create {self.path}: {err.strerror or err}") from None
            self._fd = fd
            return
        raise RunLockError(f"cannot take {self.path}: it keeps changing; is another run starting on it?")

    def _holder_alive(self, holder: dict | None) -> bool:
        if holder is None:  # created but not yet written: a live run is starting
            try:
                return time.time() - self.path.stat().st_mtime < self.stale_after_s
            except FileNotFoundError:
                return False
        if self._remote(holder):
            try:
                return time.time() - self.path.stat().st_mtime < self.stale_after_s
            except FileNotFoundError:
                return False
        if holder.get("boot_id") and holder.get("boot_id") != _boot_id():
            return False  # this host rebooted since
        pid = holder.get("pid")
        if not isinstance(pid, int) or not _pid_alive(pid):
            return False
        started = holder.get("pid_start")
        return started is None or _process_start(pid) in (None, started)
