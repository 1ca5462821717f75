"""GRPOTrainer on a policy written for upstream pimm (tests/support/upstream_grpo.py):
upstream's chunking, weighting, output combination and metric names, both step
counts (``step_per``), the gradient of a chunked update, the batch statistics in
the trace, and SIGKILL + resume through tools/train.py for both step counts
(those marked slow)."""

from __future__ import annotations

import copy
import io
import json
import statistics
from types import SimpleNamespace

import pytest
import torch

from tests.support.upstream_grpo import Trajectory  # registers UpstreamBandit
from pimm.engines.run.launch import build_trainer
from pimm.engines.run.runtime import apply_runtime_defaults, validate_runtime
from pimm.engines.trainers.grpo_upstream import (combine_chunk_outputs, is_upstream_rollout, summarize_updates,
                                                 upstream_chunks)
from pimm.utils.config import Config
from pimm.utils.errors import UserError
from tests.support.run import ROOT, final_weights, run_tool

CONFIG = f"""
_base_ = {str(ROOT / "configs" / "_base_" / "default_runtime.py")!r}
custom_imports = ["tests.support.toy", "tests.support.upstream_grpo"]
seed = 3
epoch = 2
batch_size = 4
num_worker = 0
model = dict(type="UpstreamBandit", num_actions=4, steps=2, num_generations=6)
data = dict(train=dict(type="ToyDataset", num_samples=64))
optimizer = dict(type="Adam", lr=0.03)
train = dict(type="GRPOTrainer", policy_updates_per_rollout=2, trajectory_microbatch_size=3, torch_threads=1)
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=5),
         dict(type="CheckpointSaver", save_freq=3, keep_last=2, async_write=False), dict(type="KillAtStep", step=-1)]
"""


def _config(tmp_path, **overrides) -> Config:
    path = tmp_path / "cfg.py"
    path.write_text(CONFIG + f"save_path = {str(tmp_path / 'run')!r}\n")
    cfg = Config.fromfile(path)
    apply_runtime_defaults(cfg)
    cfg.hooks = []
    cfg.train.update({"torch_threads": None})
    for key, value in overrides.items():
        if key.startswith("train."):
            cfg.train[key[6:]] = value
        else:
            cfg[key] = value
    validate_runtime(cfg, 1)
    return cfg


def _records(save) -> list[dict]:
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


# -- the rules, on plain dicts ---------------------------------------------------------------
def _traj(reward):
    return SimpleNamespace(metrics={"reward": reward, "length": 2.0})


def _rollout():
    events = [{"trajectories": [_traj(r) for r in (1.0, 0.0, 0.5, 0.5, 1.0)], "advantages": torch.arange(5.0),
               "step_advantages": torch.arange(10.0).view(5, 2), "reward_std": 0.4, "rloo_score_mean": 0.6,
               "own": "kept"},
              {"trajectories": [_traj(0.0), _traj(1.0)], "advantages": torch.tensor([-1.0, 1.0]),
               "reward_std": 0.7, "rloo_score_mean": 0.5}]
    return {"events": events, "metric_count": 7, "metric_sums": {"reward": 4.0, "length": 14.0},
            "reward_stds": [0.4, 0.7], "rloo_score_means": [0.6, 0.5], "rloo_score_stds": [0.1, 0.2], "extra": 1}


def test_events_are_sliced_into_weighted_chunks_as_upstream_does():
    rollout = _rollout()
    assert is_upstream_rollout(rollout) and not is_upstream_rollout({"trajectories": {}})
    chunks = upstream_chunks(rollout, 2)
    # event 0 (5 trajectories) -> 2 + 2 + 1, event 1 -> 2; never across events
    assert [c["metric_count"] for c, _ in chunks] == [2, 2, 1, 2]
    assert [w for _, w in chunks] == [2 / 7, 2 / 7, 1 / 7, 2 / 7]
    second = chunks[1][0]
    assert second["events"][0]["advantages"].tolist() == [2.0, 3.0]
    assert second["events"][0]["step_advantages"].tolist() == [[4.0, 5.0], [6.0, 7.0]]
    assert second["events"][0]["own"] == "kept" and second["extra"] == 1
    assert second["metric_sums"] == {"reward": 1.0, "length": 4.0}
    assert second["reward_stds"] == [0.4] and second["rloo_score_means"] == [0.6]
    assert second["rloo_score_stds"] == [0.1, 0.2]  # the event has no rloo_score_std: left as it was
    assert chunks[3][0]["reward_stds"] == [0.7] and "step_advantages" not in chunks[3][0]["events"][0]
    assert rollout["metric_count"] == 7 and len(rollout["events"][0]["trajectories"]) == 5  # not modified
    assert upstream_chunks(rollout, None) == [(rollout, None)]


