"""A W&B history that rewinds with the run: on resume the W&B run continues
from the checkpoint's step (``resume_from="<id>?_step=<N>"``), so the rows the
killed attempt logged after the checkpoint are dropped and the replayed steps
are logged; ``train/global_step`` is every chart's step metric. W&B is a
recording stand-in (tests/support/fake_wandb.py) that keeps rows as a W&B
server would."""

from __future__ import annotations

import logging
import sys

import pytest

from tests.support import fake_wandb
from tests.support.inprocess import make_trainer

HOOKS = ('[dict(type="InformationWriter", log_frequency=2), dict(type="CheckpointSaver", save_freq=5), '
         'dict(type="ClsEvaluator", num_classes=2){extra}]')


@pytest.fixture
def wandb(monkeypatch):
    fake_wandb.reset()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    return fake_wandb


def _train(directory, extra_hook="", options=()):
    trainer = make_trainer(directory, HOOKS.format(extra=extra_hook), extra="use_wandb = True\n",
                           options=list(options), epoch=3)
    trainer.train()
    return trainer


def _loss_rows(run_id):
    return fake_wandb.history(run_id, "train/loss")


def test_a_resume_rewinds_the_wandb_run_to_the_checkpoint(tmp_path, wandb):
    reference = _train(tmp_path / "reference")
    reference_id = reference.writer.wandb_run_id
    with pytest.raises(RuntimeError, match="boom at step 7"):
        _train(tmp_path / "killed", ', dict(type="RaiseAtStep", step=7)')
    first = wandb.runs[-1]
    tail = [step for step, _ in _loss_rows(first.id) if step > 5]
    assert tail == [6, 7]  # the killed attempt logged past its last checkpoint (step 5)
    resumed = _train(tmp_path / "killed", options=["resume=True"])
    second = wandb.runs[-1]
    assert resumed.writer.wandb_run_id == first.id == second.id
    assert second.init_kwargs["resume_from"] == f"{first.id}?_step=5" and second.init_kwargs.get("resume") is None
    # The tail is gone, the replayed steps are there, nothing was dropped: the same history as without the kill.
    rows = _loss_rows(first.id)
    expected = _loss_rows(reference_id)
    assert [step for step, _ in rows] == [step for step, _ in expected] == [2, 4, 5, 6, 8, 10, 12]
    assert [value for _, value in rows] == pytest.approx([value for _, value in expected], rel=1e-6)
    assert not second.dropped
    # train/global_step is the x-axis of every chart and sits in every row.
    assert second.defined["*"]["step_metric"] == "train/global_step"
    assert all(data["train/global_step"] == step for step, data in wandb.servers[first.id])


def test_log_step_offset_moves_the_rewind_point_too(tmp_path, wandb):
    with pytest.raises(RuntimeError):
        trainer = make_trainer(tmp_path, HOOKS.format(extra=', dict(type="RaiseAtStep", step=7)'),
                               extra="use_wandb = True\nlog_step_offset = 100\n", epoch=3)
        trainer.train()
    make_trainer(tmp_path, HOOKS.format(extra=""), extra="use_wandb = True\nlog_step_offset = 100\n",
                 options=["resume=True"], epoch=3).train()
    run = wandb.runs[-1]
    assert run.init_kwargs["resume_from"] == f"{run.id}?_step=105"
    assert [step for step, _ in _loss_rows(run.id)] == [102, 104, 105, 106, 108, 110, 112]


def test_an_old_client_falls_back_to_resume_allow_and_says_what_is_lost(tmp_path, wandb, caplog):
    wandb.use_client(rewind=False)
    with pytest.raises(RuntimeError):
        _train(tmp_path, ', dict(type="RaiseAtStep", step=7)')
    with caplog.at_level(logging.WARNING, logger="pimm"):
        _train(tmp_path, options=["resume=True"])
    run = wandb.runs[-1]
    assert run.init_kwargs["resume"] == "allow" and "resume_from" not in run.init_kwargs
    assert any("cannot rewind" in r.getMessage() and "step 5" in r.getMessage() for r in caplog.records)
    # The documented limitation: the killed attempt's 6 and 7 stay, W&B drops the replayed 6, later steps arrive.
    assert [step for step, _ in _loss_rows(run.id)] == [2, 4, 5, 6, 7, 8, 10, 12]
    assert [step for step, _ in run.dropped if "train/loss" in _] == [6]
