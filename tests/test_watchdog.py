"""``pimm watchdog ls | rm NAME [--scancel]`` and the scron supervisor that
``pimm submit --interactive --chain.jobs N`` installs (pimm/cli/watchdog.py).

SLURM's ``scrontab``, ``scancel`` and ``squeue`` are stand-ins on PATH: the
scrontab keeps its text in a file, scancel records its arguments, squeue
prints the states a test gives it. The driver script itself runs under bash
with a stub in place of ``pimm submit``.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from pimm.cli import main as pimm_main
from pimm.cli import watchdog
from tests.support.run import ROOT

OTHER = "0 3 * * * /home/me/backup.sh  # not pimm's"
STANDINS = {
    "scrontab": """#!/bin/bash
case "$1" in
  -l) if [ -s "$FAKE_SCRONTAB" ]; then cat "$FAKE_SCRONTAB"; else echo "no crontab for $USER" >&2; exit 1; fi ;;
  -r) rm -f "$FAKE_SCRONTAB" ;;
  *) cp "$1" "$FAKE_SCRONTAB" ;;
esac
""",
    "scancel": '#!/bin/bash\necho "$@" >>"$FAKE_SCANCEL_LOG"\n',
    "squeue": '#!/bin/bash\ncat "$FAKE_SQUEUE" 2>/dev/null\n',
}


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """A project with tests/tiny_semseg, and scrontab/scancel/squeue stand-ins on PATH."""
    project = tmp_path / "project"
    shutil.copytree(ROOT / "configs" / "tests", project / "configs" / "tests")
    shutil.copytree(ROOT / "configs" / "_base_", project / "configs" / "_base_")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SCRONTAB", str(tmp_path / "scrontab.txt"))
    monkeypatch.setenv("FAKE_SCANCEL_LOG", str(tmp_path / "scancel.log"))
    monkeypatch.setenv("FAKE_SQUEUE", str(tmp_path / "squeue.txt"))
    monkeypatch.delenv("PIMM_WATCHDOG_CHILD", raising=False)
    monkeypatch.chdir(project)
    (tmp_path / "scrontab.txt").write_text(OTHER + "\n")
    return project, tmp_path


def pimm(capsys, *argv: str) -> tuple[int, str, str]:
    code = pimm_main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


CHAIN = ["submit", "--site", "slurm", "--interactive", "--chain.jobs", "3", "--resources.account", "lab",
         "--run.name", "long", "--train.config", "tests/tiny_semseg"]


def test_a_chained_interactive_run_installs_its_supervisor(cluster, capsys):
    project, tmp = cluster
    code, out, err = pimm(capsys, *CHAIN, "--", "epoch=2")
    assert code == 0, err
    text = (tmp / "scrontab.txt").read_text()
    assert OTHER in text  # the user's own entries stay
    (entry,) = watchdog.entries(text)
    state = project / "slurm_logs" / "watchdog" / "long"
    assert entry == {"run": "long", "qos": "cron", "job": "long", "driver": str(state / "driver.sh"),
                     "state_dir": str(state)}
    for line in ("#SCRON -A lab", "#SCRON -t 1-00:00:00", "#SCRON -J long-watchdog",
                 f"*/5 * * * * {state / 'driver.sh'}"):
        assert line in text.splitlines(), line
    driver = state / "driver.sh"
    assert os.access(driver, os.X_OK)
    assert subprocess.run(["bash", "-n", str(driver)]).returncode == 0
    script = driver.read_text()
    assert "--chain.jobs 3" in script and "--run.name long --run.no-timestamp" in script and "tail=(epoch=2)" in script
    assert "pimm watchdog rm long" in out

    # Installing again replaces this run's block only.
    code, out, err = pimm(capsys, *CHAIN, "--watchdog.interval-min", "10", "--watchdog.qos", "cron_long")
    assert code == 0, err
    text = (tmp / "scrontab.txt").read_text()
    assert text.count("# >>> pimm-watchdog: long >>>") == 1 and OTHER in text
    assert f"*/10 * * * * {driver}" in text and "#SCRON -q cron_long" in text


def test_a_dry_run_installs_nothing(cluster, capsys):
    project, tmp = cluster
    code, out, err = pimm(capsys, *CHAIN, "--dry-run")
    assert code == 0, err
    assert "# the scrontab block:" in out and "#SCRON -A lab" in out and "#!/bin/bash" in out
    assert (tmp / "scrontab.txt").read_text() == OTHER + "\n"
    assert not (project / "slurm_logs").exists()


def test_scron_needs_an_account(cluster, capsys):
    argv = [a for a in CHAIN if a not in ("--resources.account", "lab")]
    code, out, err = pimm(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and "--resources.account" in err, err


def test_a_key_on_the_command_line_is_not_written_into_the_driver(cluster, capsys):
    project, tmp = cluster
    code, out, err = pimm(capsys, *CHAIN, "--run.wandb-api-key", "s3cr3t-key")
    assert code == 2 and err.count("\n") == 1 and "wandb login" in err and "s3cr3t-key" not in err, err
    assert not (project / "slurm_logs").exists() and (tmp / "scrontab.txt").read_text() == OTHER + "\n"


def test_ls_shows_each_run_and_its_state(cluster, capsys):
    project, tmp = cluster
    code, out, err = pimm(capsys, "watchdog", "ls")
    assert code == 0 and out == "no pimm watchdog is installed\n"
    assert pimm(capsys, *CHAIN)[0] == 0
    state = project / "slurm_logs" / "watchdog" / "long"
    code, out, err = pimm(capsys, "watchdog", "ls")
    assert code == 0 and out.split() == ["long", "idle", str(state)], out
    (tmp / "squeue.txt").write_text("RUNNING\n")
    assert pimm(capsys, "watchdog", "ls")[1].split()[1] == "running"
    (state / "DONE").touch()
    assert pimm(capsys, "watchdog", "ls")[1].split()[1] == "done"


def test_rm_removes_only_that_block_and_scancel_cancels_its_jobs(cluster, capsys):
    project, tmp = cluster
    assert pimm(capsys, *CHAIN)[0] == 0
    code, out, err = pimm(capsys, "watchdog", "rm", "long", "--scancel")
    assert code == 0, err
    assert (tmp / "scrontab.txt").read_text().strip() == OTHER
    assert (tmp / "scancel.log").read_text().splitlines() == ["--name long-watchdog", "--name long"]
    code, out, err = pimm(capsys, "watchdog", "rm", "long")
    assert code == 2 and err.count("\n") == 1 and "no pimm watchdog for run 'long'" in err, err


def test_without_scrontab_the_line_says_so(cluster, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, out, err = pimm(capsys, "watchdog", "ls")
    assert code == 2 and "scrontab is not on PATH" in err and err.count("\n") == 1


# ----------------------------------------------------------------------------- the driver


STUB = """#!/bin/bash
# stands for `pimm submit --interactive ...`: records its call, then does what $STUB_PLAN says
echo "child=$PIMM_WATCHDOG_CHILD job=${SLURM_JOB_ID:-} conf=${SLURM_CONF:-} args=$*" >>"$STUB_LOG"
case "$(cat "$STUB_PLAN")" in
  done) exit 0 ;;
  fail) exit 1 ;;
  progress) mkdir -p "$RUN_DIR/model"; date +%s%N >"$RUN_DIR/model/model_last.pth"; exit 75 ;;