def test_chunk_outputs_combine_by_key_and_updates_summarize():
    outputs = [({"loss": torch.tensor(1.0), "rl_log_ratio_min": torch.tensor(-0.1), "rl_log_ratio_max": torch.tensor(
        0.2), "rl_advantage_abs_max": torch.tensor(3.0), "note": "first"}, 0.25),
               ({"loss": torch.tensor(2.0), "rl_log_ratio_min": torch.tensor(-0.3), "rl_log_ratio_max": torch.tensor(
                   0.1), "rl_advantage_abs_max": torch.tensor(1.0), "note": "second"}, 0.75)]
    combined = combine_chunk_outputs(outputs)
    assert combined["loss"].item() == pytest.approx(1.75)  # weighted sum
    assert combined["rl_log_ratio_min"].item() == pytest.approx(-0.3)
    assert combined["rl_log_ratio_max"].item() == pytest.approx(0.2)
    assert combined["rl_advantage_abs_max"].item() == 3.0 and combined["note"] == "first"
    history = [{"rl_pg_loss": torch.tensor(1.0), "rl_kl": torch.tensor(0.5), "other": torch.tensor(9.0)},
               {"rl_pg_loss": torch.tensor(3.0), "rl_kl": torch.tensor(0.7)}]
    summary = summarize_updates(history)
    assert {k: round(v.item(), 6) for k, v in summary.items()} == {
        "rl_pg_loss_update0": 1.0, "rl_pg_loss_last": 3.0, "rl_pg_loss_mean_update": 2.0,
        "rl_kl_update0": 0.5, "rl_kl_last": 0.7, "rl_kl_mean_update": 0.6}  # only upstream's rl_* keys


# -- the trainer in one process ------------------------------------------------------------------
def test_the_chunked_update_is_the_weighted_sum_of_chunk_gradients(tmp_path):
    cfg = _config(tmp_path, optimizer=dict(type="SGD", lr=1.0), **{"train.policy_updates_per_rollout": 2})
    trainer = build_trainer(cfg)
    try:
        before = copy.deepcopy(trainer.model_without_ddp)
        trainer.start_epoch_data()
        trainer.run_step()  # samples the rollout, first update
        rollout = trainer._cache.rollout
        assert is_upstream_rollout(rollout) and len(rollout["events"]) == 4
        # By hand: every chunk's mean loss weighted by its trajectory count ...
        by_hand = sum(before.grpo_loss_from_batch(chunk)["loss"] * weight for chunk, weight in upstream_chunks(
            rollout, 3))
        grads = torch.autograd.grad(by_hand, list(before.parameters()))
        # ... which, for a loss that is a mean over trajectories, is the whole rollout's loss.
        whole = torch.autograd.grad(before.grpo_loss_from_batch(rollout)["loss"], list(before.parameters()))
        for g, w in zip(grads, whole):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
        for p0, p1, g in zip(before.parameters(), trainer.model_without_ddp.parameters(), grads):
            torch.testing.assert_close(p1.detach(), p0.detach() - g, rtol=1e-5, atol=1e-7)  # SGD, lr 1
        logged = trainer.metrics.flush()[-1]
        # chunk means weighted by metric_count add up to the rollout's mean; the weights add up to 1
        assert logged["train/chunk_reward_mean"] == pytest.approx(logged["train/reward_mean"], abs=1e-6)
        assert logged["train/chunks_seen"] == pytest.approx(1.0)
        everything = [t.metrics["reward"] for e in rollout["events"] for t in e["trajectories"]]
        assert logged["train/reward_mean"] == pytest.approx(statistics.mean(everything), abs=1e-6)
        assert logged["train/rl_advantage_abs_max"] == pytest.approx(
            max(float(e["advantages"].abs().max()) for e in rollout["events"]))
        assert "train/note" not in logged and "train/rl_pg_loss_update0" not in logged  # first of 2 updates
    finally:
        trainer.close()


