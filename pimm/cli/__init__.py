"""Every command pimm ships: the ``pimm`` command and the entry points of
``tools/train.py`` / ``tools/test.py`` (this package is their one home; the
former ``pimm.tools`` modules live here and their old paths still import).

``pimm <command> [args]`` dispatches to:

* ``train`` / ``test``: exactly ``tools/train.py`` / ``tools/test.py``
  (:func:`train_main` / :func:`test_main`, also the ``pimm-train`` /
  ``pimm-test`` console scripts);
* ``trace summarize|export RUN``: :mod:`pimm.cli.trace_report`;
* ``plot RUN...``: :mod:`pimm.cli.plot`;
* ``submit``: :mod:`pimm.cli.submit` (SLURM);
* ``export RUN_DIR OUT``: :mod:`pimm.cli.export` (a model for ``pimm.from_pretrained``).
* ``torchrun``: :mod:`pimm.distributed.torchrun` (torchrun with pimm's exit codes: 75 when pre-empted).
* ``launch`` / ``ls`` / ``watchdog``: upstream pimm's commands (:mod:`pimm.cli.launch`,
  :mod:`pimm.cli.ls`, :mod:`pimm.cli.watchdog`); ``submit`` also takes upstream's flags.

Nothing heavy is imported at module level: torch, the models and data sets
load only for ``train`` / ``test`` (:func:`register_all`), matplotlib only
for ``plot``, so ``pimm trace`` and ``pimm --help`` start in a blink.
``import pimm.cli`` therefore no longer registers the models, data sets and
evaluators as a side effect; call :func:`register_all` (or import those
packages) for that.
"""

from __future__ import annotations

import difflib
import os
import sys
import traceback

from pimm.cli.register import register_all  # the public name stays pimm.cli.register_all
# What ``pimm.tools`` (now an alias of this package) exported.
from pimm.cli.tool_args import ToolParser, output_path, writing

__all__ = ["main", "train_main", "test_main", "register_all", "ToolParser", "output_path", "writing"]

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # as pimm.utils.errors (not imported here: `pimm --help` stays light)


