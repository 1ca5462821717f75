"""NaNGuard: a skipped step leaves the weights and the schedule untouched and
is logged; the budget of consecutive skips; the culprit named in the log;
``policy="stop"`` exits 1 through tools/train.py before the update, with the
last good checkpoint untouched. (Two DDP ranks agreeing on a skip: see
tests/test_hooks_ema.py.)

The toy model ``ToyFlakyMLP`` returns a NaN loss on chosen training steps;
toy runs have 4 steps per epoch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.hooks.nan_guard import NaNGuard, NonFiniteStep  # noqa: E402
from pimm.engines.state.manager import CheckpointManager  # noqa: E402
from tests.support import inprocess  # noqa: E402
from tests.support.inprocess import committed_steps, records  # noqa: E402
from tests.support.run import final_weights, run_tool, write_toy_config  # noqa: E402
from tests.support.toy import WeightsRecorder  # noqa: E402


def make_trainer(directory: Path, hooks: str, nan_calls=(), extra: str = ""):
    """A toy trainer whose loss is NaN on the training forward calls ``nan_calls``."""
    return inprocess.make_trainer(directory, hooks, f"model = dict(type='ToyFlakyMLP', nan_calls={list(nan_calls)})\n"
                                  + extra)


@pytest.fixture(autouse=True)
def clean_records():
    WeightsRecorder.records.clear()
    yield
    WeightsRecorder.records.clear()


@HOOKS.register_module(force=True)
class PoisonGradient(HookBase):
    """Sets one parameter's gradient to inf on ``step`` (the loss stays finite)."""

    priority = "HIGH"  # before NaNGuard's after_backward

    def __init__(self, step=3, name="net.3.bias"):
        self.step, self.name = step, name

    def after_backward(self):
        if self.trainer.global_step + 1 == self.step:
            grad = dict(self.trainer.model_without_ddp.named_parameters())[self.name].grad
            grad[0] = float("inf")


# -- skip ---------------------------------------------------------------------------------------
def test_a_skipped_step_changes_neither_weights_nor_schedule_and_is_logged(tmp_path, caplog):
    trainer = make_trainer(tmp_path, '[dict(type="InformationWriter", log_frequency=1), dict(type="NaNGuard"), '
                                     'dict(type="WeightsRecorder")]', nan_calls=[3])
    with caplog.at_level("WARNING", logger="pimm"):
        trainer.train()
    assert trainer.outcome == "completed" and trainer.global_step == 8
    weights = {step: w for step, _, w in WeightsRecorder.records}
    assert [stepped for _, stepped, _ in WeightsRecorder.records] == [True, True, False] + [True] * 5
    assert all(torch.equal(weights[3][k], v) for k, v in weights[2].items())  # the poisoned step: unchanged
    assert not all(torch.equal(weights[4][k], v) for k, v in weights[3].items())  # training goes on
    assert all(torch.isfinite(v).all() for v in weights[8].values())

    rows = records(trainer.save_path)
    loss = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    lr = {r["step"]: r["train/lr"] for r in rows if "train/lr" in r}
    assert loss[3] is None and all(v is not None for s, v in loss.items() if s != 3)
    assert [(r["step"], r["train/skipped_steps"]) for r in rows if "train/skipped_steps" in r] == [(3, 1)]
    assert lr[4] == lr[3] != lr[2]  # the scheduler did not advance on the skipped step
    assert ("NaNGuard: skipped the update of step 3 (loss=nan; non-finite model outputs: loss; first non-finite "
            "gradient: net.0.weight (4 of 4 parameters)); 1 in a row (max 5), 1 in this run") in caplog.text
    assert "train/loss" not in trainer.metrics.watch_finite  # the guard handles those steps, not the flush


def test_a_non_finite_gradient_alone_is_caught_and_named(tmp_path, caplog):
    trainer = make_trainer(tmp_path, '[dict(type="PoisonGradient", step=3, name="net.3.bias"), dict(type="NaNGuard"), '
                                     'dict(type="WeightsRecorder")]')
    with caplog.at_level("WARNING", logger="pimm"):
        trainer.train()
    assert "skipped the update of step 3 (first non-finite gradient: net.3.bias (1 of 4 parameters))" in caplog.text
    assert [s for s, stepped, _ in WeightsRecorder.records if not stepped] == [3]


def test_the_budget_of_consecutive_skips_stops_the_run_before_the_update(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="NaNGuard", max_consecutive_skips=2), '
                                     'dict(type="CheckpointSaver", save_freq=2), dict(type="WeightsRecorder")]',
                           nan_calls=[3, 4, 5])
    with pytest.raises(NonFiniteStep, match=r"non-finite values at step 5 \(loss=nan.*\); stopping before the update "
                                            r"\(3 bad steps in a row, max_consecutive_skips=2\)"):
        trainer.train()
    assert trainer.outcome == "failed" and trainer.global_step == 4
    assert committed_steps(trainer.save_path) == [2, 4]  # nothing written after the failure
    assert final_weights(trainer.save_path)["global_step"] == 4


def test_the_budget_counts_bad_steps_in_a_row_only(tmp_path):
    guard = '[dict(type="NaNGuard", max_consecutive_skips=2), dict(type="WeightsRecorder")]'
    trainer = make_trainer(tmp_path, guard, nan_calls=[2, 3, 5, 6])
    trainer.train()
    assert trainer.outcome == "completed"
    assert [s for s, stepped, _ in WeightsRecorder.records if not stepped] == [2, 3, 5, 6]
    guard_hook = next(h for h in trainer.hooks if isinstance(h, NaNGuard))
    assert (guard_hook.skipped, guard_hook.consecutive) == (4, 0)


def test_under_a_grad_scaler_overflowing_gradients_are_left_to_the_scaler():
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    model.weight.grad[0, 0] = float("inf")
    guard = NaNGuard()
    trainer = SimpleNamespace(model_without_ddp=model, comm_info={"loss": torch.tensor(1.0)},
                              optim_step=SimpleNamespace(scaler=None))
    guard.trainer = trainer
    assert guard._bad()
    trainer.optim_step.scaler = torch.amp.GradScaler("cpu")  # it skips overflowing steps itself
    assert not guard._bad()
    trainer.comm_info["loss"] = torch.tensor(float("nan"))  # a non-finite loss is still caught
    assert guard._bad()


def test_stop_policy_keeps_the_metric_channel_watch(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="NaNGuard", policy="stop")]', extra="epoch = 1\n")
    trainer.train()
    assert "train/loss" in trainer.metrics.watch_finite


# -- stop, through tools/train.py -------------------------------------------------------------
@pytest.mark.slow
def test_stop_policy_exits_1_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, """
model = dict(type="ToyFlakyMLP", nan_calls=[7])
hooks = [
    dict(type="InformationWriter", log_frequency=4),
    dict(type="NaNGuard", policy="stop"),
    dict(type="CheckpointSaver", save_freq=5),
]
""")
    result = run_tool("train", cfg)
    assert result.returncode == 1
    assert "NaNGuard: non-finite values at step 7 (loss=nan" in result.stderr
    assert "stopping before the update (policy='stop')" in result.stderr
    manager = CheckpointManager(save / "checkpoints")
    assert committed_steps(save) == [5] and not list((save / "checkpoints").glob(".tmp-*"))
    assert manager.verify(manager.committed()[0]) == "ok"  # sizes and CRC-32s as committed
    last = final_weights(save)
    assert last["global_step"] == 5 and all(torch.isfinite(v).all() for v in last["state_dict"].values())
    assert "NonFiniteStep" in (save / "train.log").read_text()
