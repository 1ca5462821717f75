"""Command-line tools that read a finished (or running, or killed) run's files:
``pimm trace summarize|export`` (:mod:`pimm.tools.trace_report`) and ``pimm
plot`` (:mod:`pimm.tools.plot`).

They sit above the engine in the layering but import none of it (nor torch):
``pimm trace`` and ``pimm plot`` must start in a fraction of a second and work
on a machine that only holds the run directory.
"""

from __future__ import annotations

import argparse

from pimm.utils.errors import UserError

__all__ = ["ToolParser"]


class ToolParser(argparse.ArgumentParser):
    """argparse with the project's bad-usage contract: one ``error:`` line
    (raised as UserError, which the ``pimm`` command turns into exit 2)."""

    def error(self, message):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")
