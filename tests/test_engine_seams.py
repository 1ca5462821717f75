"""The engine's seams: OptimStep, loop control and events, restore before any
hook, the metric channel, the config-wins rule, tracked participants.

Trainers are built in-process from the toy config (4 steps per epoch).
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.datasets  # noqa: E402,F401  (registers data sets)
import pimm.evaluation  # noqa: E402,F401  (registers evaluators)
import pimm.models  # noqa: E402,F401  (registers models)
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.observe.metrics import MetricChannel, NonFiniteMetric, reduce_op_by_suffix  # noqa: E402
from pimm.engines.optim.step import OptimStep  # noqa: E402
from pimm.engines.run.runtime import render_default_runtime  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402
from tests.support.toy import PhaseRecorder  # noqa: E402

STEPS_PER_EPOCH = 4
SMALL = """
epoch = 2
data = dict(
    train=dict(type="ToyDataset", num_samples=64),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
    test=dict(type="ToyDataset", num_samples=32, seed=2),
)
"""


def make_trainer(directory: Path, hooks: str, extra: str = "", options=()):
    directory.mkdir(parents=True, exist_ok=True)
    cfg_path = write_toy_config(directory, directory / "run", SMALL + f"hooks = {hooks}\n" + extra)
    cfg, built = load_config(str(cfg_path), list(options), world_size=1)
    return build_trainer(cfg, hooks=built)


def records(trainer) -> list[dict]:
    return [json.loads(line) for line in open(trainer.save_path / "metrics.jsonl")]


@pytest.fixture(autouse=True)
def clean_events():
    PhaseRecorder.events.clear()
    yield
    PhaseRecorder.events.clear()


# ----------------------------------------------------------------------------- OptimStep


def _toy_step(model, optim_step, scale=1.0):
    loss = model(torch.ones(2, 3)).sum() * scale
    optim_step.backward(loss)
    return optim_step.step()


def test_optim_step_skipped_amp_step_does_not_advance_the_scheduler():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    optim_step = OptimStep(optimizer, scheduler=scheduler, scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    result = _toy_step(model, optim_step, scale=float("inf"))  # overflowing gradients: the scaler skips
    assert not result.stepped and scheduler.last_epoch == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())  # zeroed all the same
    result = _toy_step(model, optim_step)
    assert result.stepped and scheduler.last_epoch == 1 and result.lr == 0.1
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_optim_step_grad_norm_and_gradient_callback():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    seen = []
    plain = OptimStep(torch.optim.SGD(model.parameters(), lr=0.1))
    plain.on_gradients = lambda: seen.append([p.grad.clone() for p in model.parameters()])
    assert _toy_step(model, plain).grad_norm is None  # neither clipped nor asked for: not computed
    expected = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in seen[0]]))
    tracked = OptimStep(torch.optim.SGD(model.parameters(), lr=0.1), track_grad_norm=True)
    assert _toy_step(model, tracked).grad_norm.item() == pytest.approx(expected.item(), rel=1e-6)
    clipped = OptimStep(torch.optim.SGD(model.parameters(), lr=0.1), clip_grad=1e-3)
    assert _toy_step(model, clipped).grad_norm.item() == pytest.approx(expected.item(), rel=1e-6)


def test_optim_step_pauses_gradient_sync_except_on_the_last_micro_batch():
    class ShardedLike(torch.nn.Linear):  # FSDP2's switch, recorded
        calls = []

        def set_requires_gradient_sync(self, flag):
            self.calls.append(flag)

    model = ShardedLike(3, 1)
    optim_step = OptimStep(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    for micro in range(3):
        with optim_step.sync(last=micro == 2):
            optim_step.backward(model(torch.ones(1, 3)).sum())
    assert ShardedLike.calls == [False, True, False, True]  # paused and restored around micro-batches 0 and 1


# ----------------------------------------------------------------------------- events and loop control


def _documented_hook_source() -> str:
    """The grad-norm hook example of docs/engine.md, exactly as users read it."""
    text = (ROOT / "docs" / "engine.md").read_text()
    blocks = text.split("```python\n")[1:]
    return next(block.split("```")[0] for block in blocks if "class GradNormMonitor" in block)


def test_after_backward_sees_gradients_and_the_documented_grad_norm_hook_works(tmp_path):
    from pimm.engines import HOOKS

    if "GradNormMonitor" not in HOOKS:
        exec(compile(_documented_hook_source(), "docs/engine.md", "exec"), {})
    trainer = make_trainer(tmp_path, '[dict(type="PhaseRecorder"), dict(type="GradNormMonitor", priority=60), '
                                     'dict(type="InformationWriter", log_frequency=1)]',
                           extra="log_grad_norm = True\n")
    trainer.train()
    backward = [e for e in PhaseRecorder.events if e[0] == "after_backward"]
    assert len(backward) == 2 * STEPS_PER_EPOCH and all(e[2] for e in backward)
    rows = [r for r in records(trainer) if "train/loss" in r]
    hooked = {r["step"]: r["train/grad_norm_hook"] for r in records(trainer) if "train/grad_norm_hook" in r}
    assert sorted(hooked) == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    for row in rows:  # the hook's norm is the engine's own train/grad_norm
        assert hooked[row["step"]] == pytest.approx(row["train/grad_norm"], rel=1e-5)


def test_request_stop_ends_with_a_checkpoint_and_after_train(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="PhaseRecorder"), dict(type="StopAtStep", step=6), '
                                     'dict(type="CheckpointSaver")]', extra="epoch = 5\n")
    trainer.train()  # returns normally: a requested stop is a success
    assert trainer.outcome == "stopped" and trainer.global_step == 6
    assert trainer.train_state.stop_reason == "StopAtStep(6)"
    newest = sorted((trainer.save_path / "checkpoints").glob("step*"))[-1]
    assert newest.name == "step000000006-epoch0001"
    assert torch.load(trainer.save_path / "model" / "model_last.pth", weights_only=True)["global_step"] == 6
    assert PhaseRecorder.events[-1] == ("after_train", 6, "stopped")
    saves = [e[1] for e in PhaseRecorder.events if e[0] == "before_save_checkpoint"]
    assert saves == [4, 6]  # epoch end, then the final one of the stop


def test_failure_runs_on_exception_then_after_train(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="PhaseRecorder"), dict(type="RaiseAtStep", step=3)]')
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.train()
    assert trainer.outcome == "failed"
    assert PhaseRecorder.events[-2:] == [("on_exception", 3, "RuntimeError"), ("after_train", 3, "failed")]


def test_final_weights_are_evaluated_whatever_the_interval(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="PhaseRecorder"), '
                                     'dict(type="ClsEvaluator", num_classes=2, every_n_steps=3)]')
    trainer.train()
    evals = [e[1] for e in PhaseRecorder.events if e[0] == "after_val"]
    assert evals == [3, 6, 8]  # every 3 steps, then the final weights at step 8
    assert [r["step"] for r in records(trainer) if "val/acc" in r] == [3, 6, 8]


def test_validation_events_and_another_model_under_another_prefix(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="PhaseRecorder"), dict(type="ClsEvaluator", num_classes=2)]',
                           extra="epoch = 1\n")
    trainer.train()
    val = [e for e in PhaseRecorder.events if e[0] in ("before_val", "after_val")]
    assert val[0] == ("before_val", 4, "val")
    assert val[1][0] == "after_val" and "val/acc" in val[1][2] and "val/loss" in val[1][2]
    # A hook can have other weights scored (e.g. EMA): they never count as the best model.
    best_before = trainer.metrics.best.value
    metrics = trainer.validate(model=trainer.model_without_ddp, prefix="val_other")
    assert set(metrics) >= {"val_other/acc", "val_other/loss"}
    assert trainer.metrics.best.name == "val/acc" and trainer.metrics.best.value == best_before


def test_restore_happens_before_the_first_hook_even_at_top_priority(tmp_path):
    hooks = ('[dict(type="RecordingHook", name="first", priority=0), dict(type="PhaseRecorder"), '
             'dict(type="CheckpointSaver", save_freq=2), dict(type="StopAtStep", step=6)]')
    extra = "epoch = 3\n"
    first = make_trainer(tmp_path, hooks, extra=extra)
    first.train()
    from tests.support.toy import RecordingHook

    RecordingHook.events.clear()
    PhaseRecorder.events.clear()
    second = make_trainer(tmp_path, hooks.replace("step=6", "step=100"), extra=extra, options=["resume=True"])
    # Nothing restored at build time; everything before the first before_train.
    assert second.global_step == 0
    second.train()
    assert RecordingHook.events[0] == ("first", "before_train", 1, 6)  # already at step 6, epoch index 1
    assert second.hooks[0].steps_seen == 3 * STEPS_PER_EPOCH  # its own state: 6 restored + 6 new steps
    assert PhaseRecorder.events[:2] == [("after_load_checkpoint", 6), ("before_train", 6)]


def test_config_wins_over_the_checkpoint_for_hyperparameters(tmp_path, caplog):
    hooks = '[dict(type="CheckpointSaver"), dict(type="StopAtStep", step=4)]'
    first = make_trainer(tmp_path, hooks, extra="epoch = 3\noptimizer = dict(type='AdamW', lr=0.01, weight_decay=0.01)\n")
    first.train()
    moments = {k: v["exp_avg"].clone() for k, v in first.optimizer.state_dict()["state"].items()}
    caplog.set_level(logging.WARNING, logger="pimm")
    second = make_trainer(tmp_path, hooks.replace("step=4", "step=100"),
                          extra="epoch = 3\noptimizer = dict(type='AdamW', lr=0.002, weight_decay=0.5)\n",
                          options=["resume=True"])
    assert second.restore()
    group = second.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.5 and group["initial_lr"] == 0.002  # the config's
    restored = second.optimizer.state_dict()["state"]
    assert all(torch.equal(restored[k]["exp_avg"], v) for k, v in moments.items())  # the checkpoint's
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "weight_decay: 0.01 -> 0.5" in text and "lr: 0.01 -> 0.002" in text
    second.close()


def test_a_trainer_adds_a_participant_in_one_line(tmp_path):
    hooks = '[dict(type="CheckpointSaver"), dict(type="StopAtStep", step=5)]'
    extra = "train = dict(type='TrackingTrainer')\nepoch = 3\n"
    first = make_trainer(tmp_path, hooks, extra=extra)
    first.train()
    assert first.counter.value == 5
    second = make_trainer(tmp_path, hooks.replace("step=5", "step=100"), extra=extra, options=["resume=True"])
    second.train()
    assert second.counter.value == 3 * STEPS_PER_EPOCH  # 5 restored + 7 more


def test_non_finite_loss_stops_the_run_before_a_checkpoint_is_written(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="InformationWriter", log_frequency=2), '
                                     'dict(type="CheckpointSaver", save_freq=2), '
                                     'dict(type="NaNAtStep", step=2, priority="LOWEST")]')
    with pytest.raises(NonFiniteMetric, match=r"train/loss is not finite at step 3"):
        trainer.train()
    steps = sorted(p.name for p in (trainer.save_path / "checkpoints").glob("step*"))
    assert steps == ["step000000002-epoch0000"]  # the last good one, untouched
    lines = (trainer.save_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]  # every line is valid JSON
    assert [r["train/loss"] for r in rows if r["step"] >= 3] == [None, None]
    assert "NaN" not in "".join(lines)


# ----------------------------------------------------------------------------- the metric channel


def test_channel_reduce_ops_best_and_directions():
    written = []
    channel = MetricChannel(sink=lambda recs, kinds: written.extend(recs))
    channel.step = 3
    channel.publish({"a": torch.tensor(2.0), "a_max": torch.tensor(5.0), "n": 7}, reduce="mean")
    assert channel.latest("n") == 7 and channel.latest("a") is None  # tensors count once flushed
    assert channel.flush() == [{"step": 3, "epoch": 0, "a": 2.0, "a_max": 5.0, "n": 7}]
    assert written[0]["a"] == 2.0 and channel.latest("a") == 2.0
    assert [reduce_op_by_suffix(n) for n in ("x_min", "x_max", "x_sum", "x")] == ["min", "max", "sum", "mean"]
    channel.declare("val/loss", "min")
    channel.declare("val/mIoU", "max")
    with pytest.raises(ConfigError, match="declared both"):
        channel.declare("val/mIoU", "min")
    channel.track_best("val/mIoU")
    assert channel.update_best("val/mIoU", 0.5, step=10) and not channel.update_best("val/mIoU", 0.4, step=20)
    assert not channel.update_best("val/loss", 0.1, step=20)  # not the tracked metric
    assert (channel.best.name, channel.best.value, channel.best.step) == ("val/mIoU", 0.5, 10)
    with pytest.raises(NonFiniteMetric, match="train/loss is not finite at step 4"):
        channel.step = 4
        channel.publish({"train/loss": torch.tensor(float("nan"))})
        channel.flush()


def test_default_runtime_file_is_generated_from_the_engine_table():
    text = (ROOT / "pimm" / "configs" / "_base_" / "default_runtime.py").read_text()
    assert text == render_default_runtime(), "run: python tools/write_default_runtime.py"
    # The repository's base only points at the shipped one (one source of truth).
    from pimm.utils.config import Config

    assert Config.fromfile(ROOT / "configs" / "_base_" / "default_runtime.py") == \
        Config.fromfile(ROOT / "pimm" / "configs" / "_base_" / "default_runtime.py")


def test_scheduler_is_optional_and_means_a_constant_lr(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="InformationWriter", log_frequency=1)]',
                           extra="scheduler = None\nepoch = 1\n")
    trainer.train()
    assert {r["train/lr"] for r in records(trainer) if "train/lr" in r} == {0.01}
    assert math.isfinite(trainer.metrics.latest("train/loss"))
