"""Iterable (streaming) training data with upstream pimm's meanings: ``num_samples()``
is the whole stream, floored per process and batch; the top-level
``iters_per_epoch`` key sets the epoch length. A 2-process run over a sharded
stream trains the expected number of steps and resumes exactly (slow)."""

from __future__ import annotations

import json

import pytest
import torch

from pimm.engines.run.data import stream_batches_per_rank
from pimm.utils.errors import ConfigError
from tests.support.run import final_weights, non_log_lines, run_tool, train_losses, write_toy_config
from tests.support.streams import ToyShardedStream

STREAM = """
custom_imports = ["tests.support.toy", "tests.support.streams"]
data = dict(train=dict(type="ToyShardedStream", length=80), val=dict(type="ToyDataset", num_samples=32, seed=1))
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=4),
         dict(type="CheckpointSaver", save_freq=3, keep_last=2, async_write=False), dict(type="KillAtStep", step=-1)]
"""


class _Stream(torch.utils.data.IterableDataset):
    def __init__(self, count):
        self.count = count

    def num_samples(self):
        return self.count

    def __iter__(self):
        return iter(())


def test_num_samples_is_the_whole_stream_floored_per_rank_and_batch():
    assert stream_batches_per_rank(_Stream(80), world_size=1, batch_size=16) == 5
    assert stream_batches_per_rank(_Stream(80), world_size=2, batch_size=8) == 5
    assert stream_batches_per_rank(_Stream(83), world_size=2, batch_size=8) == 5  # 41 per rank -> 5 batches
    assert stream_batches_per_rank(_Stream(80), world_size=4, batch_size=8) == 2  # 20 per rank
    with pytest.raises(ConfigError, match="set iters_per_epoch"):
        stream_batches_per_rank(object(), 1, 8)
    with pytest.raises(ConfigError, match=r"num_samples\(\) returned '80'"):
        stream_batches_per_rank(_Stream("80"), 1, 8)


def test_the_sharded_stream_gives_each_rank_its_share_and_then_runs_out():
    stream = ToyShardedStream(length=10)
    first = list(stream)
    assert len(first) == 10 and stream.position == 10
    second = list(stream)  # the next epoch: other samples
    assert len(second) == 10 and not torch.equal(first[0]["x"], second[0]["x"])


def _steps(save):
    return [s for s, _ in train_losses(save)]


@pytest.mark.slow
def test_top_level_iters_per_epoch_sets_the_epoch_and_must_agree_with_the_train_option(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, extra=STREAM + "epoch = 2\niters_per_epoch = 2\n")
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr
    assert _steps(save) == list(range(1, 5))  # not the 5 per epoch num_samples() gives
    clash = run_tool("train", cfg, "train.iters_per_epoch=4", "save_path=" + str(tmp_path / "clash"))
    assert clash.returncode == 2
    lines = non_log_lines(clash.stderr)  # log lines share stderr
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert "iters_per_epoch=2 and train.iters_per_epoch=4 disagree" in lines[0]


@pytest.mark.slow
def test_two_processes_over_a_sharded_stream_train_upstreams_step_count_and_resume_exactly(tmp_path):
    # 80 samples in the stream, 2 processes, 8 per process and batch: 80 // 2 // 8 = 5 steps per epoch.
    # (Read as a per-process count, 80 // 8 = 10 steps would run the shards dry after 5.)
    extra = STREAM + "epoch = 3\n"
    reference = tmp_path / "ref"
    result = run_tool("train", write_toy_config(tmp_path, reference, extra=extra), num_gpus=2)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _steps(reference) == list(range(1, 16))
    assert "Train: [3/3][5/5]" in (reference / "train.log").read_text()

    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, extra=extra)
    killed = run_tool("train", cfg, "hooks.KillAtStep.step=8", num_gpus=2)
    assert killed.returncode != 0
    resumed = run_tool("train", cfg, "resume=True", num_gpus=2)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step000000006" in (save / "train.log").read_text()  # mid-epoch 2
    ref, got = final_weights(reference)["state_dict"], final_weights(save)["state_dict"]
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert train_losses(save) == train_losses(reference) and records[-1]["step"] == 15
