"""``pimm submit`` with upstream pimm's flags (pimm/cli/submit_upstream.py).

Fast tests: the job ``--dry-run`` prints (the sbatch script of pimm's submitit
path, with the site's account, partition, GPU directive, time, chain and
container), ``--output``, the ``--interactive`` ``salloc ... srun ...`` form,
the chain's decisions, and the one-line refusals (``--submit.host``, Google
Cloud Batch, ``auto`` processes, a local site). Slow tests queue a real job
through the stand-in SLURM of ``tests/support/fake_slurm`` and run an
interactive allocation through a stand-in ``salloc``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pimm.cli import main as pimm_main
from tests.support import fake_slurm
from tests.support.run import ROOT, env as tool_env, write_toy_config

UPSTREAM_LAUNCH = ROOT / "tests" / "support" / "upstream_launch" / "launch"
UPSTREAM_CONFIGS = ROOT / "tests" / "support" / "upstream_configs"
TINY = "tests/tiny_semseg"
SONATA = "panda/pretrain/pretrain-sonata-v1m1-pilarnet-smallmask"


def pimm(capsys, *argv: str) -> tuple[int, str, str]:
    code = pimm_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def sbatch_lines(out: str) -> set[str]:
    return {line for line in out.splitlines() if line.startswith("#SBATCH ")}


def srun_line(out: str) -> str:
    """The job's srun command (it spans lines when a container's inner script does)."""
    start = out.index("\nsrun ") + 1
    return out[start:out.index("\n# each task", start)]


def task_command(out: str) -> list[str]:
    line = out.split("node rank, hosts and job id come from SLURM:\n")[1].splitlines()[0]
    return shlex.split(line)


@pytest.fixture
def in_checkout(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("PIMM_LAUNCH_COMMAND", raising=False)
    monkeypatch.delenv("PIMM_WATCHDOG_CHILD", raising=False)
    return ROOT


@pytest.fixture
def upstream_project(tmp_path, monkeypatch):
    root = tmp_path / "project"
    root.mkdir()
    (root / "configs").symlink_to(UPSTREAM_CONFIGS, target_is_directory=True)
    shutil.copytree(UPSTREAM_LAUNCH, root / "launch")
    monkeypatch.chdir(root)
    monkeypatch.delenv("PIMM_WATCHDOG_CHILD", raising=False)
    return root


# ----------------------------------------------------------------------------- batch: the dry run


def test_the_generic_slurm_site_prints_the_job_it_would_queue(in_checkout, capsys):
    before = set((ROOT / "exp").rglob("*")) if (ROOT / "exp").exists() else set()
    code, out, err = pimm(capsys, "submit", "--site", "slurm", "--train.config", TINY, "--dry-run")
    assert code == 0, err
    lines = sbatch_lines(out)
    for line in ("#SBATCH --nodes=1", "#SBATCH --ntasks-per-node=1", "#SBATCH --gres=gpu:4",
                 "#SBATCH --cpus-per-task=48", "#SBATCH --time=1440", "#SBATCH --signal=USR2@120",
                 "#SBATCH --requeue"):
        assert line in lines, line
    command = task_command(out)
    assert "--nproc_per_node=4" in command
    assert command[command.index("--config-file") + 1] == str(ROOT / "configs" / "tests" / "tiny_semseg.py")
    save_path = next(o for o in command if o.startswith("save_path=")).removeprefix("save_path=")
    assert Path(save_path).parent == ROOT / "exp" / "tests" and Path(save_path).name.startswith("tiny_semseg-20")
    assert "1 attempt(s): requeued" in out and "nothing was queued" in out
    after = set((ROOT / "exp").rglob("*")) if (ROOT / "exp").exists() else set()
    assert after == before


def test_the_cli_reference_submit_example_runs_unmodified(upstream_project, capsys):
    code, out, err = pimm(capsys, "submit", "--site", "nersc", "--resources.nnodes", "2",
                          "--resources.nproc-per-node", "4", "--resources.time", "02:00:00", "--train.config", SONATA,
                          "--dry-run")
    assert code == 0, err
    lines = sbatch_lines(out)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=4", "#SBATCH --time=120",
                 "#SBATCH --account=m5238_g", "#SBATCH --qos=regular", "#SBATCH --constraint=gpu",
                 "#SBATCH --mem=192G", "#SBATCH --cpus-per-task=24"):
        assert line in lines, line
    assert "export NCCL_NET_GDR_LEVEL=PHB" in out and "module load cray-mpich cray-hdf5-parallel nccl" in out
    # exit-before-spend check of the reference
    code, out, err = pimm(capsys, "submit", "--site", "s3df", "--train.config", SONATA, "--dry-run")
    assert code == 0 and "#SBATCH --partition=ampere" in sbatch_lines(out), err
    # s3df names the interpreter: the node task, torchrun and the ranks run on it
    assert f"{upstream_project}/.venv/bin/python -u -m submitit.core._submit" in srun_line(out)


def test_resources_chain_and_options_reach_the_job(in_checkout, capsys, tmp_path):
    from pimm.cli import submit_upstream
    from pimm.cli.launch import resolve_argv

    argv = ["--site", "slurm", "--train.config", TINY, "--resources.nnodes", "2", "--resources.nproc-per-node", "2",
            "--resources.cpus-per-proc", "3", "--resources.account", "lab", "--resources.partition", "gpu",
            "--resources.qos", "high", "--resources.mem", "64G", "--resources.constraint", "a100",
            "--resources.dependency", "afterok:12", "--resources.time", "90", "--resources.signal-delay-s", "300",
            "--resources.gpu-directive", "gpus-per-node", "--resources.job-name", "my job",
            "--chain.jobs", "3", "--chain.resume-first", "--run.name", "long", "--output", str(tmp_path / "job.sh"),
            "--dry-run", "--", "epoch=5", "optimizer.lr=0.01"]
    code, out, err = pimm(capsys, "submit", *argv)
    assert code == 0, err
    lines = sbatch_lines(out)
    for line in ("#SBATCH --nodes=2", "#SBATCH --gpus-per-node=2", "#SBATCH --cpus-per-task=6",
                 "#SBATCH --account=lab", "#SBATCH --partition=gpu", "#SBATCH --qos=high", "#SBATCH --mem=64G",
                 "#SBATCH --constraint=a100", "#SBATCH --dependency=afterok:12", "#SBATCH --time=90",
                 "#SBATCH --signal=USR2@300", "#SBATCH --job-name=my-job"):
        assert line in lines, line
    options = task_command(out)[task_command(out).index("--options") + 1:]
    # the first attempt resumes (--chain.resume-first), the chain is one W&B group, the tail comes last; a
    # named chain keeps one folder (no timestamp); pimm submit appends the absolute save_path and its signals
    assert options == ["resume=True", "wandb_group='long'", "wandb_job_type='train-job'", "epoch=5",
                       "optimizer.lr=0.01", f"save_path={ROOT / 'exp' / 'tests' / 'long'}",
                       'preempt_signals=["SIGTERM", "SIGUSR2"]'], options
    assert "up to 2 time(s)" in out
    written = (tmp_path / "job.sh").read_text()
    assert written.startswith("#!/bin/bash") and "#SBATCH --nodes=2" in written
    assert subprocess.run(["bash", "-n"], input=written, text=True).returncode == 0
    job = submit_upstream.batch_job(resolve_argv(argv, "submit"), argv)
    assert job.task.max_requeues == 2 and job.task.nproc_per_node == 2


def test_containers_wrap_the_node_task(upstream_project, capsys):
    code, out, err = pimm(capsys, "submit", "--site", "s3df-container", "--train.config", TINY, "--dry-run")
    assert code == 0, err
    words = shlex.split(srun_line(out))
    at = words.index("singularity")
    root = str(upstream_project)
    assert words[at:at + 5] == ["singularity", "run", "--nv", "-B",
                                f"/sdf,/fs,/sdf/scratch,/lscratch,{root},{root}:/opt/pimm/src"]
    assert words[at + 5] == "/sdf/data/neutrino/youngsam/images/pimm_v0.5.0.sif"
    assert words[at + 6:at + 10] == ["bash", "--noprofile", "--norc", "-c"]
    assert words[at + 10] == 'exec /opt/pimm/.venv/bin/python "$@"'
    assert words[at + 11:at + 15] == ["pimm-node-task", "-u", "-m", "submitit.core._submit"]

    code, out, err = pimm(capsys, "submit", "--site", "nersc-container", "--train.config", TINY, "--dry-run")
    assert code == 0, err
    assert {"#SBATCH --image=ghcr.io/deeplearnphysics/pimm-nersc:v0.5.0",
            "#SBATCH --module=gpu,nccl-plugin"} <= sbatch_lines(out)
    words = shlex.split(srun_line(out))
    at = words.index("env")
    assert words[at:at + 6] == ["env", "-u", "LD_LIBRARY_PATH", "-u", "LD_PRELOAD", "shifter"]
    inner = words[words.index("-c") + 1]
    assert inner.splitlines()[0] == "export LD_LIBRARY_PATH=/opt/hdf5/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"


def test_secrets_are_not_printed(in_checkout, capsys):
    code, out, err = pimm(capsys, "submit", "--site", "slurm", "--train.config", TINY, "--run.wandb-api-key",
                          "s3cr3t-key", "--dry-run")
    assert code == 0, err
    assert "s3cr3t-key" not in out and "\nexport WANDB_API_KEY\n" in out  # the job gets it from sbatch's environment
    code, out, err = pimm(capsys, "submit", "--site", "slurm", "--interactive", "--train.config", TINY,
                          "--run.wandb-api-key", "s3cr3t-key", "--dry-run")
    salloc = next(l for l in out.splitlines() if l.startswith("salloc "))
    assert code == 0 and "s3cr3t-key" not in out and "wandb-api-key" not in salloc, err  # it goes in the environment


@pytest.mark.parametrize("argv, culprit", [
    (["--submit.host", "login1"], "ssh login1"),
    (["--site", "local"], "pimm launch"),
    (["--resources.nproc-per-node", "auto"], "auto is for pimm launch only"),
    (["--resources.time", "soon"], "--resources.time 'soon' is invalid"),
    (["--chain.jobs", "0"], "--chain.jobs 0 is invalid"),
])
def test_refusals_are_one_line(in_checkout, capsys, argv, culprit):
    code, out, err = pimm(capsys, "submit", "--site", "slurm", "--train.config", TINY, "--dry-run", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and culprit in err, err


def test_google_cloud_batch_is_refused_naming_what_to_use(upstream_project, capsys):
    code, out, err = pimm(capsys, "submit", "--site", "gcloud", "--train.config", TINY, "--dry-run")
    assert code == 2 and err.count("\n") == 1 and "Google Cloud Batch" in err and "pimm launch" in err, err


def test_pimms_own_form_is_kept():
    from pimm.cli.submit_upstream import is_upstream_form

    assert not is_upstream_form(["--config-file", "c.py", "--nodes", "2", "--time", "01:00:00"])
    assert is_upstream_form(["--site", "slurm", "--train.config", "x", "--", "epoch=2"])
    assert is_upstream_form(["--train.config", "x", "--", "--options=1"])  # the tail is not looked at


# ----------------------------------------------------------------------------- interactive


def test_interactive_prints_the_salloc_form(in_checkout, capsys, tmp_path):
    code, out, err = pimm(capsys, "submit", "--site", "slurm", "--interactive", "--train.config", TINY,
                          "--resources.nproc-per-node", "2", "--resources.time", "30", "--resources.qos",
                          "interactive", "--resources.account", "lab", "--run.name", "live",
                          "--output", str(tmp_path / "salloc.sh"), "--dry-run", "--", "epoch=2")
    assert code == 0, err
    line = next(l for l in out.splitlines() if l.startswith("salloc "))
    words = shlex.split(line)
    at = words.index("srun")
    assert words[:at] == ["salloc", "--job-name", words[2], "--nodes", "1", "--ntasks-per-node", "1",
                          "--cpus-per-task", "24", "--account", "lab", "--qos", "interactive", "--time", "00:30:00",
                          "--gres", "gpu:2"]
    assert words[2].startswith("live-20")
    node = words[at + 3:]
    assert node[:4] == [sys.executable, "-m", "pimm.cli", "launch"]
    pinned = len(node) - 1 - node[::-1].index("--run.name")  # after the user's own --run.name: it wins
    assert node[pinned + 1] == words[2] and "--run.no-timestamp" in node
    assert node[-2:] == ["--", "epoch=2"] and "--interactive" not in node and "--dry-run" not in node
    assert "--output" not in node
    written = (tmp_path / "salloc.sh").read_text()
    assert "export PIMM_LAUNCH_COMMAND=" in written and line in written


def test_an_interactive_chain_goes_on_only_after_progress(tmp_path, monkeypatch):
    """The slots of a chain: a pre-empted slot (exit 75) is followed by the next,
    resuming; a slot that fails without a newer checkpoint ends the chain."""
    from pimm.cli import submit_upstream
    from pimm.cli.launch import resolve_argv

    config = write_toy_config(tmp_path, tmp_path / "unused")
    (tmp_path / "configs").mkdir()  # the project: runs go to its exp/
    monkeypatch.chdir(tmp_path)
    resolved = resolve_argv(["--site", "slurm", "--interactive", "--train.config", str(config), "--chain.jobs", "3",
                             "--run.name", "chain"], "submit")
    name, commands = submit_upstream.interactive_commands(resolved, resolved.argv)
    assert len(commands) == 3 and name == "chain"
    assert "--train.resume" not in commands[0] and all("--train.resume" in c for c in commands[1:])

    marks = tmp_path / "marks"

    def slot(code: int) -> list[str]:
        return [sys.executable, "-c", f"open({str(marks)!r}, 'a').write('x'); raise SystemExit({code})"]

    assert submit_upstream.run_chain(resolved, name, [slot(75), slot(0), slot(0)], dict(os.environ)) == 0
    assert marks.read_text() == "xx"  # pre-empted, then done: the third slot is not used
    marks.unlink()
    assert submit_upstream.run_chain(resolved, name, [slot(1), slot(0)], dict(os.environ)) == 1
    assert marks.read_text() == "x"  # failed without progress: no second slot
    marks.unlink()
    model = tmp_path / "exp" / "chain" / "model"
    progress = [sys.executable, "-c", f"import pathlib; pathlib.Path({str(model)!r}).mkdir(parents=True, "
                f"exist_ok=True); (pathlib.Path({str(model)!r}) / 'model_last.pth').write_text('w'); "
                f"open({str(marks)!r}, 'a').write('x'); raise SystemExit(143)"]
    assert submit_upstream.run_chain(resolved, name, [progress, slot(0)], dict(os.environ)) == 0
    assert marks.read_text() == "xx"  # killed at the time limit after a new checkpoint: the next slot resumes


# ----------------------------------------------------------------------------- real jobs (stand-in SLURM)


SALLOC = r"""#!/bin/bash
# A stand-in salloc: an allocation of this machine, then the command (srun ...).
echo "$@" >>"$FAKE_SALLOC_LOG"
nodes=1
while [ $# -gt 0 ] && [ "$1" != srun ]; do
  case "$1" in
    --nodes) nodes=$2; shift 2 ;;
    --*=*) shift ;;
    --*) shift 2 ;;
    *) shift ;;
  esac
