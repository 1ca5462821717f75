"""What one node of a ``pimm launch`` runs, as a shell script: the run folder,
the training command and its environment, inside a container when the site
names one. ``pimm launch --dry-run`` prints this script and a real launch
executes it (``bash -c``, ending in ``exec``, so the training process is the
launch's own process: Ctrl-C and pre-emption signals reach it directly).

The training command is pimm's own launcher, the one ``pimm train`` runs:
``python -m pimm.train --config-file CFG --options ...`` for one process, and
``pimm torchrun`` (torch's launcher with pimm's exit codes and signal
forwarding) for several: ``--standalone`` on one node, a static rendezvous
over several (node rank from ``PIMM_NODE_RANK`` / ``SLURM_NODEID`` /
``SLURM_PROCID``, the first node of the allocation as master). So the run
lock, exact resume, pre-emption (exit 75) and Ctrl-C (130) are those of
``pimm train``.

The run folder is upstream's: ``<exp_root>/<config folder>/<run name>``, the
run name the config's name (or ``--run.name``) and, unless
``--run.no-timestamp``, ``-YYYY-mm-dd_HH-MM-SS``.

Containers wrap the command as upstream's launcher does (``apptainer run
--nv``, ``singularity run --nv``, ``shifter --image``, ``docker run --gpus
all``), with the checkout bound at its own path (so every path in the command
is the same inside) and also at ``container.repo_mount``.
"""

from __future__ import annotations

import re
import shlex
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

from pimm.cli.launch_config import Resolved, find_config
from pimm.utils.errors import UserError
from pimm.utils.redaction import redact_secrets_in_text

__all__ = ["LaunchPlan", "plan_launch", "repo_root", "run_name", "training_options", "wrap_in_container",
           "interpreter", "environment", "export_lines", "job_name", "locate"]

#: The checkout (or site-packages) this pimm is imported from: put first on the
#: training processes' PYTHONPATH, so they run this very pimm.
IMPORT_ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = ("singularity", "apptainer", "shifter", "docker")


@dataclass
class LaunchPlan:
    run_name: str
    save_path: Path
    config_file: Path
    repo_root: Path
    nnodes: int
    nproc_per_node: int
    options: list[str]  # pimm --options of the training processes
    env: dict  # exported before training
    secrets: dict  # variables that reach training through the environment only, never the script's text
    command: list[str]  # the training command (inside the container, if any)
    script: str  # what runs (bash)
    display_script: str  # the same with any secret in the command redacted (--dry-run, --output)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def visible_gpus() -> int:
    """``nproc_per_node: auto``: the GPUs this process sees (one process without any)."""
    import torch

    return max(1, torch.cuda.device_count())


def run_name(resolved: Resolved, config_name: str) -> str:
    cfg = resolved.config
    name = Path(str(cfg.run.name or config_name).removesuffix(".py")).name
    if cfg.run.timestamp and resolved.launch_time not in name:
        name = f"{name}-{resolved.launch_time}"
    return name


def job_name(resolved: Resolved, run_name: str) -> str:
    """The SLURM job name: ``resources.job_name`` or the run's, in the characters SLURM keeps."""
    name = re.sub(r"[^A-Za-z0-9_.+-]+", "-", resolved.config.resources.job_name or run_name).strip("-")
    return name[:128] or "pimm"


def repo_root(resolved: Resolved) -> Path:
    root = Path(resolved.config.paths.repo_root).expanduser()
    return (root if root.is_absolute() else resolved.base / root).resolve()


def locate(resolved: Resolved) -> tuple[Path, str, Path]:
    """``(config file, run name, run folder)``: the folder is
    ``<exp_root>/<config folder>/<run name>``, relative paths from the repository root."""
    cfg = resolved.config
    if not cfg.train.config:
        raise UserError("give the experiment config: --train.config NAME (e.g. tests/tiny_semseg; `pimm ls` "
                        "lists the configs)")
    root = repo_root(resolved)
    config_file, group = find_config(cfg.train.config, root)
    name = run_name(resolved, cfg.train.config)
    exp_root = Path(cfg.paths.exp_root).expanduser()
    exp_root = exp_root if exp_root.is_absolute() else root / exp_root
    return config_file, name, (exp_root / group / name).absolute()


def training_options(resolved: Resolved, save_path: Path, extra: list[str] = ()) -> list[str]:
    """The ``--options`` of the run: the run folder and what the launch flags
    mean for the experiment config, then ``train.options`` and the tail (which
    win over everything before them)."""
    cfg = resolved.config
    options = [f"save_path={save_path}"]
    if cfg.train.weight:
        options.append(f"weight={cfg.train.weight!r}")  # a path is text, whatever its characters
    if cfg.train.resume:
        options.append("resume=True")
    if cfg.run.wandb_name:
        options.append(f"wandb_run_name={cfg.run.wandb_name!r}")
    if cfg.run.wandb_project:
        options.append(f"wandb_project={cfg.run.wandb_project!r}")
    return [*options, *extra, *resolved.options]


