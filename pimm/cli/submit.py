"""``pimm submit``: train on a SLURM cluster, requeued on pre-emption and time-out.

``pimm submit --config-file CFG --nodes N --gpus-per-node G --time HH:MM:SS
[...] [--dry-run] [--options k=v ...]`` (also ``python -m
pimm.cli.submit ...``) validates everything it can on the login node
(options, time format, the config with its ``--options`` at the job's world
size, and the save_path rule of ``tools/train.py``: an existing run needs
``resume=True``), then submits through submitit one task per node that runs
torchrun (:class:`pimm.distributed.slurm_task.NodeTask`, whose docstring
explains the rendezvous, the signal path and the requeue).

The sbatch script asks for ``--signal=USR2@S`` (submitit's warning signal;
``SUBMITIT_PREEMPT_SIGNAL`` changes it) and ``--requeue``; the ranks get
``preempt_signals`` extended with that signal and SIGTERM, an absolute
``save_path``, and on a requeued attempt ``resume=True``. Submitit's files
(script, pickled task, per-task logs) and ``submissions.jsonl`` (one line per
submission, attempt start and requeue) live in ``save_path/slurm/``.

Exit codes: 0 submitted (or printed with ``--dry-run``); 2 bad input (one
``error:`` line); 1 the submission itself failed.

A command line without ``--config-file`` is upstream pimm's form (``--site``,
``--train.config NAME``, ``--resources.*``, ``--chain.jobs``,
``--interactive``, the ``--`` tail): :mod:`pimm.cli.submit_upstream`, which
plans its batch jobs through :func:`plan` here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from pimm.distributed.slurm_task import _PORT_BASE, _PORT_SPAN, NodeTask, append_record, torchrun_command
from pimm.cli.register import register_all
from pimm.utils.errors import UserError

__all__ = ["main", "parse_time", "plan", "guarded"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2
ROOT = Path(__file__).resolve().parents[2]
TRAIN_SCRIPT = ROOT / "tools" / "train.py"

# sbatch options this command sets itself, and the flag to use instead.
_OWN_OPTIONS = {
    "nodes": "--nodes", "ntasks-per-node": "one task per node is fixed", "ntasks": "one task per node is fixed",
    "gpus-per-node": "--gpus-per-node", "cpus-per-task": "--cpus-per-task", "mem": "--mem", "time": "--time",
    "partition": "--partition", "account": "--account", "qos": "--qos", "job-name": "--job-name",
    "signal": "--signal-seconds", "requeue": "always set", "no-requeue": "requeue is how runs continue",
    "output": "logs go to save_path/slurm", "error": "logs go to save_path/slurm",
    "open-mode": "logs are appended across requeues", "array": "one run per submission",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")


def _parser() -> _Parser:
    p = _Parser(prog="pimm submit", description="Submit a pimm training run to SLURM (through submitit).",
                allow_abbrev=False)
    p.add_argument("--config-file", required=True, metavar="CFG", help="Python config file")
    p.add_argument("--nodes", type=int, default=1, metavar="N")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G", help="one rank per GPU (0: CPU ranks)")
    p.add_argument("--procs-per-node", type=int, default=None, metavar="P",
                   help="ranks per node when no GPUs are asked for (default 1)")
    p.add_argument("--cpus-per-task", type=int, default=None, metavar="C",
                   help="CPUs for each node's task (default: ranks per node x (1 + data workers per rank))")
    p.add_argument("--mem", default=None, metavar="M", help="memory per node, SLURM syntax (e.g. 64G)")
    p.add_argument("--time", required=True, metavar="HH:MM:SS", help="time limit of each attempt ([D-]HH:MM:SS)")
    p.add_argument("--partition", default=None, metavar="P")
    p.add_argument("--account", default=None, metavar="A")
    p.add_argument("--qos", default=None, metavar="Q")
    p.add_argument("--job-name", default=None, metavar="NAME", help="default: pimm-<save_path folder name>")
    p.add_argument("--max-requeues", type=int, default=3, metavar="K",
                   help="requeue after a pre-emption or time-out warning at most K times")
    p.add_argument("--signal-seconds", type=int, default=120, metavar="S",
                   help="warning signal S seconds before the time limit (sbatch --signal)")
    p.add_argument("--slurm-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, e.g. constraint=a100 or exclusive")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and torchrun command only")
    p.add_argument("--options", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                   help="config overrides, as for tools/train.py")
    return p


def parse_time(text: str) -> int:
    """``[D-]HH:MM:SS`` -> seconds (UserError on anything else)."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+):([0-5]\d):([0-5]\d)", text.strip())
    if not match:
        raise UserError(f"--time {text!r} is invalid: use HH:MM:SS or D-HH:MM:SS, e.g. --time 04:00:00")
    days, hours, minutes, seconds = (int(g or 0) for g in match.groups())
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    if total <= 0:
        raise UserError(f"--time {text!r} is invalid: the time limit must be positive")
    return total


