"""Who holds a run lock and whether it still lives: the lock errors, and the
process identity a lock record carries (host boot id, pid and the pid's start
time, so a reused pid is not mistaken for the holder). Used by
:mod:`pimm.utils.run_lock`.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from pimm.utils.errors import UserError


# flock errors that mean "not supported here", not "someone holds it".
_NO_FLOCK = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK, errno.EINVAL}


class RunLockError(UserError):
    """The run directory is in use by another run, or cannot be locked."""

    def __init__(self, message: str, holder: dict | None = None):
        super().__init__(message)
        self.holder = holder


class RunLockLost(RunLockError):
    """This run's lock was taken by another run: it must stop writing."""

def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a
    live holder from an unrelated process that reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]  # field 22, counted after "pid (comm)"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _describe(holder: dict | None) -> str:
    if not holder:
        return "a process that has not written its record yet"
    started = holder.get("started", "?")
    command = holder.get("command")
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started {started}"
            + (f": {command}" if command else ""))