def _rendezvous_lines(resolved: Resolved, name: str) -> list[str]:
    """MASTER_ADDR / MASTER_PORT of a multi-node run, computed on each node by the
    shell: the environment's, else ``--rdzv.endpoint``, else the allocation's first
    node and a port from the job id (or the run name), the same on every node."""
    endpoint = resolved.config.rdzv.endpoint
    if endpoint:
        host, sep, port = str(endpoint).rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UserError(f"--rdzv.endpoint {endpoint}: give HOST:PORT, e.g. node001:29500")
        addr, port_expr = shlex.quote(host), port
    else:
        addr = '$(scontrol show hostnames "${SLURM_JOB_NODELIST:?no MASTER_ADDR, --rdzv.endpoint or SLURM ' \
               'allocation to find the first node}" | head -n 1)'
        port_expr = f"$((10000 + ${{SLURM_JOB_ID:-{zlib.crc32(name.encode()) % 20000}}} % 20000))"
    return [f'MASTER_ADDR="${{MASTER_ADDR:-{addr}}}"', f'MASTER_PORT="${{MASTER_PORT:-{port_expr}}}"',
            "export MASTER_ADDR MASTER_PORT"]


def training_command(python: str, nnodes: int, nproc: int, module: str, args: list[str],
                     rdzv_backend: str | None, rdzv_id: str | None, name: str) -> list[str]:
    if nnodes == 1 and nproc == 1:
        return [python, "-m", module, *args]
    launcher = [python, "-m", "pimm.distributed.torchrun", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    if nnodes == 1:
        launcher.insert(3, "--standalone")
    elif rdzv_backend:
        launcher += [f"--nnodes={nnodes}", f"--rdzv-backend={rdzv_backend}",
                     "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT", f"--rdzv-id={rdzv_id or name}"]
    else:
        launcher += [f"--nnodes={nnodes}", "--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR",
                     "--master-port=$MASTER_PORT"]
    return [*launcher, "--module", module, *args]


_EXPANDED = {"--node-rank=$NODE_RANK", "--master-addr=$MASTER_ADDR", "--master-port=$MASTER_PORT",
             "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT"}


def _shell_words(command: list[str]) -> str:
    """``command`` for bash: every word quoted, except the rendezvous words above,
    which expand to what the script's rendezvous lines computed on this node."""
    return " ".join(f'"{w}"' if w in _EXPANDED else shlex.quote(w) for w in command)


def _binds(resolved: Resolved, root: Path) -> list[str]:
    container = resolved.config.container
    binds = [str(b) for b in container.binds]
    # The checkout at its own path, so every path of the command is the same inside (shifter
    # mounts the global file systems itself), and at repo_mount like upstream's launcher.
    own = None if container.runtime == "shifter" else str(root)
    for spec in (own, f"{root}:{container.repo_mount}" if container.repo_mount else None):
        if spec and spec not in binds and spec != f"{root}:{root}":
            binds.append(spec)
    return binds


def wrap_in_container(resolved: Resolved, inner: str, root: Path, env_names: list[str]) -> str:
    """The shell words that run ``inner`` (a bash script) in the site's container."""
    container = resolved.config.container
    runtime = container.runtime
    if runtime == "none":
        return inner
    if not container.image and not (runtime == "shifter" and container.module):
        raise UserError(f"--container.runtime {runtime} needs an image: --container.image IMAGE (or the site's "
                        "container.image)")
    shell = ["bash", "--noprofile", "--norc", "-c", inner]
    binds = _binds(resolved, root)
    if runtime in ("apptainer", "singularity"):
        words = [runtime, "run", "--nv"] + (["-B", ",".join(binds)] if binds else []) + [container.image, *shell]
    elif runtime == "shifter":
        words = ["env"] + [w for var in container.unset_env for w in ("-u", var)] + ["shifter"]
        words += [f"--module={container.module}"] if container.module else []
        words += [f"--image={container.image}"] if container.image else []
        volumes = [b if ":" in b else f"{b}:{b}" for b in binds]
        words += [f"--volume={';'.join(volumes)}"] if volumes else []
        words += ["/bin/bash", "--noprofile", "--norc", "-c", inner]
    else:  # docker: nothing of the host comes in unless named
        words = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host", "-w", str(root)]
        for bind in binds:
            words += ["-v", bind if ":" in bind else f"{bind}:{bind}"]
        for name in env_names:
            words += ["-e", name]
        words += [container.image, *shell]
    return shlex.join(words)


def is_secret_name(name: str) -> bool:
    """A variable named like a credential (``WANDB_API_KEY``, ``HF_TOKEN``, ...)."""
    return redact_secrets_in_text(f"{name}=value") != f"{name}=value"


def environment(resolved: Resolved) -> tuple[dict, dict]:
    """``(variables, secrets)`` the launch exports: the site's ``env``, and
    ``--run.wandb-api-key`` as ``WANDB_API_KEY``. A secret's value is never
    written into a script: the script names it (``export NAME``) and the
    process environment carries it."""
    cfg = resolved.config
    env = {str(k): str(v) for k, v in cfg.env.items() if v is not None}
    if cfg.run.wandb_api_key:
        env["WANDB_API_KEY"] = cfg.run.wandb_api_key
    if cfg.rdzv.id:
        env["PIMM_RDZV_ID"] = cfg.rdzv.id
    secrets = {k: env.pop(k) for k in list(env) if is_secret_name(k)}
    return env, secrets


def export_lines(env: dict, secrets: dict) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in env.items()] + [f"export {k}" for k in secrets]


