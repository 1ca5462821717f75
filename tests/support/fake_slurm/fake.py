"""The fake SLURM commands (see ``__init__.py``): ``fake.py COMMAND ARGS...``.

A job's processes are kept together the way a cgroup would: the controller
and each ``srun`` make themselves child subreapers, so a process whose parent
died stays in the job's process tree and is signalled and killed with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pimm.distributed.slurm_task import child_pids  # noqa: E402  (the same /proc walk as the node task)

KILL_WAIT_S = 2.0
_PR_SET_CHILD_SUBREAPER = 36


def _state() -> Path:
    return Path(os.environ["FAKE_SLURM_STATE"])


def _write_atomic(path: Path, text: str) -> None:
    # The test polls these files while the controller rewrites them: a plain
    # write_text truncates first, and a read in between saw an empty state.
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _job_dir(job_id: str) -> Path:
    return _state() / "jobs" / str(job_id)


def _fail(message: str) -> int:
    print(f"fake-slurm: error: {message}", file=sys.stderr)
    return 1


def _subreaper() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _descendants(root: int) -> list[int]:
    found, queue = [], [root]
    while queue:
        for child in child_pids(queue.pop()):
            found.append(child)
            queue.append(child)
    return found


def _kill(pids, signum) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _terminate_tree(root: int) -> None:
    """SIGTERM every process under ``root``, SIGKILL what is left after KILL_WAIT_S."""
    _kill(_descendants(root), signal.SIGTERM)
    deadline = time.monotonic() + KILL_WAIT_S
    while _descendants(root) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    _kill(_descendants(root), signal.SIGKILL)
    while _descendants(root):
        _reap()
        time.sleep(0.05)
    _reap()


def expand_hostnames(nodelist: str) -> list[str]:
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            for n in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{n:0{len(low)}d}")
    return hosts


# -- sbatch and the job controller ---------------------------------------------
def sbatch(argv: list[str]) -> int:
    if not argv:
        return _fail("sbatch: no script given")
    script = Path(argv[-1])
    directives = {}
    for line in script.read_text().splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(.*))?$", line.strip())
        if match:
            value = match.group(2)
            directives[match.group(1)] = True if value is None else value.strip("'\"")
    jobs = _state() / "jobs"
    jobs.mkdir(parents=True, exist_ok=True)
    job_id = str(1 + max((int(p.name) for p in jobs.iterdir()), default=0))
    job = _job_dir(job_id)
    job.mkdir()
    (job / "script.sh").write_text(script.read_text())
    (job / "directives.json").write_text(json.dumps(directives))
    _write_atomic(job / "restart_count", "0")
    _write_atomic(job / "state", "PENDING")
    subprocess.Popen([sys.executable, __file__, "_controller", job_id], start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job_id}")
    return 0


def _controller(argv: list[str]) -> int:
    _subreaper()
    job_id = argv[0]
    job = _job_dir(job_id)
    directives = json.loads((job / "directives.json").read_text())
    nodes = int(directives.get("nodes", 1))
    # Loopback addresses as host names: each "node" resolves, all on this machine.
    nodelist = f"127.0.0.[1-{nodes}]" if nodes > 1 else "127.0.0.1"
    log = open(job / "controller.log", "a", buffering=1)
    while True:
        restarts = int((job / "restart_count").read_text())
        for name in ("requeue", "tasks", "steps"):
            (job / name).unlink(missing_ok=True)
        env = dict(os.environ, SLURM_JOB_ID=job_id, SLURM_JOBID=job_id, SLURM_NNODES=str(nodes),
                   SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST=nodelist, SLURM_NODELIST=nodelist,
                   SLURM_JOB_NAME=str(directives.get("job-name", "job")), SLURM_SUBMIT_DIR=os.getcwd(),
                   SLURM_NTASKS_PER_NODE=str(directives.get("ntasks-per-node", 1)), FAKE_SLURM_JOB_ID=job_id)
        env.pop("SLURM_RESTART_COUNT", None)
        if restarts:
            env["SLURM_RESTART_COUNT"] = str(restarts)
        out = str(directives.get("output", f"slurm-{job_id}.out")).replace("%j", job_id)
        err = str(directives.get("error", out)).replace("%j", job_id)
        _write_atomic(job / "state", "RUNNING")
        log.write(f"{time.time():.3f} attempt {restarts} starts\n")
        with open(out, "a") as stdout, open(err, "a") as stderr:
            shell = subprocess.Popen(["bash", str(job / "script.sh")], stdout=stdout, stderr=stderr, env=env)
        outcome = None
        while shell.poll() is None:
            if (job / "requeue").exists():
                outcome = "requeue"
            elif (job / "cancel").exists():
                outcome = "cancel"
            if outcome:
                break
            time.sleep(0.1)
        # The job ends with its batch script: whatever is left of it is killed.
        _terminate_tree(os.getpid())
        code = shell.wait()
        log.write(f"{time.time():.3f} attempt {restarts} ends: {outcome or f'exit {code}'}\n")
        if outcome == "requeue":
            _write_atomic(job / "restart_count", str(restarts + 1))
            continue
        _write_atomic(job / "state", "CANCELLED" if outcome == "cancel" else "COMPLETED" if code == 0 else "FAILED")
        return 0


# -- srun ---------------------------------------------------------------------------
_SRUN_FLAGS = {"--unbuffered", "-u", "--exclusive", "--overlap"}


def srun(argv: list[str]) -> int:
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        token = argv[i]
        if "=" in token:
            key, value = token.split("=", 1)
            options[key] = value
        elif token in _SRUN_FLAGS:
            options[token] = True
        else:
            options[token] = argv[i + 1]
            i += 1
        i += 1
    command = argv[i:]
    job_id = os.environ["SLURM_JOB_ID"]
    job = _job_dir(job_id)
    nodes = int(os.environ.get("SLURM_NNODES", 1))
    per_node = int(os.environ.get("SLURM_NTASKS_PER_NODE", 1))
    ntasks = nodes * per_node
    _subreaper()  # the step's processes stay under srun, like in a cgroup
    with open(job / "steps", "a") as fh:
        fh.write(f"{os.getpid()}\n")
    tasks = []
    for rank in range(ntasks):
        node = rank // per_node
        env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node),
                   SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks), SLURMD_NODENAME=f"127.0.0.{node + 1}")

        def path(key, default):
            return str(options.get(key, default)).replace("%j", job_id).replace("%t", str(rank))

        stdout_path = path("--output", os.devnull)
        with open(stdout_path, "a") as stdout, open(path("--error", stdout_path), "a") as stderr:
            # A session of its own: a task is the process group leader, as on its own node.
            tasks.append(subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, start_new_session=True))
        with open(job / "tasks", "a") as fh:
            fh.write(f"{tasks[-1].pid}\n")
    codes = [task.wait() for task in tasks]
    _terminate_tree(os.getpid())  # the step ends with its tasks
    return next((c for c in codes if c != 0), 0) % 256


# -- scancel / scontrol ----------------------------------------------------------------
def _pids(job: Path, name: str) -> list[int]:
    path = job / name
    return [int(line) for line in path.read_text().split()] if path.exists() else []


def scancel(argv: list[str]) -> int:
    signame, rest, i = None, [], 0
    while i < len(argv):
        token = argv[i]
        if token.startswith("--signal="):
            signame = token.split("=", 1)[1]
        elif token in ("--signal", "-s"):
            signame, i = argv[i + 1], i + 1
        else:
            rest.append(token)
        i += 1
    if len(rest) != 1:
        return _fail("scancel: give one job id")
    job = _job_dir(rest[0])
    if not job.is_dir():
        return _fail(f"scancel: no job {rest[0]}")
    if signame is None:
        (job / "cancel").touch()
        return 0
    name = signame.upper()
    signum = int(name) if name.isdigit() else getattr(signal, name if name.startswith("SIG") else "SIG" + name)
    steps = _pids(job, "steps")
    if not steps:
        return _fail(f"scancel: job {rest[0]} has no running step to signal")
    if os.environ.get("FAKE_SLURM_PROCTRACK", "cgroup") == "pgid":
        for task in _pids(job, "tasks"):
            try:
                os.killpg(task, signum)
            except ProcessLookupError:
                pass
    else:
        for step in steps:
            _kill(_descendants(step), signum)
    return 0


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"] and len(argv) == 3:
        print("\n".join(expand_hostnames(argv[2])))
        return 0
    if len(argv) == 2 and argv[0] == "requeue":
        job = _job_dir(argv[1])
        if not job.is_dir() or (job / "state").read_text() != "RUNNING":
            return _fail(f"scontrol: job {argv[1]} is not running")
        (job / "requeue").touch()
        return 0
    return _fail(f"scontrol: not emulated: {' '.join(argv)}")


COMMANDS = {"sbatch": sbatch, "srun": srun, "scancel": scancel, "scontrol": scontrol, "_controller": _controller}

if __name__ == "__main__":
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