def test_upstream_policy_trains_unmodified_and_its_reward_rises_whatever_a_step_counts(tmp_path):
    """train = dict(type="GRPOTrainer", policy_updates_per_rollout=2, trajectory_microbatch_size=3):
    the reward rises, and step_per changes only the counting: the same updates, the same weights."""
    rollouts, weights = 6 * 64 // 4, {}
    for step_per, steps_per_rollout in (("update", 2), ("rollout", 1)):
        run = tmp_path / step_per
        run.mkdir()
        trainer = build_trainer(_config(run, epoch=6, **{"train.step_per": step_per}))
        try:
            assert trainer.iters_per_epoch * trainer.max_epoch == rollouts * steps_per_rollout
            assert trainer.scheduler.total_steps == rollouts * 2  # the scheduler counts updates either way
            trainer.train()
            assert trainer.optimizer.state_dict()["state"][0]["step"].item() == rollouts * 2
            weights[step_per] = copy.deepcopy(trainer.model_without_ddp.state_dict())
        finally:
            trainer.close()
        records = _records(run / "run")
        assert [r["step"] for r in records] == list(range(1, rollouts * steps_per_rollout + 1))
        rewards = [r["train/reward_mean"] for r in records][::steps_per_rollout]  # one per rollout
        first, last = statistics.mean(rewards[:4]), statistics.mean(rewards[-10:])
        assert rewards[0] < 0.4 and last > 0.75 and last > first + 0.4, (rewards[:4], last)  # random: 0.25
        summaries = [r for r in records if "train/rl_pg_loss_update0" in r]
        assert len(summaries) == rollouts  # once per rollout: at its last update
        assert {"train/rl_pg_loss_last", "train/rl_pg_loss_mean_update", "train/rl_log_ratio_min_update0",
                "train/rl_clip_frac_mean_update", "train/grad_norm", "train/lr"} <= set(summaries[-1])
        if step_per == "rollout":  # one record per rollout: the last update's values, loss = mean over updates
            assert records[-1]["train/rl_pg_loss"] == records[-1]["train/rl_pg_loss_last"]
            assert records[-1]["train/loss"] == pytest.approx(records[-1]["train/rl_pg_loss_mean_update"], abs=1e-6)
    assert all(torch.equal(weights["update"][k], weights["rollout"][k]) for k in weights["update"])


def test_a_malformed_upstream_rollout_is_one_clear_error(tmp_path):
    trainer = build_trainer(_config(tmp_path))
    try:
        model = trainer.model_without_ddp
        real = model.sample_grpo_batch

        def broken(batch):
            rollout = real(batch)
            rollout["events"][1]["advantages"] = rollout["events"][1]["advantages"][:-1]
            return rollout

        model.sample_grpo_batch = broken
        trainer.start_epoch_data()
        with pytest.raises(UserError, match="event 1 needs 'advantages', one per trajectory \\(6\\); got 5"):
            trainer.run_step()
    finally:
        trainer.close()


# -- through tools/train.py ------------------------------------------------------------------------
def _train(cfg, *options, expect=0, num_gpus=1):
    result = run_tool("train", cfg, *options, num_gpus=num_gpus, timeout=600)
    assert result.returncode == expect, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("step_per,kill,num_gpus", [("update", 5, 1), ("rollout", 11, 1), ("update", 5, 2)],
                         ids=["per-update", "per-rollout", "per-update-2proc"])
