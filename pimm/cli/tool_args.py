"""What every run-reading command shares: the argument parser with the
one-line usage error (:class:`ToolParser`) and where a command writes
(:func:`output_path`, :func:`writing`).

The run-reading commands (``pimm trace``, ``pimm plot``) sit above the engine
in the layering but import none of it (nor torch): they must start in a
fraction of a second and work on a machine that only holds the run directory.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from pimm.utils.errors import UserError

__all__ = ["ToolParser", "output_path", "writing"]


class ToolParser(argparse.ArgumentParser):
    """argparse with the project's bad-usage contract: one ``error:`` line
    (raised as UserError, which the ``pimm`` command turns into exit 2)."""

    def error(self, message):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")


def output_path(default: Path, out: str | Path | None, overwrite: bool) -> Path:
    """Where a tool writes. ``default`` (inside the run, derived from its files)
    is ours and may be rewritten; a file the user names with ``-o`` may be
    theirs, so an existing one is replaced only with ``--overwrite``."""
    if out is None:
        return Path(default)
    path = Path(out)
    if path.exists() and not overwrite:
        raise UserError(f"-o {out}: the file exists; choose another path or add --overwrite")
    return path


@contextlib.contextmanager
def writing(path: Path):
    """Create ``path``'s folder; an OSError inside becomes a one-line UserError."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
    except OSError as err:
        raise UserError(f"cannot write {path}: {err.strerror or err}") from None
