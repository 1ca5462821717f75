"""``pimm submit`` (pimm/tools/submit.py, slurm_task.py).

Fast tests: the ``--dry-run`` script and torchrun command, bad options (exit
2, one ``error:`` line), and the requeue decision of the node task. The slow
test runs a real two-"node" job through the fake SLURM of
``tests/support/fake_slurm`` (sbatch/srun/scancel/scontrol on PATH, jobs run
on this machine): it is pre-empted twice with SLURM's warning signal, once
delivered only to the tasks' process groups (proctrack/pgid: the node task
must forward it to the ranks) and once to every process of the step
(proctrack/cgroup: torchrun must survive it), requeues itself each time and
must end with the weights of an uninterrupted two-process run, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import submit as slurm  # noqa: E402
from pimm.distributed.slurm_task import NodeTask, Rendezvous, master_port, torchrun_command  # noqa: E402
from tests.support import forkserver  # noqa: E402
from tests.support import fake_slurm  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402
from tests.support.run import final_weights, train_losses, write_toy_config  # noqa: E402

PAUSES = (8, 14)  # with stop_check_every=4 the ranks stop at steps 8 and 16 (both mid-epoch)


def _config(directory: Path, save_path: Path, pauses=()) -> Path:
    return write_toy_config(directory, save_path, f'''
custom_imports = ["tests.support.toy", "tests.support.preempt"]
train = dict(type="DefaultTrainer", stop_check_every=4)
hooks.append(dict(type="PauseForSignal", steps={list(pauses)}, directory={str(directory / "markers")!r}))
''')


@pytest.fixture(scope="module", autouse=True)
def _registered():
    import pimm.cli  # noqa: F401  (imported before capturing: later calls print nothing else)


# ----------------------------------------------------------------------------- dry run


def test_dry_run_prints_the_script_and_the_command_each_task_runs(tmp_path):
    cfg = _config(tmp_path, tmp_path / "run")
    cmd = [sys.executable, "-m", "pimm.tools.submit", "--config-file", str(cfg), "--nodes", "2",
           "--gpus-per-node", "4", "--time", "1-01:30:00", "--signal-seconds", "300", "--partition", "gpu",
           "--account", "lab", "--qos", "high", "--mem", "64G", "--slurm-option", "constraint=a100",
           "--slurm-option", "exclusive", "--max-requeues", "5", "--dry-run", "--options", "optimizer.lr=0.02"]
    out = forkserver.run(cmd, capture_output=True, text=True, env=tool_env(), cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    script = text.split("# each task")[0]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --time=1530", "#SBATCH --signal=USR2@300", "#SBATCH --requeue", "#SBATCH --partition=gpu",
                 "#SBATCH --account=lab", "#SBATCH --qos=high", "#SBATCH --mem=64G", "#SBATCH --constraint=a100",
                 "#SBATCH --exclusive", "#SBATCH --open-mode=append", "#SBATCH --cpus-per-task=4",
                 f"#SBATCH --output={tmp_path / 'run' / 'slurm'}/%j_0_log.out"):
        assert line in script.splitlines(), line
    assert "srun --unbuffered" in script and "submitit.core._submit" in script
    assert subprocess.run(["bash", "-n"], input=script.split("\n", 1)[1], text=True).returncode == 0
    assert not (tmp_path / "run").exists()  # a dry run writes nothing

    # The printed command, expanded by bash in a task's environment, is exactly what the task runs.
    line = text.split("node rank, hosts and job id come from SLURM:\n")[1].splitlines()[0]
    env = fake_slurm.install(tmp_path / "fake", tool_env())
    env.update(SLURM_NNODES="2", SLURM_NODEID="1", SLURM_JOB_NODELIST="node[07-08]", SLURM_JOB_ID="123456",
               SLURM_RESTART_COUNT="0")
    printed = subprocess.run(["bash", "-c", f'set -- {line}; printf "%s\\n" "$@"'], capture_output=True, text=True,
                             env=env, check=True).stdout.splitlines()
    args = slurm._parser().parse_args(cmd[3:])
    task = slurm.plan(args).task
    expected = torchrun_command(2, 1, 4, "node07", master_port("123456"), task.attempt_argv(0))
    assert printed == expected
    assert Rendezvous.from_slurm(env) == Rendezvous(2, 1, "node07", master_port("123456"), "123456", 0)
    options = expected[expected.index("--options") + 1:]
    assert options == ["optimizer.lr=0.02", f"save_path={tmp_path / 'run'}", 'preempt_signals=["SIGTERM", "SIGUSR2"]']
    assert "resume=True" not in expected and task.attempt_argv(1)[-1] == "resume=True"


# ----------------------------------------------------------------------------- bad input


def _write_broken(directory: Path) -> Path:
    path = directory / "broken_cfg.py"
    path.write_text("epoch = 3\nbatch_size = = 16\n")
    return path


def _earlier_run(save_path: Path) -> None:
    save_path.mkdir(parents=True)
    (save_path / "metrics.jsonl").write_text('{"step": 1, "epoch": 1, "train/loss": 0.5}\n')


BAD = [
    ("time_format", ["--time", "90"], "--time '90'"),
    ("time_minutes", ["--time", "00:61:00"], "--time '00:61:00'"),
    ("nodes", ["--nodes", "0"], "--nodes 0"),
    ("signal_longer_than_time", ["--time", "00:01:00", "--signal-seconds", "120"], "--signal-seconds 120"),
    ("mem", ["--mem", "64GB"], "--mem '64GB'"),
    ("partition_space", ["--partition", "a b"], "--partition 'a b'"),
    ("own_sbatch_option", ["--slurm-option", "nodes=3"], "--slurm-option nodes"),
    ("procs_with_gpus", ["--gpus-per-node", "2", "--procs-per-node", "2"], "--procs-per-node"),
    ("not_divisible", ["--nodes", "3"], "batch_size=16"),
    ("missing_config", ["--config-file", "{dir}/nope.py"], "nope.py"),
    ("broken_config", ["--config-file", "{broken}"], "broken_cfg.py"),
    ("bad_option", ["--options", "optimizer.lrr=0.1"], "optimizer.lr"),
    ("default_save_path", ["--options", "save_path=exp/default"], "save_path"),
    ("existing_run", [], "already holds a metrics.jsonl"),
    ("unknown_flag", ["--gpus", "2"], "--gpus"),
]


@pytest.mark.parametrize("case,argv,culprit", BAD, ids=[c[0] for c in BAD])
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, case, argv, culprit):
    save_path = tmp_path / "run"
    if case == "existing_run":
        _earlier_run(save_path)
    cfg = _config(tmp_path, save_path)
    broken = _write_broken(tmp_path)
    argv = [a.format(dir=tmp_path, broken=broken) for a in argv]
    base = ["--config-file", str(cfg), "--time", "01:00:00", "--dry-run"]
    if "--config-file" in argv:
        base = base[2:]
    if case == "existing_run":  # a dry run prints the script whatever is on disk; a submission is refused
        base.remove("--dry-run")
    assert slurm.main(base + argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert culprit in lines[0], lines[0]
    assert captured.out == ""


def test_a_dry_run_prints_the_script_whatever_is_on_disk(tmp_path, capsys):
    save_path = tmp_path / "run"
    _earlier_run(save_path)
    before = sorted(p.name for p in save_path.iterdir())
    cfg = _config(tmp_path, save_path)
    assert slurm.main(["--config-file", str(cfg), "--time", "01:00:00", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "#SBATCH" in out and "torchrun" in out
    assert sorted(p.name for p in save_path.iterdir()) == before  # nothing written


def test_without_slurm_a_real_submission_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun, no sbatch
    cfg = _config(tmp_path, tmp_path / "run")
    assert slurm.main(["--config-file", str(cfg), "--time", "01:00:00"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no SLURM here" in err[0] and "--dry-run" in err[0]


# ----------------------------------------------------------------------------- requeue decision


def test_node_task_requeues_only_within_max_requeues(tmp_path):
    task = NodeTask(train_argv=["train.py", "--options", "x=1"], save_path=str(tmp_path), nproc_per_node=1,
                    max_requeues=2)
    task._received.append("SIGUSR2")
    last = Rendezvous(nnodes=2, node_rank=0, master_addr="h", master_port=1, job_id="7", restart_count=2)
    with pytest.raises(RuntimeError, match="not requeued.*--max-requeues 2"):
        task._conclude(last, code=1, first=True)
    records = [json.loads(line) for line in (tmp_path / "slurm" / "submissions.jsonl").read_text().splitlines()]
    assert [(r["event"], r["restart_count"]) for r in records] == [("not_requeued", 2)]
    # Other nodes never requeue; a finished run is never requeued; a failure without the warning is an error.
    assert task._conclude(Rendezvous(2, 1, "h", 1, "7", 0), code=1, first=False)["status"] == "preempted"
    assert task._conclude(Rendezvous(2, 0, "h", 1, "7", 0), code=0, first=True)["status"] == "completed"
    task._received.clear()
    with pytest.raises(RuntimeError, match="torchrun exited with 1"):
        task._conclude(Rendezvous(2, 0, "h", 1, "7", 0), code=1, first=True)
    assert master_port("7") == master_port(7) and 10000 <= master_port("99999999") < 30000


# ----------------------------------------------------------------------------- the requeue chain


def _wait_for_file(path: Path, env: dict, job_id: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        state, _ = fake_slurm.job_state(env, job_id)
        if state not in ("PENDING", "RUNNING") or time.monotonic() > deadline:
            raise AssertionError(f"{path.name} never appeared (job {state})")
        time.sleep(0.2)


def _logs(save_path: Path) -> str:
    parts = [f"--- {p.name} ---\n{p.read_text()[-3000:]}" for p in sorted((save_path / "slurm").glob("*_log.*"))]
    train_log = save_path / "train.log"
    return "\n".join(parts + [f"--- train.log ---\n{train_log.read_text()[-3000:]}" if train_log.exists() else ""])


@pytest.mark.slow
def test_preempted_job_requeues_and_ends_bit_identical(tmp_path):
    cfg = _config(tmp_path, tmp_path / "unused", pauses=PAUSES)
    reference = tmp_path / "reference"
    ref = forkserver.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg), "--num-gpus",
                          "2", "--options", f"save_path={reference}", "hooks.PauseForSignal.steps=[]"],
                         capture_output=True, text=True, env=tool_env(), cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    env = fake_slurm.install(tmp_path / "fake", tool_env())
    save_path = tmp_path / "run"
    submit = subprocess.run([sys.executable, "-m", "pimm.tools.submit", "--config-file", str(cfg), "--nodes",
                             "2", "--time", "00:30:00", "--max-requeues", "2", "--options", f"save_path={save_path}"],
                            capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert submit.returncode == 0, submit.stderr
    job_id = submit.stdout.split()[2].rstrip(":")
    markers = tmp_path / "markers"
    try:
        for pause, proctrack in zip(PAUSES, ("pgid", "cgroup")):
            _wait_for_file(markers / f"paused-{pause}", env, job_id)
            subprocess.run(["scancel", "--signal=USR2", job_id], env=dict(env, FAKE_SLURM_PROCTRACK=proctrack),
                           check=True, timeout=60)
        assert fake_slurm.wait_for_state(env, job_id, ("COMPLETED", "FAILED", "CANCELLED"), 300) == "COMPLETED", \
            _logs(save_path)
    finally:
        subprocess.run(["scancel", job_id], env=env, timeout=60)
        fake_slurm.wait_for_state(env, job_id, ("COMPLETED", "FAILED", "CANCELLED"), 60)

    assert fake_slurm.job_state(env, job_id)[1] == 2  # requeued twice, same job id
    # The ranks see the job's variables (the engine's attempts.jsonl reads them).
    for pause, restarts in zip(PAUSES, (None, "1")):
        seen = json.loads((markers / f"paused-{pause}").read_text())
        assert seen["SLURM_JOB_ID"] == job_id and seen.get("SLURM_RESTART_COUNT") == restarts, seen
    log = (save_path / "train.log").read_text()
    assert "Pre-empted by SIGUSR2 at step 8" in log and "Pre-empted by SIGUSR2 at step 16" in log
    assert "Resumed from step000000008" in log and "Resumed from step000000016" in log
    records = [json.loads(line) for line in (save_path / "slurm" / "submissions.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("restart_count")) for r in records] == [
        ("submit", None), ("start", 0), ("requeue", 0), ("start", 1), ("requeue", 1), ("start", 2)]
    assert all(r["job_id"] == job_id for r in records)
    # torchrun ended on its own after its worker's exit 75 (1), not killed by the signal (-12)
    assert [r["torchrun_exit"] for r in records if r["event"] == "requeue"] == [1, 1]
    assert "resume=True" not in records[1]["command"] and records[3]["command"][-1] == "resume=True"

    done, expected = final_weights(save_path), final_weights(reference)
    assert done["global_step"] == expected["global_step"] == 30
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(done["state_dict"][key], tensor), key
    assert train_losses(save_path) == train_losses(reference)
