"""The flags of ``pimm launch`` / ``pimm submit``, made from the launch schema
(:mod:`pimm.cli.launch_schema`) the way upstream's tyro command line spells
them: ``--GROUP.KEY VALUE`` with hyphens (``--resources.nproc-per-node 4``;
underscores are read too), booleans as ``--GROUP.KEY`` / ``--GROUP.no-KEY``
(``--run.no-timestamp``), lists as several values (``--container.binds /a /b``),
``None`` / ``null`` for an empty optional value. ``env``, ``train.options`` and
``resources.scheduler_options`` are YAML-only, as upstream's.

Why argparse and not tyro (upstream's parser): tyro is not a pimm dependency;
its errors are multi-line panels where pimm's contract is one ``error:`` line
and exit 2; and the reference page (``docs/cli.md``) is generated from the
commands' argparse parsers. The flags, their spelling and their meaning are
upstream's.
"""

from __future__ import annotations

import argparse
import re
import typing

from pimm.cli import launch_schema
from pimm.cli.tool_args import ToolParser

__all__ = ["build_parser", "parse"]

_HELP = {
    "paths.repo_root": "the checkout holding configs/ (default: the working directory when it has configs/)",
    "paths.exp_root": "where runs go: <exp-root>/<config folder>/<run name> (default {repo_root}/exp)",
    "resources.scheduler": "local or slurm (gcloud profiles load; pimm submit refuses them)",
    "resources.nnodes": "nodes",
    "resources.nproc_per_node": "processes (GPUs) per node; auto: every visible GPU, local only",
    "resources.cpus_per_proc": "CPUs per process (OMP_NUM_THREADS; SLURM: x nproc-per-node per node)",
    "resources.account": "SLURM account", "resources.partition": "SLURM partition", "resources.qos": "SLURM QOS",
    "resources.constraint": "SLURM constraint",
    "resources.dependency": "SLURM dependency, e.g. afterok:12345",
    "resources.time": "time limit of each attempt: [D-]HH:MM:SS, MM:SS or minutes (SLURM)",
    "resources.mem": "memory per node, e.g. 64G",
    "resources.output": "accepted for upstream's profiles: batch jobs log to <run>/slurm/, --interactive runs "
                        "to the terminal",
    "resources.error": "accepted for upstream's profiles (see --resources.output)",
    "resources.gpu_directive": "how GPUs are asked for: gres (--gres=gpu:N), gpus-per-node, none (CPU ranks)",
    "resources.job_name": "SLURM job name (default: the run name)",
    "resources.signal_delay_s": "the pre-emption warning comes this many seconds before the time limit",
    "run.name": "the run folder's name (default: the config's name)",
    "run.timestamp": "append -YYYY-mm-dd_HH-MM-SS to the run name (--run.no-timestamp: reuse the folder)",
    "run.wandb_name": "W&B run name (wandb_run_name)", "run.wandb_project": "W&B project (wandb_project)",
    "run.wandb_api_key": "exported as WANDB_API_KEY (never printed)",
    "train.config": "the experiment config by name under configs/, e.g. tests/tiny_semseg (or a file path)",
    "train.weight": "weights to start from (weight=)",
    "train.resume": "continue the run in the run folder exactly (resume=True); use a fixed --run.name",
    "train.code_copy": "accepted for upstream's profiles; pimm copies no code (run_metadata.json records "
                       "the commit)",
    "train.python": "the Python interpreter that runs training",
    "train.test": "evaluate on the test split instead of training (pimm test)",
    "container.runtime": "none, apptainer, singularity, shifter or docker: training runs inside the image",
    "container.image": "the image", "container.module": "shifter modules",
    "container.binds": "paths to bind into the container (HOST[:INSIDE])",
    "container.repo_mount": "where the checkout is bound inside the container too (None: not)",
    "container.unset_env": "variables to unset before shifter starts",
    "container.interpreter": "the Python inside the image",
    "submit.host": "refused: pimm submits from the machine it runs on (run it on the login node)",
    "submit.folder": "accepted for upstream's profiles: submitit's files go to <run>/slurm/",
    "chain.jobs": "attempts: requeued after pre-emption or time-out up to jobs-1 times, each resuming exactly",
    "chain.resume_first": "the first attempt resumes too",
    "chain.wandb_group": "W&B group of a chained run (wandb_group)",
    "chain.wandb_job_type": "W&B job type of a chained run (wandb_job_type)",
    "watchdog.qos": "QOS of the scron entry of a chained --interactive run",
    "watchdog.interval_min": "minutes between the scron entry's checks",
    "watchdog.time": "time limit of the scron driver",
    "rdzv.endpoint": "HOST:PORT of the rendezvous (default: the first node, a port from the run name)",
    "rdzv.id": "rendezvous id (with --rdzv.backend)", "rdzv.backend": "torchrun rendezvous backend, e.g. c10d",
}

