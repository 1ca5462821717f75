"""``pimm submit`` with upstream pimm's flags: ``--site``, ``--recipe``,
``--resources.*``, ``--run.*``, ``--train.*``, ``--container.*``,
``--chain.jobs``, ``--interactive``, ``--output``, ``--dry-run`` and the ``--``
tail (the launch settings of :mod:`pimm.cli.launch_config`).

A batch job goes through the submitit path of :mod:`pimm.cli.submit` (one
task per node running torchrun, the warning signal and requeue of
:mod:`pimm.distributed.slurm_task`): ``--chain.jobs N`` is N attempts, the job
requeued after a pre-emption or time-out warning up to N-1 times, each later
attempt resuming exactly. With a container the whole node task runs inside
the image.

``--interactive`` runs ``salloc ... srun ... pimm launch ...`` in this
terminal instead: each node of the allocation runs ``pimm launch`` with the
same settings (the launch finds its node rank and the first node from SLURM).
With ``--chain.jobs N`` the slots run one after the other, each resuming the
last; run from a login shell such a chain would die with it, so ``pimm
submit`` installs a ``scron`` supervisor instead (:mod:`pimm.cli.watchdog`),
which runs this same command with ``PIMM_WATCHDOG_CHILD=1``.

Refused in one line, with what to use: ``--submit.host`` (ssh to the login
host and run ``pimm submit`` there) and Google Cloud Batch sites
(``resources.scheduler: gcloud``: run ``pimm launch`` on the VM).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from pimm.cli import launch, launch_plan
from pimm.cli.launch_config import Resolved
from pimm.utils.errors import UserError
from pimm.utils.redaction import redact_secrets_in_text

__all__ = ["main", "is_upstream_form", "slurm_seconds", "interactive_commands", "batch_job", "run_chain"]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 75, 130
CHILD_ENV = "PIMM_WATCHDOG_CHILD"
_LEGACY = ("--config-file", "--nodes", "--gpus-per-node", "--procs-per-node", "--cpus-per-task", "--max-requeues",
           "--signal-seconds", "--slurm-option", "--options")


def is_upstream_form(argv: list[str]) -> bool:
    """Upstream's flags (``--site``, ``--train.config`` ...) rather than pimm's
    own (``--config-file``, ``--nodes`` ...): pimm's own form always names
    ``--config-file``."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    return not any(t.split("=", 1)[0] in _LEGACY for t in head)


def slurm_seconds(value) -> int:
    """A SLURM time limit (minutes as an integer, ``MM``, ``MM:SS``,
    ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``) in seconds."""
    if isinstance(value, int):
        return value * 60
    text = str(value).strip()
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if not match:
        raise UserError(f"--resources.time {value!r} is invalid: use HH:MM:SS, D-HH:MM:SS, MM:SS or minutes")
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        parts = [int(first), int(second or 0), int(third or 0)]
        seconds = int(days) * 86400 + parts[0] * 3600 + parts[1] * 60 + parts[2]
    elif third is not None:
        seconds = int(first) * 3600 + int(second) * 60 + int(third)
    elif second is not None:
        seconds = int(first) * 60 + int(second)
    else:
        seconds = int(first) * 60
    if seconds <= 0:
        raise UserError(f"--resources.time {value!r} is invalid: the time limit must be positive")
    return seconds


def _hms(seconds: int) -> str:
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _checks(resolved: Resolved) -> None:
    cfg = resolved.config
    if cfg.submit.host and not resolved.flags.get("no_remote"):
        raise UserError(f"--submit.host {cfg.submit.host}: pimm submits from the machine it runs on; log in to "
                        f"{cfg.submit.host} (ssh {cfg.submit.host}) and run the same pimm submit there")
    if cfg.resources.scheduler == "gcloud":
        raise UserError(f"site {cfg.site} submits to Google Cloud Batch, which pimm does not do: start a VM with "
                        "the image and run `pimm launch` there, or use a SLURM site (--site slurm)")
    if cfg.resources.scheduler != "slurm":
        raise UserError(f"pimm submit needs a SLURM site (resources.scheduler slurm, e.g. --site slurm); site "
                        f"{cfg.site} is {cfg.resources.scheduler}: run it here with pimm launch")
    if cfg.resources.nproc_per_node == "auto":
        raise UserError("--resources.nproc-per-node auto is for pimm launch only: give the number of GPUs "
                        "(processes) per node")
    if cfg.chain.jobs < 1:
        raise UserError(f"--chain.jobs {cfg.chain.jobs} is invalid: give 1 or more")
    if cfg.resources.time is None:
        raise UserError("pimm submit needs a time limit: --resources.time HH:MM:SS")


