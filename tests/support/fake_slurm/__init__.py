"""A fake SLURM on one machine: ``sbatch``, ``srun``, ``scontrol`` and ``scancel``
executables that run jobs locally, for the ``pimm submit`` tests.

:func:`install` writes the executables (small shell wrappers around
``fake.py``) into a folder and returns the environment to run commands in.
What is emulated (and nothing more):

* ``sbatch SCRIPT`` reads the ``#SBATCH`` lines, prints ``Submitted batch job
  N`` and starts a controller in the background that runs the script with
  bash and SLURM's variables (``SLURM_JOB_ID``, ``SLURM_NNODES``,
  ``SLURM_JOB_NODELIST`` = ``127.0.0.[1-N]``,
  loopback addresses that resolve without a name service, ``SLURM_RESTART_COUNT`` after a
  requeue, ...), appending to the ``--output``/``--error`` files.
* ``srun CMD`` runs one task per node (``SLURM_NODEID``, ``SLURM_PROCID``,
  ...), each task in a session of its own like a process on another host.
* ``scancel --signal=SIG JOB`` signals the job steps like ``slurmstepd``:
  every process of the steps (``proctrack/cgroup``, the default) or only each
  task's process group (``FAKE_SLURM_PROCTRACK=pgid``), never the batch
  shell. This is also how SLURM's ``--signal`` warning reaches a job.
  ``scancel JOB`` cancels the job.
* ``scontrol requeue JOB`` terminates the running attempt (SIGTERM to every
  process of the job, SIGKILL after ``KILL_WAIT_S``) and starts the script
  again with ``SLURM_RESTART_COUNT`` one higher; ``scontrol show hostnames``
  expands a node list.

Jobs live in ``<state>/jobs/<id>/``: ``state`` (RUNNING, COMPLETED, FAILED,
CANCELLED), ``restart_count``, the controller's log.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

__all__ = ["install", "job_state", "wait_for_state"]

COMMANDS = ("sbatch", "srun", "scontrol", "scancel")
FAKE = Path(__file__).resolve().parent / "fake.py"


def install(root: Path, env: dict | None = None) -> dict:
    """Create the fake executables under ``root/bin`` and the state folder
    ``root/state``; return ``env`` with them on PATH."""
    bin_dir, state = Path(root) / "bin", Path(root) / "state"
    bin_dir.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    for name in COMMANDS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKE}" {name} "$@"\n')
        path.chmod(0o755)
    out = dict(os.environ if env is None else env)
    out["PATH"] = f"{bin_dir}{os.pathsep}{out.get('PATH', '')}"
    out["FAKE_SLURM_STATE"] = str(state)
    return out


def job_state(env: dict, job_id: str) -> tuple[str, int]:
    job = Path(env["FAKE_SLURM_STATE"]) / "jobs" / str(job_id)
    state = (job / "state").read_text().strip() if (job / "state").exists() else "PENDING"
    restarts = int((job / "restart_count").read_text()) if (job / "restart_count").exists() else 0
    return state, restarts


def wait_for_state(env: dict, job_id: str, states: tuple[str, ...], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = job_state(env, job_id)
        if state in states:
            return state
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} still {job_state(env, job_id)[0]} after {timeout_s:.0f}s")