def _interrupted(line: str = "interrupted during start-up (nothing was written)") -> int:
    """Ctrl-C while torch, the models and data sets are imported (the first
    seconds of a command) or while a command without its own Ctrl-C handling
    runs: one line and exit 130, not the traceback of wherever it landed."""
    if os.environ.get("PIMM_DEBUG") == "1":
        traceback.print_exc()
    print(f"error: {line}", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def _launch(argv: list[str] | None, mode: str) -> int:
    # Idle OpenMP threads sleep instead of spinning (see tools/train.py); must
    # be set before torch is imported, and an explicit setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        register_all()
        from pimm.engines.run.launch import main as launch_main
    except KeyboardInterrupt:  # the launcher reports an interruption from here on itself
        return _interrupted()
    return launch_main(sys.argv[1:] if argv is None else argv, mode=mode)


def train_main(argv: list[str] | None = None) -> int:
    """``tools/train.py``: train from ``--config-file`` (see ``--help``)."""
    return _launch(argv, "train")


def test_main(argv: list[str] | None = None) -> int:
    """``tools/test.py``: evaluate ``--options weight=...`` on the test split."""
    return _launch(argv, "test")


def _as_verb(argv: list[str], mode: str) -> int:
    """``pimm train|test``. ``--num-gpus N`` re-runs ``sys.argv[0]`` with the
    same arguments in N child processes; for the ``pimm`` script that would
    lose the verb, so while the launcher runs, ``sys.argv[0]`` names the
    module that is this verb alone (``python -mpimm.cli.train ...``)."""
    if any(a in ("-h", "--help") for a in argv):
        print(f"pimm {mode}: the same arguments as tools/{mode}.py\n")
    previous = sys.argv[0] if sys.argv else ""
    if sys.argv:
        sys.argv[0] = f"-mpimm.cli.{mode}"
    try:
        return train_main(argv) if mode == "train" else test_main(argv)
    finally:
        if sys.argv:
            sys.argv[0] = previous


def _trace(argv: list[str]) -> int:
    from pimm.cli import trace_report

    return trace_report.main(argv, prog="pimm trace")


def _plot(argv: list[str]) -> int:
    from pimm.cli import plot

    return plot.main(argv, prog="pimm plot")


def _export(argv: list[str]) -> int:
    from pimm.cli import export

    return export.main(argv)


def _submit(argv: list[str]) -> int:
    from pimm.cli import submit, submit_upstream

    # upstream's flags (--site, --train.config, ...) or pimm's own form (--config-file ...)
    return (submit_upstream.main if submit_upstream.is_upstream_form(argv) else submit.main)(argv)


def _torchrun(argv: list[str]) -> int:
    from pimm.distributed import torchrun

    return torchrun.main(argv)


def _launch_verb(argv: list[str]) -> int:
    from pimm.cli import launch

    return launch.main(argv)


def _ls(argv: list[str]) -> int:
    from pimm.cli import ls

    return ls.main(argv)


def _watchdog(argv: list[str]) -> int:
    from pimm.cli import watchdog

    return watchdog.main(argv)


COMMANDS = {
    "launch": ("run training here by config name, upstream's way (--train.config NAME ... -- key=value)",
               _launch_verb),
    "ls": ("list the training configs under configs/ (or a folder of it) by name", _ls),
    "train": ("train a model (the arguments of tools/train.py)", lambda argv: _as_verb(argv, "train")),
    "test": ("evaluate weights on the test split (the arguments of tools/test.py)", lambda argv: _as_verb(argv, "test")),
    "trace": ("summarize a run's structured trace, or export it for a trace viewer", _trace),
    "plot": ("draw curves from the metrics.jsonl of one or more runs", _plot),
    "submit": ("submit a training run to SLURM", _submit),
    "watchdog": ("list (ls) or remove (rm NAME) the scron supervisors of chained interactive runs", _watchdog),
    "export": ("write a run's model as a portable folder for pimm.from_pretrained", _export),
    "torchrun": ("torchrun (its arguments) that exits 75 when pre-empted and 130 on Ctrl-C", _torchrun),
}
# train/test report their own errors (pimm.engines.run.launch)
_OWN_ERRORS = ("trace", "plot", "submit", "export", "launch", "ls", "watchdog")


def usage() -> str:
    lines = ["usage: pimm <command> [arguments]", "", "commands:"]
    width = max(map(len, COMMANDS)) + 2  # a name as long as the column still leaves a gap before its text
    lines += [f"  {name:<{width}}{text}" for name, (text, _) in COMMANDS.items()]
    lines += ["", "`pimm <command> --help` describes a command's arguments, e.g. `pimm trace --help`."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """The ``pimm`` console command; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        sys.stderr.write(usage())
        return EXIT_USAGE
    command, rest = argv[0], argv[1:]
    if command in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        return 0
    if command in ("-V", "--version"):
        from pimm import __version__

        print(f"pimm {__version__}")
        return 0
    if command not in COMMANDS:
        near = difflib.get_close_matches(command, COMMANDS, n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        print(f"error: unknown command '{command}'{hint} (commands: {', '.join(COMMANDS)}; see pimm --help)",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        return _dispatch(command, rest)
    except KeyboardInterrupt:  # train/test report their own once started; the others have no Ctrl-C handling
        return _interrupted(f"pimm {command} interrupted (Ctrl-C)")


def _dispatch(command: str, rest: list[str]) -> int:
    handler = COMMANDS[command][1]
    if command not in _OWN_ERRORS:
        return handler(rest)
    from pimm.utils.errors import UserError

    try:
        return handler(rest)
    except UserError as err:
        if os.environ.get("PIMM_DEBUG") == "1":
            traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # `pimm trace summarize RUN | head`
        sys.stderr.close()
        return 0