_NONE = ("None", "none", "null", "~")


def _converter(kind, flag: str):
    """A value parser for an argparse flag of schema type ``kind``."""
    members = (kind,) if typing.get_origin(kind) is typing.Literal else typing.get_args(kind) or (kind,)
    optional = type(None) in members
    literals = [a for m in members if typing.get_origin(m) is typing.Literal for a in typing.get_args(m)]
    plain = [m for m in members if m is not type(None) and typing.get_origin(m) is not typing.Literal]

    def convert(text: str):
        if optional and text in _NONE:
            return None
        if text in literals:
            return text
        if int in plain and re.fullmatch(r"[+-]?\d+", text):
            return int(text)
        if str in plain:
            return text
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: give {launch_schema.describe(kind)}")

    convert.__name__ = launch_schema.describe(kind)
    return convert


def _metavar(kind) -> str:
    if typing.get_origin(kind) is typing.Literal:
        return "{" + ",".join(typing.get_args(kind)) + "}"
    args = typing.get_args(kind) or (kind,)
    literals = [a for arg in args if typing.get_origin(arg) is typing.Literal for a in typing.get_args(arg)]
    if str in args:
        return "STR"
    return "|".join(["N", *literals])


def build_parser(prog: str, submit: bool) -> ToolParser:
    what = ("Submit training to SLURM (batch through submitit, or --interactive salloc)" if submit
            else "Run training here: this machine, or a node of an allocation you hold")
    parser = ToolParser(prog=prog, allow_abbrev=False, argument_default=argparse.SUPPRESS,
                        usage=f"{prog} [launcher options] -- [KEY=VALUE ...]",
                        description=f"{what}. Everything after a bare -- overrides the experiment config."
                        + (" A command line with --config-file is pimm's own form (pimm submit --config-file CFG "
                           "--help)." if submit else ""))
    add = parser.add_argument
    add("--site", metavar="NAME", help="site profile: launch/sites/NAME.yaml (pimm ships local and slurm)"
        + (" (default slurm)" if submit else " (default local)"))
    add("--recipe", metavar="YAML", help="run recipe, e.g. launch/runs/NAME.yaml (relative to the repository root)")
    add("--dry-run", action="store_true", dest="dry_run",
        help="print the resolved settings and " + ("the job" if submit else "the command") + "; start nothing")
    add("--output", metavar="PATH",
        help="also write the " + ("sbatch script (or the salloc command)" if submit else "launch script")
        + " to PATH")
    add("--executor", choices=["local", "batch", "interactive"],
        help="accepted for upstream's profiles; the command chooses (launch: local, submit: batch/--interactive)")
    add("--interactive", action="store_true", dest="interactive",
        help="salloc ... srun ... in this terminal instead of a queued job" if submit else "ignored by launch")
    add("--no-interactive", action="store_false", dest="interactive", help=argparse.SUPPRESS)
    add("--setup", nargs="*", metavar="LINE", dest="setup", help="shell lines run before training (module load ...)")
    for group, cls in launch_schema.GROUPS.items():
        for name, kind in launch_schema.field_kinds(cls).items():
            if kind is dict:
                continue  # YAML only: env, train.options, resources.scheduler_options
            dest, flag = f"{group}.{name}", f"--{group}.{name.replace('_', '-')}"
            help_text = _HELP.get(dest)
            if kind is bool:
                add(flag, action="store_true", dest=dest, help=help_text)
                add(f"--{group}.no-{name.replace('_', '-')}", action="store_false", dest=dest,
                    help=argparse.SUPPRESS)
            elif typing.get_origin(kind) is list:
                add(flag, nargs="*", metavar="STR", dest=dest, help=help_text)
            else:
                add(flag, type=_converter(kind, flag), metavar=_metavar(kind), dest=dest, help=help_text)
    if submit:
        add("--no-remote", action="store_true", dest="no_remote", help="accepted (pimm never submits remotely)")
    return parser


def _hyphenate(token: str) -> str:
    """``--resources.nproc_per_node=4`` -> ``--resources.nproc-per-node=4``."""
    if not token.startswith("--"):
        return token
    flag, sep, value = token.partition("=")
    return flag.replace("_", "-") + sep + value


def parse(argv: list[str], prog: str, submit: bool) -> tuple[dict, list[str]]:
    """``(flags given, as {dotted key: value}, tail)``."""
    from pimm.cli.launch_config import split_tail

    head, tail = split_tail(argv)
    namespace = build_parser(prog, submit).parse_args([_hyphenate(t) for t in head])
    return dict(vars(namespace)), tail