done
id=$(( 7000 + RANDOM % 1000 ))
mkdir -p "$FAKE_SLURM_STATE/jobs/$id"
export SLURM_JOB_ID=$id SLURM_JOBID=$id SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes \
       SLURM_JOB_NODELIST=127.0.0.1 SLURM_NTASKS_PER_NODE=1
exec "$@"
"""


def _slurm_env(tmp_path: Path) -> dict:
    env = fake_slurm.install(tmp_path / "fake", tool_env())
    salloc = tmp_path / "fake" / "bin" / "salloc"
    salloc.write_text(SALLOC)
    salloc.chmod(0o755)
    env["FAKE_SALLOC_LOG"] = str(tmp_path / "salloc.log")
    env.pop("PIMM_LAUNCH_COMMAND", None)
    env.pop("PIMM_WATCHDOG_CHILD", None)
    return env


@pytest.mark.slow
def test_an_interactive_allocation_trains_in_the_terminal(tmp_path):
    env = _slurm_env(tmp_path)
    config = write_toy_config(tmp_path, tmp_path / "unused", "epoch = 1\n")
    done = subprocess.run([sys.executable, "-m", "pimm.cli", "submit", "--site", "slurm", "--interactive",
                           "--train.config", str(config), "--paths.repo-root", str(tmp_path),
                           "--resources.nproc-per-node", "1", "--resources.gpu-directive", "none",
                           "--resources.time", "00:10:00", "--run.name", "live", "--run.no-timestamp", "--",
                           "epoch=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    run = tmp_path / "exp" / "live"
    assert (run / "model" / "model_last.pth").is_file()
    assert "--nodes 1" in (tmp_path / "salloc.log").read_text()
    assert "pimm submit --site slurm --interactive" in (run / "run_metadata.json").read_text()


@pytest.mark.slow
def test_a_batch_job_runs_through_pimms_submitit_path(tmp_path):
    env = _slurm_env(tmp_path)
    config = write_toy_config(tmp_path, tmp_path / "unused", "epoch = 1\n")
    done = subprocess.run([sys.executable, "-m", "pimm.cli", "submit", "--site", "slurm", "--train.config",
                           str(config), "--paths.repo-root", str(tmp_path), "--resources.nproc-per-node", "1",
                           "--resources.gpu-directive", "none",
                           "--resources.time", "00:10:00", "--resources.cpus-per-proc", "1", "--chain.jobs", "2",
                           "--run.name", "queued", "--", "epoch=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Submitted job" in done.stdout and "up to 1 times" in done.stdout, done.stdout
    job_id = done.stdout.split("Submitted job ")[1].split(":")[0]
    assert fake_slurm.wait_for_state(env, job_id, ("COMPLETED", "FAILED"), 600) == "COMPLETED"
    run = tmp_path / "exp" / "queued"
    assert (run / "model" / "model_last.pth").is_file()
    assert (run / "slurm" / "submissions.jsonl").is_file()
    assert "#SBATCH --requeue" in next((run / "slurm").glob("*_submission.sh")).read_text()