def _chain_options(resolved: Resolved, run_name: str, resume_first: bool = True) -> list[str]:
    cfg = resolved.config
    options = []
    if resume_first and cfg.chain.resume_first and not cfg.train.resume:
        options.append("resume=True")
    if cfg.chain.jobs > 1:
        options += [f"wandb_group={cfg.chain.wandb_group or run_name!r}",
                    f"wandb_job_type={cfg.chain.wandb_job_type!r}"]
    return options


# -- batch (submitit) --------------------------------------------------------------------------
def _container_python(resolved: Resolved, root: Path, env_names: list[str]) -> str | None:
    """submitit's ``python`` for a containerized job: the node task runs in the image."""
    cfg = resolved.config
    if cfg.container.runtime == "none":
        return None
    inner = "\n".join([*cfg.setup, f'exec {shlex.quote(cfg.container.interpreter or "python")} "$@"'])
    wrapped = launch_plan.wrap_in_container(resolved, inner, root, env_names)
    return wrapped + " pimm-node-task"  # $0 of the inner bash; submitit's arguments follow


def batch_job(resolved: Resolved, argv: list[str]):
    """The :class:`pimm.cli.submit.JobPlan` of the settings, through pimm submit's own planner."""
    from pimm.cli import submit

    cfg = resolved.config
    root = launch_plan.repo_root(resolved)
    config_file, name, save_path = launch_plan.locate(resolved)
    nproc = cfg.resources.nproc_per_node
    gpus = 0 if cfg.resources.gpu_directive == "none" else nproc
    extra = [f"{k}={v}" if v is not True else str(k) for k, v in cfg.resources.scheduler_options.items()
             if v not in (None, False, "")]
    extra += [f"constraint={cfg.resources.constraint}"] if cfg.resources.constraint else []
    extra += [f"dependency={cfg.resources.dependency}"] if cfg.resources.dependency else []
    args = argparse.Namespace(
        config_file=str(config_file), nodes=cfg.resources.nnodes, gpus_per_node=gpus,
        procs_per_node=None if gpus else nproc, cpus_per_task=cfg.resources.cpus_per_proc * nproc,
        mem=cfg.resources.mem, time=_hms(slurm_seconds(cfg.resources.time)), partition=cfg.resources.partition,
        account=cfg.resources.account, qos=cfg.resources.qos, job_name=launch_plan.job_name(resolved, name),
        max_requeues=cfg.chain.jobs - 1, signal_seconds=cfg.resources.signal_delay_s, slurm_option=extra,
        dry_run=bool(resolved.flags.get("dry_run")),
        options=launch_plan.training_options(resolved, save_path, _chain_options(resolved, name)))
    job = submit.plan(args)
    if gpus and cfg.resources.gpu_directive == "gres":
        job.parameters.pop("gpus_per_node", None)
        job.parameters["gres"] = f"gpu:{gpus}"
    env, secrets = launch_plan.environment(resolved)
    env["PIMM_LAUNCH_COMMAND"] = launch.launch_command("submit", argv)
    setup = job.parameters["setup"]
    setup += launch_plan.export_lines(env, secrets)  # sbatch hands the job this process's environment
    setup.append(f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{cfg.resources.cpus_per_proc}}}"')
    job.secrets = secrets
    job.python = _container_python(resolved, root, [*env, *secrets, "OMP_NUM_THREADS", "PYTHONPATH"])
    if job.python is None:
        setup += list(cfg.setup)
        if cfg.train.python:  # the node task (and torchrun, and the ranks) run on this interpreter
            job.python = shlex.quote(launch_plan.interpreter(resolved, root))
    if cfg.container.runtime == "shifter":  # shifter reads its image from the job, as upstream's launcher asks
        job.parameters["additional_parameters"].update(
            {k: v for k, v in (("image", cfg.container.image), ("module", cfg.container.module)) if v})
    return job


