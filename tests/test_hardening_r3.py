"""Hardening, round 3 (issue 21): a run lock that holds, signals handled
whatever the hooks, OS errors during a save, dying ranks that explain
themselves, degenerate GRPO rewards, and the smaller promises (EMA file
names, valid test_metrics.json, model.grpo.* and parallel.* options)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pimm.datasets  # noqa: F401  (registers the GRPO data sets and models used in-process)
import pimm.evaluation  # noqa: F401
import pimm.models  # noqa: F401
from tests.support.run import ROOT, env, non_log_lines, run_tool, write_toy_config

HOSTILE = 'custom_imports = ["tests.support.toy", "tests.support.hostile"]\n'


def _start(cfg: Path, *options: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg)]
    if options:
        cmd += ["--options", *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)


def _wait_for(predicate, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def _training(save: Path) -> bool:
    log = save / "train.log"
    return log.exists() and "Train:" in log.read_text()


def _one_error_line(stderr: str) -> str:
    lines = non_log_lines(stderr)  # log lines share stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-3000:]
    return lines[0]


@pytest.fixture
def tmpfs(tmp_path):
    """A tiny file system of our own (needs root; skipped elsewhere)."""
    mounted = []

    def mount(path: Path, options: str) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


# -- the run lock (defects 2 and 9) -----------------------------------------------------------
def test_a_lock_deleted_by_hand_is_written_back_and_still_excludes(tmp_path):
    from pimm.utils.run_lock import RunLock, RunLockError

    warnings = []
    holder = RunLock(tmp_path, heartbeat_s=0.05, warn=warnings.append).acquire()
    try:
        token = holder._record["token"]
        (tmp_path / ".lock").unlink()
        with pytest.raises(RunLockError, match="in use by another run"):
            RunLock(tmp_path).acquire()  # the directory itself is still locked
        _wait_for(lambda: (tmp_path / ".lock").exists(), timeout=10)
        assert json.loads((tmp_path / ".lock").read_text())["token"] == token
        assert any("was deleted while this run held it" in w for w in warnings)
        with pytest.raises(RunLockError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
        holder.check()  # still ours
    finally:
        holder.release()
    assert not (tmp_path / ".lock").exists()


def test_a_lock_taken_by_another_run_stops_the_holder(tmp_path):
    from pimm.utils.run_lock import RunLock, RunLockLost, check_held

    lost = []
    holder = RunLock(tmp_path, mode="exclusive", heartbeat_s=0.05, on_lost=lost.append).acquire()
    intruder = None
    try:
        (tmp_path / ".lock").unlink()
        intruder = RunLock(tmp_path, mode="exclusive", heartbeat_s=3600).acquire()
        with pytest.raises(RunLockLost, match="taken by another run"):
            check_held(tmp_path / "checkpoints")  # what a checkpoint commit calls
        _wait_for(lambda: lost, timeout=10)
        assert "taken by another run" in lost[0]
    finally:
        holder.release()
        if intruder is not None:
            assert (tmp_path / ".lock").exists()  # the holder never deletes a lock that is not its own
            intruder.release()


@pytest.mark.slow
def test_deleting_the_lock_mid_run_does_not_let_a_second_run_in(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 100000\n")
    first = _start(cfg)
    try:
        _wait_for(lambda: _training(save))
        (save / ".lock").unlink()
        second = run_tool("train", cfg, "resume=True")
        assert second.returncode == 2
        assert "is in use by another run" in _one_error_line(second.stderr)
        assert first.poll() is None  # the holder runs on, alone
    finally:
        first.kill()
        first.wait()
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()
             if "train/loss" in line]
    assert len(steps) == len(set(steps))  # one writer: no step twice


def test_an_unusable_lock_is_exit_2_and_never_points_at_a_missing_log(tmp_path, tmpfs):
    save = tmp_path / "run"
    (save / ".lock").mkdir(parents=True)
    cfg = write_toy_config(tmp_path, save, "epoch = 1\n")
    result = run_tool("train", cfg)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert ".lock" in line and "directory" in line and "train.log" not in line
    assert not (save / "train.log").exists()

    readonly = tmpfs(tmp_path / "ro", "size=1m,ro")
    cfg = write_toy_config(tmp_path, readonly / "run", "epoch = 1\n")
    result = run_tool("train", cfg)
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert str(readonly / "run") in line and "train.log" not in line


# -- signals (defect 3) -------------------------------------------------------------------------
@pytest.mark.slow
def test_sigusr1_without_a_hook_is_logged_and_ignored_and_sighup_preempts(tmp_path):
    save = tmp_path / "run"
    # The default hook that serves SIGUSR1 switched off: nothing listens for it.
    cfg = write_toy_config(tmp_path, save, "epoch = 100000\ndefault_hooks = dict(on_demand_validation=None)\n")
    run = _start(cfg)
    try:
        _wait_for(lambda: _training(save))
        run.send_signal(signal.SIGUSR1)
        _wait_for(lambda: "SIGUSR1 received: no hook serves it" in (save / "train.log").read_text(), timeout=60)
        assert run.poll() is None  # it never ends a run
        run.send_signal(signal.SIGHUP)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 75, stderr[-2000:]
    log = (save / "train.log").read_text()
    assert "SIGHUP" in log
    last = json.loads((save / "attempts.jsonl").read_text().splitlines()[-1])
    assert last["exit_code"] == 75
    assert list((save / "checkpoints").glob("step*/COMMITTED"))


def test_sighup_is_a_preemption_signal_whatever_the_config():
    from pimm.engines.control import StopControl

    assert signal.SIGHUP in StopControl(preempt_signals=["SIGUSR2"]).signals
    assert signal.SIGTERM in StopControl(preempt_signals=()).signals


# -- OS errors during a save (defect 6) ----------------------------------------------------------
@pytest.mark.slow
def test_disk_full_during_a_save_is_one_line_naming_the_file_and_enospc(tmp_path, tmpfs):
    disk = tmpfs(tmp_path / "disk", "size=200k")
    save = disk / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 40\n")
    result = run_tool("train", cfg)
    assert result.returncode == 1
    line = _one_error_line(result.stderr)  # no "--- Logging error ---", no traceback
    # Which write meets the full disk first (a checkpoint, model/*.pth or metrics.jsonl) depends on timing.
    assert "No space left on device (ENOSPC)" in line
    assert any(str(save / name) in line for name in ("checkpoints", "model", "metrics.jsonl")), line
    assert "resume=True" in line
    from pimm.engines.state.manager import CheckpointManager

    committed = CheckpointManager(save / "checkpoints").committed()
    assert committed and all(CheckpointManager(save / "checkpoints").verify(p) == "ok" for p in committed)


FULL_DISK_TENSORBOARD = """
import logging, sys
from pimm.engines.observe.writers import MetricsWriter
from pimm.utils.logger import setup_logger
setup_logger(None, rank=0)
run = sys.argv[1]
writer = MetricsWriter(run)
writer.write([{"step": 1, "train/loss": 0.5}], [(True, "mean")])
try:  # fill the file system
    with open(run + "/filler", "wb") as filler:
        while True:
            filler.write(b"x" * 4096)
            filler.flush()
