"""Declared hook seams: the EvalRun handed to before_val / after_val, evaluators
that keep their own schedule, CheckpointSaver configuring the checkpoint
manager, the warm-start key map as a runtime key, and declared setters
instead of attribute writes between hooks."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.hooks.base import EvalRun  # noqa: E402
from pimm.engines.hooks.on_demand import validate_on_demand  # noqa: E402
from pimm.engines.state.manager import Retention  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.inprocess import hook_of, make_trainer  # noqa: E402


@HOOKS.register_module(force=True)
class RunRecorder(HookBase):
    """Records every EvalRun it is handed (new signatures)."""

    priority = "LOWEST"

    def __init__(self, on_demand_at=None):
        self.on_demand_at = on_demand_at
        self.before, self.after = [], []

    def after_step(self):
        if self.trainer.global_step == self.on_demand_at:
            validate_on_demand(self.trainer, "test")

    def before_val(self, run):
        self.before.append(run)

    def after_val(self, metrics, run):
        self.after.append((run, sorted(metrics)))


@HOOKS.register_module(force=True)
class OldStyleValHook(HookBase):
    """A hook written for the earlier signatures: before_val(self), after_val(self, metrics)."""

    def __init__(self):
        self.calls = []

    def before_val(self):
        self.calls.append("before")

    def after_val(self, metrics):
        self.calls.append(("after", sorted(metrics)))


def test_before_and_after_val_receive_which_evaluation_it_is(tmp_path):
    # 2 epochs x 4 steps, ClsEvaluator every 3 steps: scheduled at 3 and 6, final at 8;
    # an on-demand one at step 4; EMAHook scores the average after each, with the same kind.
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2, every_n_steps=3), dict(type="EMAHook"), '
                                     'dict(type="RunRecorder", on_demand_at=4)]')
    trainer.train()
    recorder = hook_of(trainer, "RunRecorder")
    seen = [(r.kind, r.prefix, r.step, r.weights) for r in recorder.before]
    assert seen == [
        ("scheduled", "val", 3, "trained"), ("scheduled", "val_ema", 3, "ema"),
        ("on_demand", "val", 4, "trained"), ("on_demand", "val_ema", 4, "ema"),
        ("scheduled", "val", 6, "trained"), ("scheduled", "val_ema", 6, "ema"),
        ("final", "val", 8, "trained"), ("final", "val_ema", 8, "ema"),
    ]
    # after_val sees the same run objects, nested EMA evaluations first (they run inside EMAHook's after_val).
    assert [r for r, _ in recorder.after][:2] == [recorder.before[1], recorder.before[0]]
    assert all("val/acc" in names for r, names in recorder.after if r.prefix == "val")
    ema = hook_of(trainer, "EMAHook")
    assert all(r.model is ema.module for r in recorder.before if r.weights == "ema")
    assert all(r.model is trainer.model_without_ddp for r in recorder.before if r.weights == "trained")
    assert all(r.evaluators == tuple(trainer.evaluators) for r in recorder.before)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recorder.before[0].kind = "final"


def test_an_eval_run_names_a_known_kind():
    with pytest.raises(ValueError, match="kind must be one of"):
        EvalRun(kind="sometimes", prefix="val", step=1)


def test_hooks_with_the_earlier_val_signatures_still_work(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2), dict(type="OldStyleValHook")]', epoch=1)
    trainer.train()
    calls = hook_of(trainer, "OldStyleValHook").calls
    assert calls[0] == "before" and calls[1][0] == "after" and "val/acc" in calls[1][1]
    assert len(calls) == 2  # the epoch-end evaluation; the final weights were just scored
    # Adapted once, at registration: the dispatch table holds an adapter that still names its hook.
    fns = trainer._dispatch["after_val"]
    assert [fn.__self__ for fn in fns] == [hook_of(trainer, "OldStyleValHook")]


def test_on_demand_validation_leaves_the_evaluators_schedule_alone(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2, every_n_steps=3), '
                                     'dict(type="RunRecorder", on_demand_at=5)]', epoch=2)
    evaluator = trainer.evaluators[0]
    marks = []
    original = evaluator.mark_evaluated

    def spy(run):
        original(run)
        marks.append((run.kind, run.step, evaluator.last_step))
    evaluator.mark_evaluated = spy
    trainer.train()
    # The on-demand evaluation at step 5 does not move last_step (still 3 from the scheduled one).
    assert marks == [("scheduled", 3, 3), ("on_demand", 5, 3), ("scheduled", 6, 6), ("final", 8, 8)]


def test_checkpoint_saver_configures_the_checkpoint_manager(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="CheckpointSaver", keep_last=1, keep_best=False, '
                                     'async_write=False)]', epoch=1)
    saver = hook_of(trainer, "CheckpointSaver")
    trainer.train()
    assert trainer.checkpointer.retention is saver.retention
    assert trainer.checkpointer.retention == Retention(keep_last=1, keep_best=False)
    assert trainer.checkpointer.async_write is False


def test_checkpoint_saver_prunes_leftovers_of_an_earlier_policy_on_resume(tmp_path):
    first = make_trainer(tmp_path, '[dict(type="CheckpointSaver", save_freq=1, keep_all=True)]', epoch=1)
    first.train()
    assert len(first.checkpointer.committed()) == 4
    resumed = make_trainer(tmp_path, '[dict(type="CheckpointSaver", keep_last=2, keep_best=False)]', epoch=1,
                           options=["resume=True"])
    resumed.train()  # nothing left to train: no new save, but the leftovers follow keep_last=2
    assert [p.name[:13] for p in resumed.checkpointer.committed()] == ["step000000003", "step000000004"]


def test_warm_start_key_map_is_a_runtime_key(tmp_path):
    source = make_trainer(tmp_path / "a", '[dict(type="CheckpointSaver")]', epoch=1)
    source.train()
    weights = torch.load(source.save_path / "model" / "model_last.pth", weights_only=True)["state_dict"]
    renamed = tmp_path / "renamed.pth"
    torch.save({"state_dict": {"old." + k: v for k, v in weights.items()}}, renamed)
    # The runtime key alone maps the keys...
    trainer = make_trainer(tmp_path / "b", "[]", epoch=1,
                           options=[f"weight={renamed}", "weight_key_map=[['old.', '']]"])
    assert trainer.cfg.weight_key_map == [["old.", ""]]
    trainer.restore()
    for key, value in trainer.model_without_ddp.state_dict().items():
        assert torch.equal(value, weights[key])
    # ... and CheckpointLoader(key_map=...) is the same key, set in modify_config.
    other = make_trainer(tmp_path / "c", '[dict(type="CheckpointLoader", key_map=[("old.", "")])]', epoch=1,
                         options=[f"weight={renamed}"])
    assert other.cfg.weight_key_map == [["old.", ""]]
    with pytest.raises(ConfigError, match="contradicts weight_key_map.*'old.' renamed both to 'new.' and to ''"):
        make_trainer(tmp_path / "d", '[dict(type="CheckpointLoader", key_map=[("old.", "")])]', epoch=1,
                     options=["weight_key_map=[['old.', 'new.']]"])
    # Rules for other prefixes combine (upstream lists one CheckpointLoader per renamed prefix), longest first.
    both = make_trainer(tmp_path / "d2", '[dict(type="CheckpointLoader", keywords="old.", replacement=""), '
                        'dict(type="CheckpointLoader", keywords="old.head.", replacement="head.")]', epoch=1,
                        options=["weight_key_map=[['x.', '']]"])
    assert both.cfg.weight_key_map == [["old.head.", "head."], ["old.", ""], ["x.", ""]]
    with pytest.raises(ConfigError, match="weight_key_map=.*old_prefix, new_prefix"):
        make_trainer(tmp_path / "e", "[]", epoch=1, options=["weight_key_map=['old.']"])


def test_intervals_change_through_declared_setters(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2), dict(type="InformationWriter")]', epoch=1)
    evaluator, writer = trainer.evaluators[0], hook_of(trainer, "InformationWriter")
    evaluator.set_interval(7)
    writer.set_interval(3)
    assert (evaluator.every_n_steps, writer.log_frequency) == (7, 3)
    evaluator.set_interval(None)
    assert evaluator.every_n_steps is None
    with pytest.raises(ValueError, match="every_n_steps"):
        evaluator.set_interval(0)
    with pytest.raises(ValueError, match="log_frequency"):
        writer.set_interval(True)


def test_the_engine_reads_no_undeclared_hook_attributes():
    """The attribute channels the seams replaced stay gone from pimm/."""
    gone = ("validation_kind", "validation_prefix", "publishes_prefix", "checkpoint_interval",
            "restores_checkpoints", "_to_device")
    offenders = []
    for path in sorted((ROOT / "pimm").rglob("*.py")):
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: {name}" for name in gone if re.search(rf"\b{name}\b", text)]
    assert offenders == []
    engine = "\n".join(p.read_text() for p in (ROOT / "pimm" / "engines").rglob("*.py"))
    assert not re.search(r"for \w+ in (self|trainer)\.hooks if getattr\(", engine)
