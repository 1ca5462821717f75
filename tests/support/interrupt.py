"""Ctrl-C in a terminal, for tests: a run under a pseudo-terminal, and a hook
that holds the Ctrl-C checkpoint's background write until the test pressed
Ctrl-C a second time (imported via ``custom_imports``).

:func:`run_in_pty` starts a command as the foreground process of a new
pseudo-terminal (``pty.fork``), so writing ``\\x03`` to it is exactly a
Ctrl-C: the terminal sends SIGINT to its foreground process group. It keeps
draining the terminal's output (a full terminal buffer would block the run)
and presses Ctrl-C each time a marker file appears.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

from pimm.engines import HOOKS, HookBase
from pimm.utils import comm

__all__ = ["HoldInterruptSave", "run_in_pty"]


class _HeldPickle:
    """Pickled by the checkpoint's background writer: announces itself with
    ``directory/writing-rank<R>`` and holds the write until ``released`` (the
    checkpoint manager's abort event) is set, or ``timeout_s`` passed."""

    def __init__(self, directory: str, rank: int, released, timeout_s: float):
        self.directory, self.rank, self.released, self.timeout_s = directory, rank, released, timeout_s

    def __deepcopy__(self, memo):
        return self  # the snapshot copies states on the training thread; the hold belongs to the writer

    def __reduce__(self):
        directory = Path(self.directory)
        (directory / f"writing-rank{self.rank}").write_text("")
        self.released.wait(self.timeout_s)
        return (dict, ())


@HOOKS.register_module(force=True)
class HoldInterruptSave(HookBase):
    """Once the run was interrupted (the first Ctrl-C), its checkpoint's write is
    held in its first file until the save is abandoned (a second Ctrl-C), so
    the abort always meets a write in flight (see :class:`_HeldPickle`)."""

    def __init__(self, directory=".", timeout_s=120.0):
        self.directory, self.timeout_s = str(directory), float(timeout_s)

    def state_dict(self) -> dict:
        if not self.trainer.control.interrupted:
            return {}
        released = self.trainer.checkpointer._abort
        return {"held": _HeldPickle(self.directory, comm.get_rank(), released, self.timeout_s)}

    def load_state_dict(self, state: dict) -> None:
        pass


def run_in_pty(argv: list[str], env: dict, cwd: Path, presses: list[Path],
               limit_s: float = 240.0) -> tuple[int, str]:
    """Run ``argv`` in a new pseudo-terminal; for each marker file of ``presses``
    in turn, press Ctrl-C once it exists. Returns the exit code (negative:
    killed by that signal) and everything the terminal showed."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the terminal's session leader and foreground group
        try:
            os.chdir(cwd)
            os.execve(argv[0], argv, env)
        finally:
            os._exit(127)
    output = bytearray()
    pending = list(presses)
    deadline = time.monotonic() + limit_s
    status = None
    try:
        while status is None:
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                raise AssertionError(f"{' '.join(argv)} did not end within {limit_s:.0f}s:\n"
                                     + output.decode(errors="replace")[-3000:])
            ready, _, _ = select.select([fd], [], [], 0.05)
            if ready:
                try:
                    output += os.read(fd, 65536)
                except OSError:  # EIO: the terminal's last process closed it
                    pass
            if pending and pending[0].exists():
                pending.pop(0)
                os.write(fd, b"\x03")
            done, code = os.waitpid(pid, os.WNOHANG)
            if done:
                status = code
        while True:  # what the run printed last
            ready, _, _ = select.select([fd], [], [], 0.05)
            if not ready:
                break
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
    finally:
        os.close(fd)
        try:
            os.killpg(pid, signal.SIGKILL)  # data workers or ranks never outlive the test
        except (ProcessLookupError, PermissionError):
            pass
    code = os.waitstatus_to_exitcode(status)
    if pending:
        raise AssertionError(f"the run ended ({code}) before marker {pending[0]} appeared:\n"
                             + output.decode(errors="replace")[-3000:])
    return code, output.decode(errors="replace")


if __name__ == "__main__":  # pragma: no cover
    sys.exit("a test helper; see tests/test_interrupt.py")