def interpreter(resolved: Resolved, root: Path) -> str:
    cfg = resolved.config
    if cfg.train.python:
        python = Path(cfg.train.python).expanduser()
        return str(python if python.is_absolute() or "/" not in cfg.train.python else root / python)
    if cfg.container.runtime != "none":
        return cfg.container.interpreter or "python"
    return sys.executable


def plan_launch(resolved: Resolved, *, extra_options: list[str] = (), launch_command: str | None = None,
                nproc_override: int | None = None) -> LaunchPlan:
    """The script of one node of the run ``resolved`` describes."""
    cfg = resolved.config
    root = repo_root(resolved)
    config_file, name, save_path = locate(resolved)
    if cfg.resources.nnodes < 1:
        raise UserError(f"--resources.nnodes {cfg.resources.nnodes} is invalid: give 1 or more")
    nproc = cfg.resources.nproc_per_node
    if nproc == "auto":
        nproc = nproc_override or visible_gpus()
    if nproc < 1:
        raise UserError(f"--resources.nproc-per-node {nproc} is invalid: give 1 or more, or auto")
    if cfg.resources.cpus_per_proc < 1:
        raise UserError(f"--resources.cpus-per-proc {cfg.resources.cpus_per_proc} is invalid: give 1 or more")
    if cfg.train.resume and not save_path.is_dir():
        raise UserError(f"--train.resume: the run folder {save_path} does not exist; name the run to continue "
                        "with --run.name NAME --run.no-timestamp (its folder under exp_root)")
    options = training_options(resolved, save_path, list(extra_options))
    module = "pimm.cli.test" if cfg.train.test else "pimm.train"
    command = training_command(interpreter(resolved, root), cfg.resources.nnodes, nproc, module,
                               ["--config-file", str(config_file), "--options", *options],
                               cfg.rdzv.backend, cfg.rdzv.id, name)

    env, secrets = environment(resolved)
    if launch_command is not None:
        env["PIMM_LAUNCH_COMMAND"] = launch_command
    lines = ["#!/bin/bash", f"# pimm launch: run {name} (site {cfg.site})", "set -eo pipefail"]
    exports = export_lines(env, secrets)
    common = [f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{cfg.resources.cpus_per_proc}}}"',
              f"export PYTHONPATH={shlex.quote(str(IMPORT_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}"]
    if cfg.resources.nnodes > 1:
        common += ['export NODE_RANK="${PIMM_NODE_RANK:-${SLURM_NODEID:-${SLURM_PROCID:?run pimm launch on every node '
                   '(under srun), or set PIMM_NODE_RANK}}}"', *_rendezvous_lines(resolved, name)]
    common.append(f"cd {shlex.quote(str(root))}")
    inner = "\n".join([*cfg.setup, "exec " + _shell_words(command)])
    names = [*env, *secrets, "OMP_NUM_THREADS", "PYTHONPATH"]
    names += ["NODE_RANK", "MASTER_ADDR", "MASTER_PORT"] if cfg.resources.nnodes > 1 else []
    wrapped = wrap_in_container(resolved, inner, root, names)
    body = inner if cfg.container.runtime == "none" else "exec " + wrapped
    script = "\n".join([*lines, *exports, *common, body, ""])
    return LaunchPlan(run_name=name, save_path=save_path, config_file=config_file, repo_root=root,
                      nnodes=cfg.resources.nnodes, nproc_per_node=nproc, options=options, env=env, secrets=secrets,
                      command=command, script=script, display_script=redact_secrets_in_text(script))