def _batch(resolved: Resolved, argv: list[str]) -> int:
    from pimm.cli import submit

    job = batch_job(resolved, argv)
    text = redact_secrets_in_text(submit.dry_run_text(job))
    if resolved.flags.get("output"):
        script = text.split("\n# each task", 1)[0].split("\n", 1)[1]
        print(f"# wrote the sbatch script: {launch._write(resolved.flags['output'], script)}")
    if resolved.flags.get("dry_run"):
        jobs = resolved.config.chain.jobs
        print(f"# pimm submit --dry-run: nothing was queued\n# launch settings ({' + '.join(resolved.layers)} + "
              f"the command line):\n{launch.settings_text(resolved)}# run folder: {job.save_path}\n"
              f"# {jobs} attempt(s): requeued after a pre-emption or time-out warning up to {jobs - 1} time(s), "
              f"each later attempt resuming\n{text}", end="")
        return EXIT_OK
    os.environ.update(job.secrets)  # sbatch passes the submitting environment to the job (--export=ALL)
    job_id = submit.submit(job, argv)
    print(f"Submitted job {job_id}: run in {job.save_path}, logs in {job.save_path / 'slurm'} "
          f"(requeued on {job.warning_signal} up to {job.task.max_requeues} times, each attempt resuming)")
    return EXIT_OK


# -- interactive (salloc) ----------------------------------------------------------------------
# Flags the nodes' pimm launch does not get: submit's own, and the W&B key (it reaches them in the environment).
_SUBMIT_ONLY = {"--interactive": 0, "--no-interactive": 0, "--dry-run": 0, "--no-remote": 0, "--output": 1,
                "--executor": 1, "--run.wandb-api-key": 1}


def _launch_flags(argv: list[str]) -> list[str]:
    """The launcher flags of a submit command line that ``pimm launch`` takes."""
    head = argv[:argv.index("--")] if "--" in argv else list(argv)
    kept, skip = [], 0
    for token in head:
        if skip:
            skip -= 1
            continue
        flag = token.split("=", 1)[0].replace("_", "-")
        if flag in _SUBMIT_ONLY:
            skip = 0 if "=" in token else _SUBMIT_ONLY[flag]
            continue
        kept.append(token)
    return kept


def interactive_commands(resolved: Resolved, argv: list[str]) -> tuple[str, list[list[str]]]:
    """``(run name, [salloc argv of each attempt])``."""
    cfg = resolved.config
    res = cfg.resources
    _, name, _ = launch_plan.locate(resolved)  # a wrong config name fails here, not on the compute node
    nproc = res.nproc_per_node
    alloc = ["salloc", "--job-name", launch_plan.job_name(resolved, name), "--nodes", str(res.nnodes),
             "--ntasks-per-node", "1", "--cpus-per-task", str(res.cpus_per_proc * nproc)]
    for flag, value in (("--account", res.account), ("--partition", res.partition), ("--qos", res.qos),
                        ("--constraint", res.constraint), ("--dependency", res.dependency), ("--mem", res.mem)):
        alloc += [flag, str(value)] if value else []
    alloc += ["--time", _hms(slurm_seconds(res.time))]
    if res.gpu_directive == "gres":
        alloc += ["--gres", f"gpu:{nproc}"]
    elif res.gpu_directive == "gpus-per-node":
        alloc += ["--gpus-per-node", str(nproc)]
    if cfg.container.runtime == "shifter":
        alloc += [f"--{k}={v}" for k, v in (("image", cfg.container.image), ("module", cfg.container.module)) if v]
    for key, value in res.scheduler_options.items():
        if value is True:
            alloc.append(f"--{key}")
        elif value not in (None, False, ""):
            alloc += [f"--{key}", str(value)]
    step = ["srun", "--ntasks-per-node", "1"]  # training's output comes to this terminal
    head = _launch_flags(resolved.argv)
    tail = resolved.argv[resolved.argv.index("--") + 1:] if "--" in resolved.argv else []
    first_resumes = cfg.train.resume or cfg.chain.resume_first
    commands = []
    for attempt in range(cfg.chain.jobs):
        resume = ["--train.resume"] if first_resumes or attempt > 0 else []
        node = [sys.executable, "-m", "pimm.cli", "launch", *head, "--run.name", name, "--run.no-timestamp",
                *resume, "--", *_chain_options(resolved, name, resume_first=False), *tail]
        commands.append([*alloc, *step, *node])
    return name, commands