def _at_least(value: int | None, low: int, flag: str) -> None:
    if value is not None and value < low:
        raise UserError(f"{flag} {value} is invalid: give {low} or more")


def _plain_word(value: str | None, flag: str) -> None:
    if value is not None and (not value or re.search(r"[\s'\"\\$`]", value)):
        raise UserError(f"{flag} {value!r} is invalid: give a single word without spaces or quotes")


def _slurm_options(tokens: list[str]) -> dict:
    extra = {}
    for token in tokens:
        key, sep, value = token.partition("=")
        key = key.strip().removeprefix("--").replace("_", "-")
        if not re.fullmatch(r"[a-z][a-z0-9-]*", key):
            raise UserError(f"--slurm-option {token!r} is invalid: use KEY=VALUE with an sbatch option name, "
                            "e.g. --slurm-option constraint=a100")
        if key in _OWN_OPTIONS:
            raise UserError(f"--slurm-option {key} is set by pimm submit ({_OWN_OPTIONS[key]})")
        if sep:
            _plain_word(value, f"--slurm-option {key}=")
        extra[key] = value if sep else True
    return extra


@dataclass
class JobPlan:
    save_path: Path
    parameters: dict  # submitit SlurmExecutor parameters
    task: NodeTask
    warning_signal: str
    python: str | None = None  # submitit's python command (a container around it), None: this interpreter
    secrets: dict = field(default_factory=dict)  # reach the job through the environment, never its script


def _load_config(config_file: str, options: list[str], world_size: int, check_save_path: bool = True):
    """The config as tools/train.py would load it for ``world_size`` ranks (validated).
    ``check_save_path``: refuse a fresh run over an earlier one (not for ``--dry-run``,
    which prints the script whatever is on disk)."""
    from pimm.engines.run.launch import load_config

    register_all()  # the config may name any registered model, data set, evaluator

    loaded = load_config(config_file, options, world_size, "train", check_save_path=check_save_path)
    return loaded[0] if isinstance(loaded, tuple) else loaded


def _warning_signal() -> str:
    from submitit.slurm.slurm import SlurmJobEnvironment

    return "SIG" + SlurmJobEnvironment.USR_SIG


def plan(args) -> JobPlan:
    _at_least(args.nodes, 1, "--nodes")
    _at_least(args.gpus_per_node, 0, "--gpus-per-node")
    _at_least(args.procs_per_node, 1, "--procs-per-node")
    _at_least(args.cpus_per_task, 1, "--cpus-per-task")
    _at_least(args.max_requeues, 0, "--max-requeues")
    if args.gpus_per_node and args.procs_per_node is not None:
        raise UserError("--procs-per-node is for CPU runs: with --gpus-per-node each node runs one rank per GPU")
    seconds = parse_time(args.time)
    if not 1 <= args.signal_seconds <= 65535:
        raise UserError(f"--signal-seconds {args.signal_seconds} is invalid: give 1 to 65535 (sbatch --signal)")
    if args.signal_seconds >= seconds:
        raise UserError(f"--signal-seconds {args.signal_seconds} must be shorter than --time {args.time}: the "
                        "warning comes that long before the time limit")
    if args.mem is not None and not re.fullmatch(r"\d+[KMGT]?", args.mem):
        raise UserError(f"--mem {args.mem!r} is invalid: use SLURM's syntax, e.g. 64G or 500M")
    for flag in ("partition", "account", "qos", "job_name"):
        _plain_word(getattr(args, flag), "--" + flag.replace("_", "-"))
    extra = _slurm_options(args.slurm_option)
    from pimm.utils.config import config_file_path

    config_file = config_file_path(args.config_file)  # pimm://... is a config shipped in the package
    if not config_file.is_file():
        raise UserError(f"--config-file {args.config_file!r}: no such file")
    if not TRAIN_SCRIPT.is_file():
        raise UserError(f"pimm submit runs {TRAIN_SCRIPT} on the nodes, and it is missing: use a source checkout")
    try:
        warning = _warning_signal()
    except ImportError:
        raise UserError("pimm submit needs submitit: pip install 'pimm[slurm]' (or pip install submitit)") from None

    nproc = args.gpus_per_node or args.procs_per_node or 1
    world_size = args.nodes * nproc
    cfg = _load_config(str(config_file), args.options, world_size, check_save_path=not args.dry_run)
    from pimm.engines.run.runtime import RUNTIME_DEFAULTS

    if cfg.save_path == RUNTIME_DEFAULTS["save_path"]:
        raise UserError(f"save_path is the default {cfg.save_path!r}: give this run its own directory on a shared "
                        "file system, e.g. --options save_path=/shared/runs/NAME")
    save_path = Path(cfg.save_path).expanduser().absolute()
    signals = list(dict.fromkeys([*cfg.preempt_signals, "SIGTERM", warning]))
    # An absolute path is never a Python literal, so it stays a string unquoted.
    kept = [o for o in args.options if o.partition("=")[0].strip() != "save_path"]  # replaced by the absolute one
    options = [*kept, f"save_path={save_path}", f"preempt_signals={json.dumps(signals)}"]
    _load_config(str(config_file), options, world_size, check_save_path=not args.dry_run)  # the job's options too

    workers_per_rank = cfg.num_worker // world_size
    parameters = dict(
        job_name=args.job_name or f"pimm-{save_path.name}", nodes=args.nodes, ntasks_per_node=1,
        cpus_per_task=args.cpus_per_task or nproc * (1 + workers_per_rank), time=math.ceil(seconds / 60),
        signal_delay_s=args.signal_seconds, partition=args.partition, account=args.account, qos=args.qos,
        mem=args.mem, gpus_per_node=args.gpus_per_node or None,
        additional_parameters={"requeue": True, **extra},
        # The nodes import this pimm (the pickled task refers to it), installed or not.
        setup=[f"export PYTHONPATH={shlex.quote(str(ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"],
    )
    parameters = {k: v for k, v in parameters.items() if v is not None}
    train_argv = [str(TRAIN_SCRIPT), "--config-file", str(config_file.resolve()), "--options", *options]
    task = NodeTask(train_argv=train_argv, save_path=str(save_path), nproc_per_node=nproc,
                    warning_signal=warning, max_requeues=args.max_requeues)
    return JobPlan(save_path=save_path, parameters=parameters, task=task, warning_signal=warning)


