"""What a run says when it ends: the commands that continue, evaluate and plot
it, and the end-of-run summary (:func:`end_of_run_summary`).

The commands are spelled the way this process was started: ``python
tools/train.py`` when it was, ``pimm train`` otherwise (the console script
and ``python -m pimm.cli.train`` alike); a run under torchrun is continued by
rerunning the same torchrun command with ``resume=True``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

__all__ = ["resume_command", "test_command", "plot_command", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process is a torchrun worker (``--num-gpus`` ranks are not)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _tool(verb: str) -> str:
    """``python tools/<verb>.py`` when this process was started from tools/, else ``pimm <verb>``."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if argv0 is not None and argv0.parent.name == "tools" and argv0.suffix == ".py":
        return f"python {shlex.quote(str(argv0.with_name(f'{verb}.py')))}"
    return f"pimm {verb}"


def resume_command(save_path: str | Path, world_size: int = 1) -> str:
    """The command that continues the run in ``save_path`` exactly (same world size)."""
    if under_torchrun():
        return "the same torchrun command with --options resume=True"
    gpus = f" --num-gpus {world_size}" if world_size > 1 else ""
    return f"{_tool('train')} --resume {shlex.quote(str(save_path))}{gpus}"


def test_command(save_path: str | Path) -> str:
    """The command that evaluates the run's best checkpoint on its test split."""
    return f"pimm test {shlex.quote(str(save_path))}"


def plot_command(save_path: str | Path) -> str:
    """The command that draws the run's curves."""
    return f"pimm plot {shlex.quote(str(save_path))}"
