"""What each task of a ``pimm submit`` job runs: one per node, torchrun inside.

:class:`NodeTask` is the callable that submitit pickles and runs on every
node (``srun`` starts one task per node). It reads the rendezvous from the
SLURM environment, starts torchrun for this node's ranks, passes the
scheduler's signals on to those ranks, and after a warning signal requeues
the job from the first node.

Rendezvous (static, like ``torchrun --nnodes N --node_rank R``):
``--nnodes`` from ``SLURM_NNODES``, ``--node_rank`` from ``SLURM_NODEID``,
the master address is the first host of ``SLURM_JOB_NODELIST`` (``scontrol
show hostnames``), and the port is derived from the job id, so every node
computes the same endpoint without talking to the others, and a requeued
attempt of the same job uses it again. With the static rendezvous node 0
holds ranks ``0..G-1``: the task that requeues the job runs next to rank 0.

Signal path. SLURM sends the warning signal (``--signal=USR2@S``) to the
processes of the job step; with ``proctrack/cgroup`` that is every process,
with ``proctrack/pgid`` only the task's process group. torchrun starts its
workers in sessions of their own, so this task forwards the pre-emption
signals itself to each worker's process group (found as torchrun's children
in ``/proc``), which works under either plugin; a rank that gets the signal
twice is unaffected (the engine's handler only sets a flag). torchrun itself
is started with those signals ignored, and told not to handle them where it
can be (``--signals_to_handle``, torch >= 2.9): its own handling would kill
the workers after a fixed shutdown timeout (30 s by default) and, on a
second signal, exit before they finished the checkpoint. The ranks agree on
a step, commit a checkpoint and exit 75, and torchrun then exits (with 1:
torchrun reports any non-zero worker exit as 1, so this task decides from
the signal it saw, not from torchrun's exit code).

Requeue. Only the warning signal requeues: SIGTERM alone comes from
``scancel`` (the user wants the job gone) or from a pre-emption that SLURM
requeues itself when the cluster is configured so. After the ranks have
stopped, the task on node 0 runs ``scontrol requeue $SLURM_JOB_ID``, up to
``max_requeues`` times (counted by ``SLURM_RESTART_COUNT``). The requeued
job runs the same script and the same pickled task; any attempt with
``SLURM_RESTART_COUNT > 0`` (our requeue or SLURM's own) adds
``resume=True``, so the run continues exactly from its newest committed
checkpoint in the same ``save_path``.

Why not submitit's ``Checkpointable``: its USR2 handler runs only in the
task of global rank 0 and calls ``checkpoint()`` inside the signal handler,
which would have to block there until a whole tree of torchrun processes
has committed; it counts only time-outs (by a wall-clock guess) against its
limit and re-pickles the callable, while SLURM's own requeues rerun the
original pickle anyway. Here the decision needs no pickled state (it comes
from ``SLURM_RESTART_COUNT``), every node forwards the signal, and the
requeue happens after the ranks exited. submitit still writes the sbatch
script, submits, and runs this task on each node.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pimm.utils.redaction import redact_command, redact_secrets

__all__ = ["NodeTask", "Rendezvous", "torchrun_command", "master_port", "append_record", "child_pids",
           "SUBMISSIONS_FILE"]

SUBMISSIONS_FILE = "submissions.jsonl"
_PORT_BASE, _PORT_SPAN = 10000, 20000  # below Linux's ephemeral range (32768+)
_POLL_S = 0.5


def master_port(job_id: str | int) -> int:
    """The rendezvous port of a job: the same on every node and every attempt."""
    digits = "".join(ch for ch in str(job_id) if ch.isdigit()) or "0"
    return _PORT_BASE + int(digits) % _PORT_SPAN


def append_record(save_path: str | Path, record: dict) -> None:
    """One line in ``save_path/slurm/submissions.jsonl`` (what only the launcher knows;
    secrets in its command lines redacted, :mod:`pimm.utils.redaction`)."""
    path = Path(save_path) / "slurm" / SUBMISSIONS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {key: redact_command(value) if key == "command" and isinstance(value, list) else redact_secrets(value)
              for key, value in record.items()}
    with open(path, "a") as fh:
        fh.write(json.dumps(dict(record, time=round(time.time(), 3))) + "\n")


def _first_host(nodelist: str, environ) -> str:
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=60, check=True, env=dict(environ)).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"cannot expand SLURM_JOB_NODELIST={nodelist!r} with scontrol: {err}") from None
    if not out:
        raise RuntimeError(f"scontrol show hostnames {nodelist!r} printed no host")
    return out[0]


@dataclass
class Rendezvous:
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    job_id: str
    restart_count: int

    @classmethod
    def from_slurm(cls, environ=os.environ) -> "Rendezvous":
        job_id = environ["SLURM_JOB_ID"]
        nnodes = int(environ.get("SLURM_NNODES") or environ.get("SLURM_JOB_NUM_NODES") or 1)
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST", "")
        return cls(nnodes=nnodes, node_rank=int(environ.get("SLURM_NODEID", 0)),
                   master_addr=_first_host(nodelist, environ) if nnodes > 1 else "127.0.0.1",
                   master_port=master_port(job_id), job_id=job_id,
                   restart_count=int(environ.get("SLURM_RESTART_COUNT", 0) or 0))


def _torchrun_takes_signal_list() -> bool:
    from torch.distributed.run import get_args_parser

    known, _ = get_args_parser().parse_known_args(["--signals_to_handle=SIGINT", "train.py"])
    return hasattr(known, "signals_to_handle")


def torchrun_command(nnodes, node_rank, nproc_per_node: int, master_addr, master_port, train_argv: list[str],
                     python: str = sys.executable) -> list[str]:
    """torchrun (as ``python -m torch.distributed.run``) for one node; values may be
    shell placeholders when the command is only printed (``--dry-run``)."""
    cmd = [python, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node_rank}",
           f"--nproc_per_node={nproc_per_node}", f"--master_addr={master_addr}", f"--master_port={master_port}",
           "--max_restarts=0"]
    if _torchrun_takes_signal_list():
        # Without SIGTERM: this task forwards it (see the module docstring).
        cmd.append("--signals_to_handle=SIGINT,SIGHUP,SIGQUIT")
    return cmd + list(train_argv)


def child_pids(pid: int) -> list[int]:
    """Living direct children of ``pid`` (torchrun's workers), from ``/proc``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces: state and parent pid follow its closing bracket.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 1 and fields[0] != "Z" and int(fields[1]) == pid:
            found.append(int(entry))
    return found


@dataclass
class NodeTask:
    """The callable each SLURM task runs (pickled by submitit).

    ``train_argv``: ``tools/train.py --config-file CFG --options ...`` as the
    first attempt runs it; a requeued attempt adds ``resume=True``."""

    train_argv: list[str]
    save_path: str
    nproc_per_node: int
    warning_signal: str = "SIGUSR2"
    max_requeues: int = 3
    _received: list = field(default_factory=list, repr=False)
    _torchrun: subprocess.Popen | None = field(default=None, repr=False)

    def attempt_argv(self, restart_count: int) -> list[str]:
        argv = list(self.train_argv)
        if restart_count > 0:
            if "--options" not in argv:
                argv.append("--options")
            argv.append("resume=True")
        return argv

    # -- signals ----------------------------------------------------------
    def _signals(self) -> list[int]:
        return [signal.SIGTERM, getattr(signal, self.warning_signal)]

    def _on_signal(self, signum, frame) -> None:
        self._received.append(signal.Signals(signum).name)
        proc = self._torchrun
        if proc is None or proc.poll() is not None:
            return
        for pid in child_pids(proc.pid):
            try:
                os.killpg(pid, signum)  # torchrun made each worker a session (and group) leader
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def _ignore_in_child(self) -> None:
        for signum in self._signals():
            signal.signal(signum, signal.SIG_IGN)

    # -- the attempt ------------------------------------------------------
    def __call__(self) -> dict:
        for signum in self._signals():
            signal.signal(signum, self._on_signal)
        rdzv = Rendezvous.from_slurm()
        cmd = torchrun_command(rdzv.nnodes, rdzv.node_rank, self.nproc_per_node, rdzv.master_addr,
                               rdzv.master_port, self.attempt_argv(rdzv.restart_count))
        first = rdzv.node_rank == 0
        if first:
            append_record(self.save_path, {"event": "start", "job_id": rdzv.job_id,
                                           "restart_count": rdzv.restart_count, "nodes": rdzv.nnodes,
                                           "master": f"{rdzv.master_addr}:{rdzv.master_port}", "command": cmd})
        print(f"pimm node task {rdzv.node_rank}/{rdzv.nnodes} (job {rdzv.job_id}, restart "
              f"{rdzv.restart_count}): {' '.join(cmd)}", flush=True)
        code = None
        if self.warning_signal not in self._received:
            self._torchrun = subprocess.Popen(cmd, preexec_fn=self._ignore_in_child)
            # poll() rather than wait(): the signal handler must run while we wait.
            while (code := self._torchrun.poll()) is None:
                time.sleep(_POLL_S)
        return self._conclude(rdzv, code, first)

    def _conclude(self, rdzv: Rendezvous, code: int | None, first: bool) -> dict:
        warned = self.warning_signal in self._received
        if code == 0:
            return {"status": "completed", "job_id": rdzv.job_id, "restart_count": rdzv.restart_count}
        if not warned:
            why = f" after {', '.join(sorted(set(self._received)))}" if self._received else ""
            raise RuntimeError(f"torchrun exited with {code}{why} on node {rdzv.node_rank}; see train.log in "
                               f"{self.save_path} (not requeued: no {self.warning_signal} warning)")
        if not first:
            return {"status": "preempted", "job_id": rdzv.job_id, "restart_count": rdzv.restart_count}
        if rdzv.restart_count >= self.max_requeues:
            append_record(self.save_path, {"event": "not_requeued", "job_id": rdzv.job_id,
                                           "restart_count": rdzv.restart_count,
                                           "reason": f"max_requeues={self.max_requeues} reached"})
            raise RuntimeError(f"pre-empted by {self.warning_signal} but not requeued: the job was already "
                               f"requeued {rdzv.restart_count} times (--max-requeues {self.max_requeues}); "
                               f"continue with resume=True")
        append_record(self.save_path, {"event": "requeue", "job_id": rdzv.job_id,
                                       "restart_count": rdzv.restart_count, "signal": self.warning_signal,
                                       "torchrun_exit": code})
        subprocess.run(["scontrol", "requeue", rdzv.job_id], check=True, timeout=120)
        print(f"pimm: requeued job {rdzv.job_id} ({rdzv.restart_count + 1} of {self.max_requeues})", flush=True)
        return {"status": "requeued", "job_id": rdzv.job_id, "restart_count": rdzv.restart_count}
