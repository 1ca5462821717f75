"""EarlyStopping: the stop step on a scripted plateau (with the final
checkpoint and the logged reason), one direction per metric shared with
best-checkpoint selection, unknown monitors, the zero-lr stop, and exact
resume of an EMA + early-stopping run killed in the middle (tools/train.py).

Scores come from ``ScriptedEvaluator`` (tests/support/toy.py): the i-th
evaluation reports ``values[i]``, so the expected stop step is known exactly.
Toy runs have 4 steps per epoch unless said otherwise.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.utils.errors import ConfigError, RegistryError  # noqa: E402
from tests.support import forkserver, inprocess  # noqa: E402
from tests.support.inprocess import committed_steps, hook_of  # noqa: E402
from tests.support.run import ROOT as REPO, env, final_weights, train_losses, write_toy_config  # noqa: E402


def make_trainer(directory: Path, hooks: str, extra: str = "", options=()):
    return inprocess.make_trainer(directory, hooks, extra, options, epoch=10)


def scripted(values, every=2, greater_is_better=True, stopper="", saver='dict(type="CheckpointSaver", save_freq=100)'):
    return (f'[dict(type="ScriptedEvaluator", values={list(values)}, every_n_steps={every}, '
            f'greater_is_better={greater_is_better}), {stopper}, {saver}]')


# -- stopping on a plateau ----------------------------------------------------------------------
def test_stops_after_patience_evaluations_without_improvement_with_a_final_checkpoint(tmp_path, caplog):
    # Evaluations at steps 2, 4, 6, ...: the best (0.7) is at step 4; steps 6, 8, 10 do not beat it.
    hooks = scripted([0.5, 0.7, 0.7, 0.65, 0.69], stopper='dict(type="EarlyStopping", monitor="val/score", patience=3)')
    trainer = make_trainer(tmp_path, hooks)
    with caplog.at_level("INFO", logger="pimm"):
        trainer.train()
    assert trainer.outcome == "stopped" and trainer.global_step == 10
    assert committed_steps(trainer.save_path) == [4, 8, 10]  # epoch ends, the best (4), and the final one
    assert final_weights(trainer.save_path)["global_step"] == 10
    assert "early stopping: val/score has not improved on 0.7000 (step 4) for 3 evaluations" in caplog.text
    assert "Stopping at step 10 (early stopping" in caplog.text
    stopper = hook_of(trainer, "EarlyStopping")
    assert (stopper.best, stopper.best_step, stopper.wait, stopper.mode) == (0.7, 4, 3, "max")


def test_min_delta_and_a_minimised_metric(tmp_path):
    # Smaller is better; 0.395 beats 0.4 by less than min_delta=0.01: no improvement.
    hooks = scripted([0.5, 0.4, 0.395, 0.3, 0.299, 0.298], greater_is_better=False,
                     stopper='dict(type="EarlyStopping", monitor="val/score", patience=2, min_delta=0.01)')
    trainer = make_trainer(tmp_path, hooks)
    trainer.train()
    # best 0.5 (2), 0.4 (4), wait 1 (6), best 0.3 (8), wait 1 (10), wait 2 (12): stop.
    assert trainer.outcome == "stopped" and trainer.global_step == 12
    assert trainer.metrics.best.mode == "min" and trainer.metrics.best.value == pytest.approx(0.298)


def test_a_maximised_metric_is_never_minimised(tmp_path):
    # Rising scores: never a stop, and the best model is the highest score.
    hooks = scripted([0.1, 0.2, 0.3, 0.4, 0.5], every=8,
                     stopper='dict(type="EarlyStopping", monitor="val/score", patience=1)')
    trainer = make_trainer(tmp_path, hooks, extra="epoch = 10\n")
    trainer.train()
    assert trainer.outcome == "completed" and trainer.global_step == 40
    assert trainer.metrics.direction("val/score") == "max" == hook_of(trainer, "EarlyStopping").mode
    assert trainer.metrics.best.value == 0.5 and trainer.metrics.best.step == 40
    best = torch.load(trainer.save_path / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == 0.5 and best["metric_name"] == "val/score"


def test_a_mode_contradicting_the_declared_direction_is_a_config_error(tmp_path):
    trainer = make_trainer(tmp_path, scripted([0.5], stopper='dict(type="EarlyStopping", monitor="val/score", '
                                                            'mode="min")'))
    with pytest.raises(ConfigError, match="mode='min' contradicts 'val/score', which its evaluator declares 'max'"):
        trainer.train()
    assert trainer.global_step == 0
    trainer = make_trainer(tmp_path / "loss", '[dict(type="ClsEvaluator", num_classes=2), '
                                              'dict(type="EarlyStopping", monitor="val/loss", mode="max")]')
    with pytest.raises(ConfigError, match="contradicts 'val/loss'"):
        trainer.train()


def test_a_mode_for_an_undeclared_metric_declares_it(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2), '
                                     'dict(type="EarlyStopping", monitor="val/mAcc", mode="max", patience=100)]',
                           extra="epoch = 1\n")
    trainer.train()
    assert trainer.metrics.direction("val/mAcc") == "max"
    with pytest.raises(ConfigError, match="declared both 'max' and 'min'"):
        trainer.metrics.declare("val/mAcc", "min")


def test_unknown_monitors_are_config_errors_naming_what_exists(tmp_path):
    # No direction anywhere and no mode: refused before training, with the declared metrics.
    trainer = make_trainer(tmp_path / "a", '[dict(type="ClsEvaluator", num_classes=2), '
                                           'dict(type="EarlyStopping", monitor="val/mIoU")]')
    with pytest.raises(ConfigError, match=r"'val/mIoU' has no declared direction \(declared: val/acc, val/loss\)"):
        trainer.train()
    # With a mode, the first evaluation shows it does not exist: the error lists the metrics.
    trainer = make_trainer(tmp_path / "b", '[dict(type="ClsEvaluator", num_classes=2), '
                                           'dict(type="EarlyStopping", monitor="val/mIoU", mode="max")]')
    with pytest.raises(ConfigError, match=r"no evaluator produces 'val/mIoU'; the metrics are: val/acc, val/acc_0, "
                                          r"val/acc_1, val/loss, val/mAcc"):
        trainer.train()
    assert trainer.global_step == 4  # the first evaluation, at the first epoch end
    # A prefix no evaluation publishes (val_ema without EMAHook).
    trainer = make_trainer(tmp_path / "c", '[dict(type="ClsEvaluator", num_classes=2), '
                                           'dict(type="EarlyStopping", monitor="val_ema/acc")]')
    with pytest.raises(ConfigError, match=r"no evaluation publishes val_ema/\* metrics"):
        trainer.train()
    trainer = make_trainer(tmp_path / "d", '[dict(type="EarlyStopping", monitor="val/acc")]')
    with pytest.raises(ConfigError, match="nothing to watch: no evaluator hook is configured"):
        trainer.train()


def test_bad_options_are_refused():
    from pimm.engines.hooks.base import build_hooks

    for bad, message in ((dict(monitor="acc"), "monitor must be a metric name like 'val/acc'"),
                         (dict(monitor="val/acc", mode="up"), "mode must be 'min', 'max' or None"),
                         (dict(monitor="val/acc", patience=0), "patience must be a positive integer"),
                         (dict(monitor="val/acc", min_delta=-1), "min_delta must be a number >= 0"),
                         (dict(), "give a monitor")):
        with pytest.raises(RegistryError, match=re.escape(message)):
            build_hooks([dict(type="EarlyStopping", **bad)])


def test_monitoring_the_ema_weights(tmp_path):
    # val_ema/score follows the script too (the EMA evaluation does not advance it).
    hooks = ('[dict(type="ScriptedEvaluator", values=[0.5, 0.6, 0.6, 0.6], every_n_steps=2), dict(type="EMAHook"), '
             'dict(type="EarlyStopping", monitor="val_ema/score", patience=2)]')
    trainer = make_trainer(tmp_path, hooks)
    trainer.train()
    assert trainer.outcome == "stopped" and trainer.global_step == 8
    assert hook_of(trainer, "EarlyStopping").mode == "max"


@HOOKS.register_module(force=True)
class OnDemandAt(HookBase):
    """Runs an on-demand evaluation after each of ``steps``."""

    def __init__(self, steps=()):
        self.steps = set(steps)

    def after_step(self):
        if self.trainer.global_step in self.steps:
            self.trainer.validate(kind="on_demand")


def test_on_demand_evaluations_do_not_count(tmp_path):
    # Constant scores, patience 1: the scheduled evaluation at 8 is the first without improvement.
    # The on-demand ones at 5 and 6 would have stopped the run at 5 if they counted.
    trainer = make_trainer(tmp_path, '[dict(type="ScriptedEvaluator", values=[0.5], every_n_steps=4), '
                                     'dict(type="OnDemandAt", steps=[5, 6]), '
                                     'dict(type="EarlyStopping", monitor="val/score", patience=1)]')
    trainer.train()
    assert trainer.outcome == "stopped" and trainer.global_step == 8


def test_stop_when_the_learning_rate_reaches_zero(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="EarlyStopping", stop_on_zero_lr=True), dict(type="CheckpointSaver")]',
                           extra='scheduler = dict(_delete_=True, type="MultiStepLR", milestones=[6], gamma=0.0)\n')
    trainer.train()
    # Step 6 trained at the full rate; the next would run at 0.
    assert trainer.outcome == "stopped" and trainer.global_step == 6
    assert committed_steps(trainer.save_path) == [4, 6]


def test_the_decision_state_survives_a_resume(tmp_path):
    hooks = scripted([0.5, 0.7, 0.6, 0.6, 0.6, 0.6], stopper='dict(type="EarlyStopping", monitor="val/score", '
                                                             'patience=3)', saver='dict(type="CheckpointSaver")')
    first = make_trainer(tmp_path, hooks.replace("[dict", '[dict(type="StopAtStep", step=7), dict', 1))
    first.train()  # stopped at 7: best 0.7 (4), one evaluation without improvement (6); the final one does not count
    assert first.global_step == 7 and hook_of(first, "EarlyStopping").wait == 1
    resumed = make_trainer(tmp_path, hooks.replace("[dict", '[dict(type="StopAtStep", step=1000), dict', 1),
                           options=["resume=True"])
    resumed.train()
    stopper = hook_of(resumed, "EarlyStopping")
    assert (stopper.best, stopper.best_step) == (0.7, 4)
    assert resumed.outcome == "stopped" and resumed.global_step == 10  # waits 2 (8) and 3 (10), as uninterrupted


# -- exact resume of an EMA + early-stopping run, through tools/train.py --------------------------
RUN = """
epoch = 12
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2, every_n_steps=5),
    dict(type="EMAHook", decay=0.9),
    dict(type="EarlyStopping", monitor="val/loss", patience=2, min_delta=0.01),
    dict(type="CheckpointSaver", save_freq=5, keep_last=2),
    dict(type="KillAtStep", step=10**9),
]
"""


def train(cfg: Path, *options: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "tools" / "train.py"), "--config-file", str(cfg), "--options", *options]
    return forkserver.run(cmd, capture_output=True, text=True, timeout=400, env=env(), cwd=REPO)


@pytest.mark.slow
def test_a_killed_ema_and_early_stopping_run_resumes_bit_identically(tmp_path):
    ref_save, run_save = tmp_path / "ref", tmp_path / "run"
    ref_cfg = write_toy_config(tmp_path, ref_save, RUN)
    assert train(ref_cfg).returncode == 0
    stop_step = final_weights(ref_save)["global_step"]
    log = (ref_save / "train.log").read_text()
    assert "Stopping at step" in log and "early stopping: val/loss has not improved" in log
    assert 15 < stop_step < 120, stop_step  # stopped early, after the kill point below

    (tmp_path / "b").mkdir()
    run_cfg = write_toy_config(tmp_path / "b", run_save, RUN)
    killed = train(run_cfg, "hooks.KillAtStep.step=13")
    assert killed.returncode == -9  # SIGKILL between steps 13 and 14: the last checkpoint is step 10
    assert train(run_cfg, "resume=True").returncode == 0

    for name in ("model_last.pth", "model_ema.pth"):
        got = torch.load(run_save / "model" / name, weights_only=True)
        want = torch.load(ref_save / "model" / name, weights_only=True)
        assert got["global_step"] == want["global_step"] == stop_step
        assert all(torch.equal(got["state_dict"][k], v) for k, v in want["state_dict"].items()), name
    assert train_losses(run_save) == train_losses(ref_save)
    rows = [json.loads(line) for line in open(run_save / "metrics.jsonl")]
    ref_rows = [json.loads(line) for line in open(ref_save / "metrics.jsonl")]
    ema_metrics = [(r["step"], r["val_ema/loss"]) for r in rows if "val_ema/loss" in r]
    assert ema_metrics == [(r["step"], r["val_ema/loss"]) for r in ref_rows if "val_ema/loss" in r]
    assert ema_metrics and ema_metrics[-1][0] == stop_step
