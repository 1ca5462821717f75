"""GRPOTrainer: options, step accounting, micro-batching through the real update,
the AMP skip rule, metric reduction by key, and gradient sync across 2 gloo
processes (the latter spawned in-process, marked slow)."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pimm.datasets  # noqa: F401  (registers)
import pimm.evaluation  # noqa: F401
import pimm.models  # noqa: F401
from pimm.engines.observe.metrics import MetricChannel, reduce_op_by_suffix
from pimm.engines.trainers.grpo import combine_micro_batch_metrics, split_rollout
from pimm.engines.run.launch import build_trainer
from pimm.engines.run.runtime import apply_runtime_defaults, validate_runtime
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "grpo" / "tracks-grpo.py"


def _config(save_path, world_size: int = 1, **train) -> Config:
    """The shipped task-1 config, shrunk: 32 events, 8 per rollout, no hooks."""
    cfg = Config.fromfile(CONFIG)
    apply_runtime_defaults(cfg)
    cfg.save_path = str(save_path)
    cfg.batch_size = 8
    cfg.data.train.num_events = 32
    cfg.hooks = []
    cfg.train.update({"torch_threads": None, **train})  # leave the test process's threads alone
    validate_runtime(cfg, world_size)
    return cfg


def _trainer(tmp_path, **train):
    return build_trainer(_config(tmp_path / "run", **train))


def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.model_without_ddp.policy.parameters()])


def _steps(trainer, count: int) -> None:
    """Run ``count`` steps as the loop does (the update index comes from the position)."""
    trainer.start_epoch_data()
    for _ in range(count):
        trainer.run_step()
        trainer.train_state.iter_in_epoch += 1
        trainer.train_state.global_step += 1


# -- pure helpers ------------------------------------------------------------------------------
def test_micro_batch_metrics_add_up_and_min_max_keys_combine():
    outputs = [{"loss": torch.tensor(0.25), "kl": torch.tensor(0.1), "ratio_min": torch.tensor(0.9),
                "ratio_max": torch.tensor(1.1), "per_step": torch.ones(3)},
               {"loss": torch.tensor(0.5), "kl": torch.tensor(0.2), "ratio_min": torch.tensor(0.8),
                "ratio_max": torch.tensor(1.0)}]
    combined = combine_micro_batch_metrics(outputs)
    assert set(combined) == {"loss", "kl", "ratio_min", "ratio_max"}  # non-scalars are not metrics
    assert combined["loss"].item() == 0.75 and combined["kl"].item() == pytest.approx(0.3)
    assert combined["ratio_min"].item() == pytest.approx(0.8) and combined["ratio_max"].item() == pytest.approx(1.1)


def test_split_rollout_keeps_whole_trajectories_and_shares_the_rest():
    rollout = {"trajectories": {"a": torch.arange(10), "b": torch.arange(20).view(10, 2)}, "context": {"x": 1},
               "totals": {"trajectories": 10}}
    parts = split_rollout(rollout, 4)
    assert [p["trajectories"]["a"].tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(p["context"] is rollout["context"] and p["totals"] is rollout["totals"] for p in parts)
    assert torch.equal(torch.cat([p["trajectories"]["b"] for p in parts]), rollout["trajectories"]["b"])
    assert split_rollout(rollout, None) == [rollout] and split_rollout(rollout, 10) == [rollout]


# -- the trainer in one process --------------------------------------------------------------
def test_each_update_is_a_step_and_the_schedule_counts_them(tmp_path):
    trainer = _trainer(tmp_path, policy_updates_per_rollout=3)
    try:
        assert trainer.iters_per_epoch == (32 // 8) * 3
        assert trainer.scheduler.total_steps == trainer.iters_per_epoch * trainer.max_epoch
        _steps(trainer, 4)  # one rollout (3 updates) and the first update of the next
        assert trainer.scheduler.last_epoch == 4
        assert trainer.train_state.samples_seen == 16  # two batches of 8 events
        # mid-rollout, the rollout is part of the checkpoint; its history too
        state = trainer._cache.state_dict()
        assert state["rollout"] is not None and len(state["history"]) == 1
        logged = set(trainer.metrics.flush()[-1])
        assert {"train/reward_mean", "train/kl", "train/clip_frac", "train/grad_norm", "train/length_max"} <= logged
        for _ in range(2):  # updates 2 and 3 of the second rollout
            trainer.run_step()
            trainer.train_state.iter_in_epoch += 1
        # the last update of a rollout logs first/last/mean over its updates, then drops the rollout
        logged = set(trainer.metrics.flush()[-1])
        assert {"train/loss_first", "train/loss_last", "train/loss_mean", "train/kl_mean"} <= logged
        assert trainer._cache.state_dict()["rollout"] is None
    finally:
        trainer.close()


def test_micro_batched_update_equals_the_whole_rollout_update(tmp_path):
    results = []
    for size in (None, 13):  # 64 trajectories per rollout: 5 micro-batches, groups cut
        torch.manual_seed(0)
        trainer = build_trainer(_config(tmp_path / f"run{size}", trajectory_microbatch_size=size,
                                        policy_updates_per_rollout=2))
        try:
            _steps(trainer, 3)
            results.append((_params(trainer), trainer.comm_info["loss"].item()))
        finally:
            trainer.close()
    (whole, loss_whole), (split, loss_split) = results
    assert not torch.equal(whole, _config_initial_params(tmp_path))
    assert torch.allclose(split, whole, rtol=1e-5, atol=1e-6)
    assert loss_split == pytest.approx(loss_whole, rel=1e-4, abs=1e-7)


def _config_initial_params(tmp_path) -> torch.Tensor:
    trainer = build_trainer(_config(tmp_path / "initial"))
    try:
        return _params(trainer)
    finally:
        trainer.close()


class _OverflowingScaler:
    """Stands in for an fp16 GradScaler (CUDA only) that finds inf gradients every time."""

    def __init__(self):
        self.scale_value = 1024.0

    def is_enabled(self):
        return True

    def scale(self, loss):
        return loss * self.scale_value

    def unscale_(self, optimizer):
        pass

    def get_scale(self):
        return self.scale_value

    def step(self, optimizer):
        pass  # skipped: inf found

    def update(self):
        self.scale_value /= 2


def test_a_skipped_amp_step_does_not_advance_the_scheduler(tmp_path):
    trainer = _trainer(tmp_path)
    try:
        trainer.optim_step.scaler = _OverflowingScaler()  # the trainer's update goes through OptimStep
        before = _params(trainer)
        _steps(trainer, 2)
        assert trainer.scheduler.last_epoch == 0  # both steps skipped
        assert torch.equal(_params(trainer), before)
        assert trainer.step_result.stepped is False
        record = trainer.metrics.flush()[-1]
        assert record["train/amp_step_skipped"] == 1.0
        assert trainer.train_state.global_step == 2  # still steps of the run
    finally:
        trainer.close()


@pytest.mark.parametrize("train,match", [
    (dict(policy_updates_per_rollout=0), "policy_updates_per_rollout"),
    (dict(trajectory_microbatch_size=2.5), "trajectory_microbatch_size"),
    (dict(sample_in_eval_mode="yes"), "sample_in_eval_mode"),
    (dict(torch_threads=0), "torch_threads"),
])
def test_bad_trainer_options_are_config_errors(tmp_path, train, match):
    with pytest.raises(ConfigError, match=match):
        _trainer(tmp_path, **train)


def test_grad_accum_steps_and_non_policy_models_are_refused(tmp_path):
    cfg = _config(tmp_path / "a")
    cfg.grad_accum_steps = 2
    with pytest.raises(ConfigError, match="trajectory_microbatch_size"):
        build_trainer(cfg)
    cfg = _config(tmp_path / "b")
    cfg.model = dict(type="DefaultSegmentor", num_classes=3, backbone=dict(type="SparseUNet", in_channels=1,
                                                                            channels=(8, 16), enc_blocks=(1, 1),
                                                                            dec_blocks=(1,)))
    with pytest.raises(ConfigError, match="sample_grpo_batch"):
        build_trainer(cfg)


# -- two gloo processes -------------------------------------------------------------------------
def _two_rank_worker(rank: int, init_file: str, out_dir: str) -> None:
    """One rank: four steps through the DDP wrapper, then four from the same start
    with the loss taken on the bare module; both results saved per rank."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        results = {}
        for mode in ("ddp", "bypass"):
            cfg = _config(Path(out_dir) / mode, world_size=2, policy_updates_per_rollout=2,
                          trajectory_microbatch_size=12)
            trainer = build_trainer(cfg)
            if mode == "bypass":  # the pitfall: the loss of the bare module, which DDP never sees
                trainer._policy_loss = lambda micro, index, t=trainer: t._loss_module(
                    micro, update_index=index, policy_updates_per_rollout=2)
            _steps(trainer, 4)
            results[mode] = {"params": _params(trainer),
                             "reward": trainer.metrics.flush()[-1]["train/reward_mean"]}  # as logged
            trainer.close()
            del trainer  # a DDP model alive when its process group is destroyed can abort the process at exit
        channel = MetricChannel()  # the trainer publishes its metrics with this reduce rule
        scalars = {"score": torch.tensor(float(rank + 1)), "size_min": torch.tensor(rank + 1.0),
                   "size_max": torch.tensor(rank + 1.0), "spread": torch.tensor(10.0 * rank)}
        channel.publish(scalars, reduce={k: reduce_op_by_suffix(k) for k in scalars})
        record = channel.flush()[0]
        results["reduced"] = {k: record[k] for k in scalars}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_two_rank_worker, args=(os.path.join(out_dir, "init"), out_dir), nprocs=2, join=True)
        yield [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(2)]


@pytest.mark.slow
def test_gradients_are_synced_across_two_processes(two_ranks, tmp_path):
    synced = [r["ddp"]["params"] for r in two_ranks]
    unsynced = [r["bypass"]["params"] for r in two_ranks]
    assert not torch.equal(synced[0], _config_initial_params(tmp_path))
    assert torch.equal(synced[0], synced[1])
    # The ranks sampled different events; without the all-reduce they drift apart.
    assert not torch.allclose(unsynced[0], unsynced[1])
    assert not torch.allclose(unsynced[0], synced[0])


@pytest.mark.slow
def test_metrics_reduce_across_ranks_by_key(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["reduced"] == {"score": 1.5, "size_min": 1.0, "size_max": 2.0, "spread": 5.0}
    # logged metrics are reduced before logging: the same on both ranks
    assert two_ranks[0]["ddp"]["reward"] == two_ranks[1]["ddp"]["reward"]
