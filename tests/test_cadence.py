"""Checkpoint cadence and pre-emption options beyond the defaults, and iterable
data sets (which resume through StatefulDataLoader's own state)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.support.run import final_weights, run_tool, train_losses, write_toy_config

pytestmark = pytest.mark.slow


def _committed_steps(save_path):
    return sorted(int(p.name[4:13]) for p in (save_path / "checkpoints").glob("step*") if (p / "COMMITTED").exists())


def test_wall_clock_saves_happen_between_step_saves(tmp_path):
    save = tmp_path / "run"
    # No step cadence; a wall-clock save is due at every check (every 2 steps).
    cfg = write_toy_config(tmp_path, save, extra=(
        'epoch = 1\nhooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=4),\n'
        '         dict(type="CheckpointSaver", save_every_seconds=1e-6, time_check_every=2, keep_last=100)]\n'))
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr
    assert _committed_steps(save) == [2, 4, 6, 8, 10]  # 10 steps per epoch; step 10 is the epoch-end save


def test_configured_preemption_signal_exits_75_and_resumes_exactly(tmp_path):
    reference = tmp_path / "ref"
    assert run_tool("train", write_toy_config(tmp_path, reference)).returncode == 0
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, extra=(
        'preempt_signals = ["SIGTERM", "SIGUSR2"]\n'
        'hooks = hooks + [dict(type="KillAtStep", step=13, signal_name="SIGUSR2")]\n'))
    first = run_tool("train", cfg)
    assert first.returncode == 75, first.stderr
    assert _committed_steps(save)[-1] == 13
    assert "SIGUSR2" in (save / "train.log").read_text()
    assert run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1").returncode == 0
    ref, got = final_weights(reference), final_weights(save)
    assert all(torch.equal(ref["state_dict"][k], got["state_dict"][k]) for k in ref["state_dict"])
    assert train_losses(reference) == train_losses(save)


def test_unknown_preemption_signal_is_a_config_error(tmp_path):
    cfg = write_toy_config(tmp_path, tmp_path / "run", extra='preempt_signals = ["SIGNOPE"]\n')
    result = run_tool("train", cfg)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "SIGNOPE" in result.stderr


STREAM = """
data = dict(train=dict(type="ToyStream"), val=dict(type="ToyDataset", num_samples=64, seed=1))
train = dict(type="DefaultTrainer", iters_per_epoch=7)
"""


@pytest.mark.parametrize("kill_step,resumed_from", [(12, None), (9, 7)], ids=["mid-epoch", "from-epoch-end"])
def test_iterable_data_set_trains_with_iters_per_epoch_and_resumes_exactly(tmp_path, kill_step, resumed_from):
    reference = tmp_path / "ref"
    result = run_tool("train", write_toy_config(tmp_path, reference, extra=STREAM))
    assert result.returncode == 0, result.stderr
    assert [s for s, _ in train_losses(reference)] == list(range(1, 22))  # 3 epochs x 7 steps
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, extra=STREAM + f'hooks = hooks + [dict(type="KillAtStep", step={kill_step})]\n')
    # Synchronous writes when the test needs a known checkpoint: step 7, the end of epoch 1 (the stream
    # must go on where epoch 1 left it, not restart).
    sync = ("hooks.CheckpointSaver.async_write=False",) if resumed_from else ()
    assert run_tool("train", cfg, *sync).returncode == -9
    resumed = run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1", *sync)
    assert resumed.returncode == 0, resumed.stderr
    if resumed_from:
        assert f"Resumed from step{resumed_from:09d}" in (save / "train.log").read_text()
    ref, got = final_weights(reference), final_weights(save)
    assert all(torch.equal(ref["state_dict"][k], got["state_dict"][k]) for k in ref["state_dict"])
    assert train_losses(reference) == train_losses(save)


def test_iterable_data_set_without_length_needs_iters_per_epoch(tmp_path):
    cfg = write_toy_config(tmp_path, tmp_path / "run", extra=STREAM.replace(", iters_per_epoch=7", ""))
    result = run_tool("train", cfg)
    assert result.returncode == 2, result.stderr
    assert "iters_per_epoch" in result.stderr


def test_iterable_data_set_with_num_samples_sizes_the_epoch(tmp_path):
    save = tmp_path / "run"
    extra = STREAM.replace("dict(type=\"ToyStream\")", "dict(type=\"ToySizedStream\", length=80)").replace(
        ", iters_per_epoch=7", "") + "epoch = 1\n"
    result = run_tool("train", write_toy_config(tmp_path, save, extra=extra))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert max(r["step"] for r in records if "train/loss" in r) == 80 // 16