def _executor(folder: Path, parameters: dict, dry_run: bool, python: str | None = None):
    from submitit import SlurmExecutor

    class _ScriptOnly(SlurmExecutor):
        @classmethod
        def affinity(cls) -> int:  # renders the script without SLURM installed
            return 1

    executor = (_ScriptOnly if dry_run else SlurmExecutor)(folder=folder, max_num_timeout=0, python=python)
    executor.update_parameters(**parameters)
    return executor


def dry_run_text(job: JobPlan) -> str:
    executor = _executor(job.save_path / "slurm", job.parameters, dry_run=True, python=job.python)
    script = executor._make_submission_file_text(executor._submitit_command_str, "dry-run")
    marks = {"@NNODES@": '"$SLURM_NNODES"', "@NODEID@": '"$SLURM_NODEID"',
             "@MASTER@": '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             "@PORT@": f'"$(({_PORT_BASE} + SLURM_JOB_ID % {_PORT_SPAN}))"'}
    cmd = torchrun_command("@NNODES@", "@NODEID@", job.task.nproc_per_node, "@MASTER@", "@PORT@",
                           job.task.train_argv)
    line = shlex.join(cmd)
    for mark, shell in marks.items():
        line = line.replace(mark, shell)
    return (f"# sbatch script (written to {job.save_path / 'slurm'}/<job id>_submission.sh)\n{script}\n"
            "# each task (one per node) runs torchrun; node rank, hosts and job id come from SLURM:\n"
            f"{line}\n"
            "# an attempt after a requeue (SLURM_RESTART_COUNT > 0) also passes resume=True\n")


def submit(job: JobPlan, argv: list[str]) -> str:
    try:
        executor = _executor(job.save_path / "slurm", job.parameters, dry_run=False, python=job.python)
    except RuntimeError as err:  # submitit: no srun on PATH
        raise UserError(f"no SLURM here ({err}); run pimm submit on a login node, or use --dry-run") from None
    submitted = executor.submit(job.task)
    append_record(job.save_path, {"event": "submit", "job_id": submitted.job_id,
                                  "command": ["pimm", "submit", *argv],
                                  "script": str(submitted.paths.submission_file)})
    return submitted.job_id


def guarded(run, argv: list[str]) -> int:
    """``run(argv)`` with this command's exit codes: bad input is one ``error:``
    line and 2, any other failure (sbatch refused the job, a file system error)
    one ``error: submission failed`` line and 1."""
    try:
        return run(argv)
    except UserError as err:
        if os.environ.get("PIMM_DEBUG") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as err:  # sbatch refused the job, file system errors, ...
        if os.environ.get("PIMM_DEBUG") == "1":
            raise
        first = (str(err).strip().splitlines() or [""])[0]
        print(f"error: submission failed: {type(err).__name__}: {first}", file=sys.stderr)
        return EXIT_FAILURE


def _own_form(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    job = plan(args)
    # The command to run again, for the run's launch_command (config.py, run_metadata.json, W&B notes).
    job.parameters["setup"].append(f"export PIMM_LAUNCH_COMMAND={shlex.quote(shlex.join(['pimm', 'submit', *argv]))}")
    if args.dry_run:
        print(dry_run_text(job), end="")
        return EXIT_OK
    job_id = submit(job, argv)
    print(f"Submitted job {job_id}: run in {job.save_path}, logs in {job.save_path / 'slurm'} "
          f"(requeued on {job.warning_signal} up to {args.max_requeues} times)")
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """pimm's own form (``--config-file``); ``pimm submit`` hands upstream's form
    (``--site``, ``--train.config``, ...) to :mod:`pimm.cli.submit_upstream`."""
    return guarded(_own_form, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