def _newest_checkpoint(save_path: Path) -> float:
    newest = 0.0
    for folder in (save_path / "model", save_path / "checkpoints"):
        if folder.is_dir():
            for path in folder.rglob("*"):
                try:
                    newest = max(newest, path.stat().st_mtime)
                except OSError:
                    pass
    return newest


def run_chain(resolved: Resolved, name: str, commands: list[list[str]], env: dict) -> int:
    """The salloc slots one after another: the next after a pre-emption (exit 75)
    or a slot that ended with a newer checkpoint; stop when training is done, on
    Ctrl-C, or when a slot failed without progress (rerunning would repeat it)."""
    root = launch_plan.repo_root(resolved)
    save_path = launch_plan.locate(resolved)[2]
    code = EXIT_OK
    for attempt, command in enumerate(commands, start=1):
        print(f"pimm submit --interactive: slot {attempt}/{len(commands)} of run {name} ({save_path})", flush=True)
        before = _newest_checkpoint(save_path)
        try:
            code = subprocess.run(command, cwd=root, env=env).returncode
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except OSError as err:
            raise UserError(f"cannot run salloc ({err.strerror or err}): run pimm submit --interactive on a "
                            "SLURM login node, or use --dry-run") from None
        if code in (EXIT_OK, EXIT_INTERRUPTED, -2) or attempt == len(commands):
            return code
        if code != EXIT_PREEMPTED and _newest_checkpoint(save_path) <= before:
            print(f"pimm submit --interactive: slot {attempt} exited {code} without a newer checkpoint; stopping "
                  "(a rerun would fail the same way)", file=sys.stderr, flush=True)
            return code
    return code


def _interactive(resolved: Resolved, argv: list[str]) -> int:
    from pimm.cli import watchdog

    cfg = resolved.config
    if cfg.chain.jobs > 1 and not os.environ.get(CHILD_ENV):
        name, _ = interactive_commands(resolved, argv)
        return watchdog.install(resolved, name, argv, dry_run=bool(resolved.flags.get("dry_run")),
                                output=resolved.flags.get("output"))
    name, commands = interactive_commands(resolved, argv)
    recorded = launch.launch_command("submit", argv)
    if len(commands) == 1:
        text = shlex.join(commands[0]) + "\n"
    else:
        text = "\n".join(f"# slot {i}/{len(commands)}\n{shlex.join(c)}" for i, c in enumerate(commands, 1)) + "\n"
    if resolved.flags.get("output"):
        script = f"#!/bin/bash\nexport PIMM_LAUNCH_COMMAND={shlex.quote(recorded)}\n{text}"
        print(f"# wrote the salloc command: {launch._write(resolved.flags['output'], script)}")
    if resolved.flags.get("dry_run"):
        print(f"# pimm submit --interactive --dry-run: nothing was started\n# launch settings "
              f"({' + '.join(resolved.layers)} + the command line):\n{launch.settings_text(resolved)}"
              f"# each node of the allocation runs pimm launch with these settings:\n{text}", end="")
        return EXIT_OK
    env = dict(os.environ, PIMM_LAUNCH_COMMAND=os.environ.get("PIMM_LAUNCH_COMMAND") or recorded)
    env.update(launch_plan.environment(resolved)[1])  # salloc and srun pass the environment on
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(launch_plan.IMPORT_ROOT), env.get("PYTHONPATH")) if p)
    return run_chain(resolved, name, commands, env)


def main(argv: list[str]) -> int:
    """``pimm submit`` with upstream's flags; exit codes as :func:`pimm.cli.submit.guarded`."""
    from pimm.cli import submit

    return submit.guarded(_run, argv)


def _run(argv: list[str]) -> int:
    resolved = launch.resolve_argv(argv, "submit")
    _checks(resolved)
    cfg = resolved.config
    if not cfg.train.config:
        raise UserError("give the experiment config: --train.config NAME (`pimm ls` lists the configs)")
    interactive = bool(resolved.flags.get("interactive", cfg.interactive)) or cfg.executor == "interactive"
    return _interactive(resolved, argv) if interactive else _batch(resolved, argv)
