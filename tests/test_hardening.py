"""Faults a hostile tester tries, through real processes: two runs on one
save_path, checkpoints that are all unusable, SIGTERM during start-up, a rank
that fails alone, a NaN loss, a run that fails before its first step, and the
smaller promises (``--options`` twice, ``~`` in paths, warm-start reports).
(The one-line exit-2 cases are in test_cli_errors.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.support import forkserver
from tests.support.run import ROOT, non_log_lines, env, run_tool, write_toy_config


pytestmark = pytest.mark.slow


def _start(cfg: Path, *options: str, extra_env: dict | None = None) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg)]
    if options:
        cmd += ["--options", *options]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env(), **(extra_env or {})}, cwd=ROOT)


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def test_a_second_run_on_the_same_save_path_exits_2_naming_the_holder(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 100000\n")
    first = _start(cfg)
    try:
        _wait_for(lambda: (save / "train.log").exists() and "Train:" in (save / "train.log").read_text())
        second = run_tool("train", cfg, "resume=True")  # even as a resume: one run at a time
        assert second.returncode == 2
        line = second.stderr.strip()
        assert line.startswith("error: ") and len(line.splitlines()) == 1
        assert f"pid {first.pid}" in line and os.uname().nodename in line
        lines_before = (save / "metrics.jsonl").read_text().count("\n")
        assert lines_before > 0  # the first run still owns and writes its files
    finally:
        first.kill()
        first.wait()
    # The holder died without releasing: the next run takes over, says so, and resumes. Its horizon is
    # lowered to just past the step reached (10 steps an epoch), so the resumed schedule still fits.
    reached = max(json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines())
    third = run_tool("train", cfg, "resume=True", f"epoch={reached // 10 + 2}")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "taking over the lock" in (save / "train.log").read_text()


def test_unusable_checkpoints_stop_a_resume_unless_allow_fresh(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 1\n")
    assert run_tool("train", cfg).returncode == 0
    for common in (save / "checkpoints").glob("step*/common.pth"):
        common.write_bytes(common.read_bytes()[:100])
    refused = run_tool("train", cfg, "resume=True")
    assert refused.returncode == 2 and "no checkpoint in" in refused.stderr and "allow_fresh" in refused.stderr
    fresh = run_tool("train", cfg, "resume='allow_fresh'")
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    log = (save / "train.log").read_text()
    assert "holds no usable checkpoint: starting a fresh run" in log
    # The damaged checkpoint was healed by the new save of the same step, its copy kept aside.
    assert list((save / "checkpoints").glob(".damaged-step*"))


def test_sigterm_while_data_sets_are_built_exits_75_with_a_clear_line(tmp_path):
    marker = tmp_path / "building"
    cfg = write_toy_config(tmp_path, tmp_path / "run", f"""
data = dict(train=dict(type="SlowToyDataset", build_seconds=60, marker={str(marker)!r}, num_samples=64),
            val=dict(type="ToyDataset", num_samples=16))
""")
    proc = _start(cfg)
    _wait_for(marker.exists)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 75
    # the log lines written before the signal are on stderr too (logs go to stderr, like Python's logging)
    assert non_log_lines(stderr) == [
        "error: pre-empted by SIGTERM during start-up, before training began; nothing was lost: rerun with "
        "resume=True (exit code 75)"]


def test_a_rank_that_fails_alone_leaves_its_traceback_in_train_log(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "hooks = hooks + [dict(type='RaiseAtStep', step=3, rank=1)]\n")
    result = run_tool("train", cfg, num_gpus=2, timeout=300)
    assert result.returncode == 1
    log = (save / "train.log").read_text()
    assert "[rank1]" in log and "RuntimeError: boom at step 3 on rank 1" in log and "Traceback" in log


def test_non_finite_loss_exits_1_naming_the_step_and_keeps_metrics_valid(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "hooks = hooks + [dict(type='NaNAtStep', step=6, priority='LOWEST')]\n")
    result = run_tool("train", cfg)
    assert result.returncode == 1
    assert "train/loss is not finite at step 7" in result.stderr
    rows = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]  # all valid JSON
    assert any(r.get("train/loss", 0) is None for r in rows)
    newest = sorted(p.name for p in (save / "checkpoints").glob("step*"))[-1]
    assert newest == "step000000005-epoch0000"  # the last good checkpoint, untouched


def test_a_run_that_fails_before_its_first_step_does_not_block_the_rerun(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 1\n")
    broken = run_tool("train", cfg, "model.dim=4")  # does not fit the 8-feature data: fails in the first step
    assert broken.returncode == 2 and "first training batch" in broken.stderr
    fixed = run_tool("train", cfg)
    assert fixed.returncode == 0, fixed.stderr[-2000:]
    # The broken run's config.py is kept beside the new one, never replaced.
    assert "dim=4" in (save / "config.prev1.py").read_text()
    assert "dim=4" not in (save / "config.py").read_text()


def test_options_given_twice_merge_and_tilde_paths_expand(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    cfg = write_toy_config(tmp_path, Path("~/runs/toy"), "")
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg),
           "--options", "epoch=1", "--options", "batch_size=32"]
    result = forkserver.run(cmd, capture_output=True, text=True, env={**env(), "HOME": str(home)}, cwd=ROOT,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    written = (home / "runs" / "toy" / "config.py").read_text()
    assert "epoch = 1" in written and "batch_size = 32" in written
    assert f"save_path = {str(home / 'runs' / 'toy')!r}" in written


def test_warm_start_reports_what_loaded_and_what_was_skipped(tmp_path):
    from tests.support.toy import ToyMLP

    donor = ToyMLP(hidden=32, num_classes=3).state_dict()  # the head has another shape
    torch.save({"state_dict": donor}, tmp_path / "donor.pth")
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, "epoch = 1\n")
    result = run_tool("train", cfg, f"weight={tmp_path / 'donor.pth'}")
    assert result.returncode == 0, result.stderr[-2000:]
    log = (save / "train.log").read_text()
    assert "Loaded 2/4 model tensors" in log
    assert "Shape-mismatched (skipped): net.3.weight (3, 32) vs model (2, 32), net.3.bias" in log
