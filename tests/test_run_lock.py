"""RunLock: one run per save_path, with real processes (a holder, a second
run, a SIGKILLed holder, a clean exit), in both lock modes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pimm.utils.errors import UserError
from pimm.utils.run_lock import LOCK_NAME, RunLock, RunLockError

ROOT = Path(__file__).resolve().parents[1]

# argv: directory, mode, then "hold" (sleep until killed) or "exit" (return at once).
SCRIPT = """
import sys, time
from pimm.utils.run_lock import RunLock, RunLockError
lock = RunLock(sys.argv[1], mode=sys.argv[2], command="lock-test " + sys.argv[3])
try:
    lock.acquire()
except RunLockError as err:
    print(f"error: {err}", file=sys.stderr)
    sys.exit(2)
print("locked", flush=True)
if sys.argv[3] == "hold":
    time.sleep(600)
"""

MODES = ["flock", "exclusive"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def start_holder(directory: Path, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(directory), mode, "hold"], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "locked":
        proc.kill()
        raise AssertionError(f"holder did not start: {line!r} {proc.stderr.read()}")
    return proc


def run_once(directory: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(directory), mode, "exit"], env=_env(),
                          capture_output=True, text=True, timeout=60)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
    proc.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_second_run_is_refused_then_takes_over_after_kill_and_release_on_exit(tmp_path, mode):
    run_dir = tmp_path / "run"
    holder = start_holder(run_dir, mode)
    try:
        record = json.loads((run_dir / LOCK_NAME).read_text())
        second = run_once(run_dir, mode)
        assert second.returncode == 2
        [line] = second.stderr.strip().splitlines()
        assert line.startswith(f"error: save_path {run_dir} is in use by another run (host {socket.gethostname()}, "
                               f"pid {holder.pid}, started {record['started']}: lock-test hold)")
        assert "choose another save_path" in line
    finally:
        kill(holder)

    # The holder died without releasing: the next run takes over and says so.
    third = run_once(run_dir, mode)
    assert third.returncode == 0, third.stderr
    assert f"taking over the lock of {run_dir} left by pid {holder.pid} on this host" in third.stderr
    # ... and its normal exit released the lock: nothing is left behind.
    assert not (run_dir / LOCK_NAME).exists()
    fourth = run_once(run_dir, mode)
    assert fourth.returncode == 0 and "taking over" not in fourth.stderr


@pytest.mark.slow
def test_locks_on_different_directories_are_independent(tmp_path):
    first = start_holder(tmp_path / "a", "flock")
    try:
        other = run_once(tmp_path / "b", "flock")
        assert other.returncode == 0, other.stderr
        assert run_once(tmp_path / "a", "flock").returncode == 2
    finally:
        kill(first)


@pytest.mark.parametrize("mode", MODES)
def test_same_process_context_manager_and_release(tmp_path, mode):
    with RunLock(tmp_path, mode=mode, command="unit") as lock:
        assert lock.held and lock.used_mode == mode
        assert lock.acquire() is lock  # idempotent
        record = json.loads((tmp_path / LOCK_NAME).read_text())
        assert (record["host"], record["pid"], record["command"]) == (socket.gethostname(), os.getpid(), "unit")
        with pytest.raises(RunLockError) as info:
            RunLock(tmp_path, mode=mode).acquire()  # a second holder, even in this process
        assert f"pid {os.getpid()}" in str(info.value) and isinstance(info.value, UserError)
        assert info.value.holder["token"] == record["token"]
    assert not lock.held and not (tmp_path / LOCK_NAME).exists()


def _foreign_record(path: Path, age_s: float) -> None:
    path.mkdir(parents=True, exist_ok=True)
    record = dict(host="another-host.example", pid=4242, started="2026-01-01 00:00:00 +0000", command="train other")
    (path / LOCK_NAME).write_text(json.dumps(record))
    then = time.time() - age_s
    os.utime(path / LOCK_NAME, (then, then))


@pytest.mark.parametrize("mode", MODES)
def test_record_of_another_host_is_trusted_while_its_heartbeat_is_fresh(tmp_path, mode):
    _foreign_record(tmp_path, age_s=5)
    with pytest.raises(RunLockError) as info:
        RunLock(tmp_path, mode=mode, stale_after_s=300).acquire()
    message = str(info.value)
    assert "host another-host.example, pid 4242, started 2026-01-01 00:00:00 +0000: train other" in message
    assert f"delete {tmp_path / LOCK_NAME}" in message and "\n" not in message
    assert (tmp_path / LOCK_NAME).exists()  # nothing was removed


@pytest.mark.parametrize("mode", MODES)
def test_record_of_another_host_without_heartbeat_is_taken_over(tmp_path, mode):
    _foreign_record(tmp_path, age_s=600)
    messages = []
    with RunLock(tmp_path, mode=mode, stale_after_s=300, warn=messages.append) as lock:
        assert messages == [lock.took_over]
        assert "left by pid 4242 on host another-host.example" in lock.took_over
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()


def test_holder_heartbeat_refreshes_the_lock_file(tmp_path):
    with RunLock(tmp_path, heartbeat_s=0.05):
        path = tmp_path / LOCK_NAME
        then = time.time() - 1000
        os.utime(path, (then, then))
        deadline = time.monotonic() + 30
        while path.stat().st_mtime < then + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert path.stat().st_mtime > then + 1


def test_forked_child_does_not_keep_or_release_the_lock(tmp_path):
    lock = RunLock(tmp_path, mode="flock").acquire()
    try:
        pid = os.fork()
        if pid == 0:  # child (like a data-loader worker): must neither hold nor delete the lock
            held_in_child = lock.held
            lock.release()
            os._exit(1 if held_in_child else 0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert (tmp_path / LOCK_NAME).exists() and lock.held
        with pytest.raises(RunLockError):
            RunLock(tmp_path).acquire()
    finally:
        lock.release()


def test_unwritable_directory_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunLockError, match="cannot create the run directory"):
        RunLock(blocker / "run").acquire()