except OSError:
    pass
for step in range(2, 502):  # ~35 KB of events: past the free space left in the event file's last page
    writer._tb.add_scalar("train/late", 1.0, step)
if sys.argv[2] == "close":
    writer.close()
print("done")
"""


@pytest.mark.parametrize("how", ["close", "exit"])
def test_a_full_disk_at_tensorboards_close_is_one_log_line_not_a_traceback(tmp_path, tmpfs, how):
    # Events are appended as they come (pimm/engines/observe/tensorboard_file.py): the first
    # one that finds no space is one log line, the close and the interpreter's exit are silent.
    disk = tmpfs(tmp_path / "disk", "size=64k")
    run = disk / "run"
    result = subprocess.run([sys.executable, "-c", FULL_DISK_TENSORBOARD, str(run), how], capture_output=True,
                            text=True, env=env(), cwd=ROOT, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "done", result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr
    assert not non_log_lines(result.stderr), result.stderr
    errors = [line for line in result.stderr.splitlines() if "TensorBoard: cannot write" in line]
    assert len(errors) == 1 and "No space left on device" in errors[0], result.stderr


def test_a_failed_checkpoint_write_names_the_file_and_the_os_error(tmp_path, monkeypatch):
    import errno

    from pimm.engines.state import manager

    def no_space(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(manager._ChecksummingFile, "write", no_space)
    with pytest.raises(OSError) as caught:
        manager.atomic_torch_save({"w": torch.zeros(3)}, tmp_path / "model" / "model_last.pth")
    assert caught.value.errno == errno.ENOSPC and "model_last.pth" in caught.value.filename


def test_failure_line_points_at_the_log_only_when_it_holds_the_traceback(tmp_path):
    import errno

    from pimm.engines.run.launch import _failure_line
    from pimm.utils.logger import setup_logger

    setup_logger(None)  # no train.log
    line = _failure_line(RuntimeError("boom"), "train")
    assert "train.log" not in line and "PIMM_DEBUG=1" in line
    setup_logger(tmp_path)
    err = OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "x.pth"))
    line = _failure_line(err, "train")
    assert "(EROFS)" in line and "x.pth" in line and line.endswith("(traceback in train.log)")
    assert "Read-only file system" in (tmp_path / "train.log").read_text()
    setup_logger(None)


# -- failures mid-run (defects 7 and 10) -------------------------------------------------------------
@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_reported_on_stderr_and_in_train_log(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, HOSTILE + "hooks = hooks + [dict(type='KillRankAtStep', step=3, rank=1)]\n")
    result = run_tool("train", cfg, num_gpus=2, timeout=300)
    assert result.returncode != 0
    assert "error: rank 1 was killed by signal 9 (SIGKILL)" in result.stderr
    assert "rank 1 was killed by signal 9 (SIGKILL)" in (save / "train.log").read_text()


def test_bad_input_found_mid_run_leaves_its_line_in_train_log(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, HOSTILE + "epoch = 1\nhooks = hooks + [dict(type='BadInputAtStep', step=3)]\n")
    result = run_tool("train", cfg)
    assert result.returncode == 2
    assert "data sample 17 has 3 features" in _one_error_line(result.stderr)
    log = (save / "train.log").read_text()
    assert "error: data sample 17 has 3 features" in log and "step 3" in log


# -- EMA names (11), test_metrics.json (12) ------------------------------------------------------------
def test_two_ema_hooks_with_one_name_are_refused_distinct_names_both_export(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 1\nhooks = hooks + [dict(type='EMAHook'), dict(type='EMAHook')]\n")
    refused = run_tool("train", cfg)
    assert refused.returncode == 2
    assert "2 EMAHook entries share name='ema'" in _one_error_line(refused.stderr)
    assert not (save / "model").exists()
    cfg = write_toy_config(tmp_path, tmp_path / "run2", "epoch = 1\nhooks = hooks + [dict(type='EMAHook'), "
                                                        "dict(type='EMAHook', decay=0.9, name='ema_fast')]\n")
    both = run_tool("train", cfg)
    assert both.returncode == 0, both.stderr[-2000:]
    assert (tmp_path / "run2" / "model" / "model_ema.pth").is_file()
    assert (tmp_path / "run2" / "model" / "model_ema_fast.pth").is_file()
    tags = set().union(*(json.loads(line) for line in (tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()))
    assert "val_ema/acc" in tags and "val_ema_fast/acc" in tags


def test_test_metrics_json_writes_null_for_non_finite_values(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, HOSTILE + "epoch = 1\n")
    assert run_tool("train", cfg).returncode == 0
    cfg = write_toy_config(tmp_path, save, HOSTILE + "hooks = [dict(type='NaNClsEvaluator', num_classes=2)]\n")
    result = run_tool("test", cfg, f"weight={save / 'model' / 'model_last.pth'}")
    assert result.returncode == 0, result.stderr[-2000:]
    text = (save / "test_metrics.json").read_text()
    metrics = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in test_metrics.json"))
    values = metrics["metrics"]["NaNClsEvaluator"]
    assert values["acc_class_empty"] is None and values["ratio"] is None and values["per_class"] == [None, 1.0]
    assert math.isfinite(values["acc"])


# -- options (13, 14) -----------------------------------------------------------------------------
def test_model_grpo_options_are_checked_against_the_objective(tmp_path):
    from pimm.engines.run.launch import load_config
    from pimm.utils.errors import ConfigError

    config = str(ROOT / "configs" / "grpo" / "tracks-grpo.py")
    cfg, _ = load_config(config, [f"save_path={tmp_path / 'g'}", "model.grpo.entropy_coef=0.01"], 1)
    assert cfg.model.grpo.entropy_coef == 0.01
    with pytest.raises(ConfigError, match="did you mean 'model.grpo.entropy_coef'"):
        load_config(config, [f"save_path={tmp_path / 'g'}", "model.grpo.entropy_cof=0.01"], 1)


def test_a_shard_modules_typo_is_caught_on_one_process(tmp_path):
    cfg = write_toy_config(tmp_path, tmp_path / "run", "epoch = 1\n")
    result = run_tool("train", cfg, "parallel.strategy='fsdp'", "parallel.shard_modules=['Linaer']")
    assert result.returncode == 2
    line = _one_error_line(result.stderr)
    assert "parallel.shard_modules" in line and "'Linaer'" in line and "did you mean 'Linear'" in line


# -- GRPO rewards (4) -----------------------------------------------------------------------------------
def _grpo_trainer(tmp_path, **model):
    import tests.support.hostile  # noqa: F401  (registers NaNRewardPolicy)
    from pimm.engines.run.launch import build_trainer
    from pimm.engines.run.runtime import apply_runtime_defaults, validate_runtime
    from pimm.utils.config import Config

    cfg = Config.fromfile(str(ROOT / "configs" / "grpo" / "tracks-grpo.py"))
    apply_runtime_defaults(cfg)
    cfg.save_path = str(tmp_path / "run")
    cfg.batch_size = 8
    cfg.data.train.num_events = 32
    cfg.hooks = []
    cfg.model.update(type="NaNRewardPolicy", **model)
    cfg.train.update({"torch_threads": None, "reward_warn_after": 2})
    validate_runtime(cfg, 1)
    return build_trainer(cfg)


def test_grpo_stops_with_exit_1_when_every_reward_of_an_epoch_is_nan(tmp_path, caplog):
    from pimm.engines.trainers.grpo import DegenerateRewards

    trainer = _grpo_trainer(tmp_path)
    with caplog.at_level("WARNING", logger="pimm"), pytest.raises(DegenerateRewards, match="every reward was NaN"):
        trainer.train()
    assert "every reward was NaN in the last 2 rollouts" in caplog.text
    assert trainer.global_step == 6  # 4 rollouts x 2 updates: stopped when the 4th (last of the epoch) was sampled


def test_grpo_warns_when_no_group_has_a_reward_spread(tmp_path, caplog):
    trainer = _grpo_trainer(tmp_path, constant=True)
    with caplog.at_level("WARNING", logger="pimm"):
        trainer.train()
    assert "no group of trajectories had rewards that differ" in caplog.text


def test_a_failing_background_thread_is_one_log_line_with_its_traceback_in_train_log(tmp_path, capsys):
    # tensorboardX's writer thread on a full disk printed Python's thread traceback on stderr
    import threading

    from pimm.utils.logger import setup_logger

    previous = threading.excepthook  # pytest's own; pimm leaves a hook it did not install alone
    try:
        threading.excepthook = threading.__excepthook__
        setup_logger(tmp_path)

        def fail():
            raise OSError(28, "No space left on device")

        thread = threading.Thread(target=fail, name="tb-writer")
        thread.start()
        thread.join()
    finally:
        threading.excepthook = previous
    err = capsys.readouterr().err
    assert non_log_lines(err) == [], err
    assert "background thread tb-writer failed: OSError: [Errno 28] No space left on device" in err
    assert "Traceback" not in err and "Traceback" in (tmp_path / "train.log").read_text()


def test_a_failed_metrics_write_names_metrics_jsonl(tmp_path):
    # A file's write() error carries no file name; the one error line needs it.
    import errno

    from pimm.engines.observe.writers import MetricsWriter

    class FullDisk:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    writer = MetricsWriter(tmp_path, enable_tensorboard=False)
    writer.write([{"step": 1, "train/loss": 0.5}], [(True, "mean")])
    writer._jsonl = FullDisk()
    with pytest.raises(OSError) as info:
        writer.write([{"step": 2, "train/loss": 0.4}], [(True, "mean")])
    assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / "metrics.jsonl")