esac
"""


def test_the_driver_resumes_marks_done_and_gives_up_on_repeated_failures(tmp_path):
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    stub.chmod(0o755)
    run_dir, state = tmp_path / "exp" / "long", tmp_path / "state"
    driver = tmp_path / "driver.sh"
    driver.write_text(watchdog.driver_script(run="long", root=tmp_path, save_path=run_dir, state=state,
                                             command=[str(stub), "--chain.jobs", "3"], tail=["epoch=2"]))
    driver.chmod(0o755)
    plan, log = tmp_path / "plan", tmp_path / "stub.log"
    env = dict(os.environ, STUB_PLAN=str(plan), STUB_LOG=str(log), RUN_DIR=str(run_dir),
               SLURM_JOB_ID="55", SLURM_CONF="/etc/slurm.conf")

    def tick(what: str) -> list[str]:
        plan.write_text(what)
        done = subprocess.run([str(driver)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return log.read_text().splitlines() if log.exists() else []

    calls = tick("progress")  # a fresh run: no resume; the slot was pre-empted after a checkpoint
    # scron's own job is not the allocation's (SLURM_* cleared, SLURM_CONF kept)
    assert calls == ["child=1 job= conf=/etc/slurm.conf args=--chain.jobs 3 -- epoch=2"]
    calls = tick("fail")  # a checkpoint exists: the chain resumes
    assert calls[-1] == "child=1 job= conf=/etc/slurm.conf args=--chain.jobs 3 --chain.resume-first -- epoch=2"
    tick("fail")
    assert not (state / "FAILED").exists()
    tick("fail")  # three exits in a row without a newer checkpoint
    assert (state / "FAILED").exists()
    assert len(tick("done")) == 4  # FAILED: the driver no longer starts the chain
    (state / "FAILED").unlink()
    tick("done")
    assert (state / "DONE").exists()
    assert len(tick("done")) == 5  # DONE: nothing more to do
    # one driver at a time: while another holds the lock, a tick returns at once
    (state / "DONE").unlink()
    with open(state / "driver.lock", "w") as held:
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        assert len(tick("done")) == 5
