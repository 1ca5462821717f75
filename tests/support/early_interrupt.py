"""Ctrl-C while a command is still importing, at a moment the test chooses.

``python -m tests.support.early_interrupt MODULE MARKER -- (SCRIPT | -m MOD) ARGS...``
runs the command as ``__main__`` (as ``python SCRIPT`` or ``python -m MOD``
would) in this interpreter, with an import hook in front: when the command
first imports ``MODULE``, the hook creates ``MARKER`` and waits there (up to
two minutes). A test that sends SIGINT once ``MARKER`` exists therefore
interrupts the command exactly inside that import, as a Ctrl-C in the first
seconds of a real command does, whatever the machine's speed.

SIGINT gets Python's default handler first: a process started in the
background by a non-interactive shell inherits SIGINT ignored.
"""

from __future__ import annotations

import importlib.abc
import runpy
import signal
import sys
import time
from pathlib import Path


class _PauseAt(importlib.abc.MetaPathFinder):
    def __init__(self, module: str, marker: Path):
        self.module, self.marker = module, marker

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.module and not self.marker.exists():
            self.marker.write_text(fullname)
            deadline = time.monotonic() + 120.0
            while time.monotonic() < deadline:  # the test's SIGINT ends this wait as a KeyboardInterrupt
                time.sleep(0.05)
        return None  # the import itself goes on as usual


def main(argv: list[str]) -> None:
    module, marker, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m tests.support.early_interrupt MODULE MARKER -- (SCRIPT | -m MOD) ARGS...")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.meta_path.insert(0, _PauseAt(module, Path(marker)))
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(command)
        sys.path.insert(0, str(Path(command[0]).resolve().parent))
        runpy.run_path(command[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