def test_sigkill_and_resume_is_bit_identical(tmp_path, step_per, kill, num_gpus):
    text = CONFIG + f'train = dict(train, step_per="{step_per}")\nstructured_logging = dict(enabled=True)\n'
    saves = {}
    for name in ("ref", "killed"):
        path = tmp_path / f"{name}.py"
        saves[name] = tmp_path / name
        path.write_text(text + f"save_path = {str(saves[name])!r}\n")
        saves[name + "_cfg"] = path
    _train(saves["ref_cfg"], num_gpus=num_gpus)
    killed = -9 if num_gpus == 1 else 1  # the launcher reports a rank killed by a signal as 1
    _train(saves["killed_cfg"], f"hooks.KillAtStep.step={kill}", expect=killed, num_gpus=num_gpus)
    _train(saves["killed_cfg"], "resume=True", num_gpus=num_gpus)
    assert "Resumed from step" in (saves["killed"] / "train.log").read_text()
    got, want = final_weights(saves["killed"])["state_dict"], final_weights(saves["ref"])["state_dict"]
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert _records(saves["killed"]) == _records(saves["ref"])
    # the rollouts' batch statistics are in the trace
    trace = [json.loads(line) for path in sorted((saves["ref"] / "trace").glob("rank*.jsonl"))
             for line in path.read_text().splitlines()]
    stats = [r["args"] for r in trace if r.get("ph") == "C" and r.get("name") == "rollout"]
    per_rank = 4 // num_gpus
    assert len(stats) == 2 * 64 // 4 * num_gpus  # every rank, every rollout of the 2 epochs
    assert {tuple(sorted(s.items())) for s in stats} == {
        (("actions", per_rank * 6 * 2), ("events", per_rank), ("trajectories", per_rank * 6))}


def test_step_per_is_checked_and_a_microbatch_size_of_0_is_upstreams_no_split(tmp_path):
    from pimm.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="train.step_per='epoch' is invalid: use 'update'"):
        build_trainer(_config(tmp_path, **{"train.step_per": "epoch"}))
    trainer = build_trainer(_config(tmp_path, **{"train.trajectory_microbatch_size": 0}))
    try:
        assert trainer.trajectory_microbatch_size is None
        trainer.start_epoch_data()
        trainer.run_step()
        logged = trainer.metrics.flush()[-1]
        assert "train/reward_mean" not in logged  # _rollout_metric_tensors: micro-batched updates only
        assert logged["train/chunks_seen"] == 1.0  # one unweighted call
    finally:
        trainer.close()


def test_a_checkpoint_resumes_only_with_the_step_count_it_was_written_with():
    from pimm.engines.trainers.grpo_state import RolloutCache
    from pimm.utils.errors import CheckpointError

    saved = RolloutCache(torch.device("cpu"), "update")
    saved.start({"events": [{"trajectories": [Trajectory(torch.tensor([1, 2]), torch.zeros(2), 0.5)],
                             "advantages": torch.zeros(1)}]}, batch=None)
    blob = io.BytesIO()
    torch.save(saved.state_dict(), blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=True)  # the trajectory objects are saved as plain data
    restored = RolloutCache(torch.device("cpu"), "update", trusted_modules=("tests.support.upstream_grpo",))
    restored.load_state_dict(state)  # and rebuilt from the policy's module
    trajectory = restored.rollout["events"][0]["trajectories"][0]
    assert type(trajectory) is Trajectory and trajectory.actions.tolist() == [1, 2]
    assert trajectory.metrics == {"reward": 0.5, "length": 2.0}
    # A class from anywhere else (here: a module the config never named) is refused, never built.
    with pytest.raises(CheckpointError, match="holds a tests.support.upstream_grpo:Trajectory object"):
        RolloutCache(torch.device("cpu"), "update", trusted_modules=("os",)).load_state_dict(state)
    state["rollout"]["events"][0]["trajectories"][0]["__object__"] = "tempfile:_TemporaryFileCloser"
    with pytest.raises(CheckpointError, match="holds a tempfile:_TemporaryFileCloser object"):
        RolloutCache(torch.device("cpu"), "update", trusted_modules=("tests.support.upstream_grpo",)
                     ).load_state_dict(state)
    with pytest.raises(CheckpointError, match="step_per='update' and resumes with 'rollout'"):
        RolloutCache(torch.device("cpu"), "rollout").load_state_dict(state)
