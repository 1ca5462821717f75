"""Hooks: lifecycle order, priorities, dispatch tables, the trainer proxy,
``modify_config``, and per-entry state through checkpoints and resume.

The trainer is built in-process from the toy config (``tests/support``) with
a small data set (4 steps per epoch) so every test stays around a second.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.datasets, pimm.evaluation, pimm.models  # noqa: E402,F401,E401  (registers data sets, evaluators, models)
from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.hooks.base import build_hooks  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.utils.errors import TrainingPreempted  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402
from tests.support.toy import RecordingHook  # noqa: E402

STEPS_PER_EPOCH = 4  # 64 training samples / batch 16

SMALL_DATA = """
epoch = 2
data = dict(
    train=dict(type="ToyDataset", num_samples=64),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
    test=dict(type="ToyDataset", num_samples=32, seed=2),
)
"""


@HOOKS.register_module(force=True)
class CounterHook(HookBase):
    """Adds ``increment`` to its state after every step, so two entries of this
    type hold different states and a mix-up on restore is visible."""

    def __init__(self, increment: int = 1):
        self.increment = increment
        self.total = 0

    def after_step(self):
        self.total += self.increment

    def state_dict(self):
        return {"total": self.total}

    def load_state_dict(self, state):
        self.total = state["total"]


@HOOKS.register_module(force=True)
class ConfigTweakHook(HookBase):
    """Changes the config in ``modify_config``; the components must see the change."""

    def __init__(self, lr: float, hidden: int):
        self.lr, self.hidden = lr, hidden

    def modify_config(self, cfg):
        cfg.optimizer.lr = self.lr
        cfg.model.hidden = self.hidden


@pytest.fixture(autouse=True)
def clean_events():
    RecordingHook.events.clear()
    yield
    RecordingHook.events.clear()


def make_trainer(tmp_path: Path, hooks: str, extra: str = "", options=()):
    """Build a DefaultTrainer from the toy config with ``hooks`` (Python source of a list)."""
    # default_hooks = None: exactly the hooks given (these tests are about their order and state).
    cfg_path = write_toy_config(tmp_path, tmp_path / "run",
                                SMALL_DATA + f"default_hooks = None\nhooks = {hooks}\n" + extra)
    cfg, hooks = load_config(str(cfg_path), list(options), world_size=1)
    return build_trainer(cfg, hooks=hooks)


def phases(name: str | None = None) -> list[tuple]:
    return [e[1:] for e in RecordingHook.events if name is None or e[0] == name]


# ----------------------------------------------------------------------------- lifecycle


def test_lifecycle_call_order_over_two_epochs(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="RecordingHook")]')
    trainer.train()

    expected = [("before_train", 0, 0)]
    step = 0
    for epoch in range(2):
        expected.append(("before_epoch", epoch, step))
        for _ in range(STEPS_PER_EPOCH):
            expected.append(("before_step", epoch, step))
            step += 1
            expected.append(("after_step", epoch, step))  # global_step already counts this step
        expected.append(("after_epoch", epoch, step))
    expected.append(("after_train", 1, step))
    assert phases() == expected
    assert trainer.global_step == 2 * STEPS_PER_EPOCH


@HOOKS.register_module(force=True)
class IterProbe(HookBase):
    """Records ``comm_info["iter"]`` and ``trainer.iter`` around every step."""

    def __init__(self):
        self.seen = []

    def before_step(self):
        self.seen.append(("before", self.trainer.epoch, self.trainer.iter, self.trainer.comm_info.get("iter")))

    def after_step(self):
        self.seen.append(("after", self.trainer.epoch, self.trainer.iter, self.trainer.comm_info["iter"]))


def test_comm_info_iter_is_the_step_inside_the_epoch(tmp_path):
    """docs/contract.md: ``iter`` counts the optimizer steps done in the current
    epoch; after_step sees this step counted, and it restarts each epoch."""
    trainer = make_trainer(tmp_path, '[dict(type="IterProbe")]')
    trainer.train()
    probe = next(h for h in trainer.hooks if isinstance(h, IterProbe))
    after = [(epoch, it, info) for kind, epoch, it, info in probe.seen if kind == "after"]
    assert after == [(epoch, i, i) for epoch in range(2) for i in range(1, STEPS_PER_EPOCH + 1)]
    before = [(epoch, it) for kind, epoch, it, _ in probe.seen if kind == "before"]
    assert before == [(epoch, i) for epoch in range(2) for i in range(STEPS_PER_EPOCH)]


# ----------------------------------------------------------------------------- priorities


def test_priority_order_names_and_ints_with_stable_ties(tmp_path):
    hooks = """[
        dict(type="RecordingHook", name="low70", priority=70),
        dict(type="RecordingHook", name="normal_first"),
        dict(type="RecordingHook", name="high", priority="HIGH"),
        dict(type="RecordingHook", name="normal_int", priority=50),
        dict(type="RecordingHook", name="normal_last", priority="normal"),
        dict(type="RecordingHook", name="first", priority=0),
    ]"""
    trainer = make_trainer(tmp_path, hooks, extra="epoch = 1\n")
    order = ["first", "high", "normal_first", "normal_int", "normal_last", "low70"]
    assert [h.name for h in trainer.hooks] == order
    assert [h.priority for h in trainer.hooks] == [0, 30, 50, 50, 50, 70]
    trainer.train()
    for phase in ("before_train", "before_epoch", "before_step", "after_step", "after_epoch", "after_train"):
        calls = [e[0] for e in RecordingHook.events if e[1] == phase]
        assert calls[:len(order)] == order, phase


def test_same_type_twice_with_different_priorities(tmp_path):
    trainer = make_trainer(tmp_path, """[
        dict(type="RecordingHook", name="late", priority=80),
        dict(type="RecordingHook", name="early", priority=20),
    ]""", extra="epoch = 1\n")
    assert [h.name for h in trainer.hooks] == ["early", "late"]
    assert [h.priority for h in trainer.hooks] == [20, 80]
    assert RecordingHook.priority == "NORMAL"  # the entry's priority is per instance, not per class
    trainer.train()
    assert [e[0] for e in RecordingHook.events if e[1] == "after_step"][:2] == ["early", "late"]


def test_builder_takes_priority_and_leaves_the_config_alone():
    # RecordingHook.__init__(name) would raise TypeError if it were passed ``priority``.
    cfgs = [dict(type="RecordingHook", name="a", priority=10), dict(type="RecordingHook", name="b")]
    hooks = build_hooks(cfgs)
    assert [type(h) for h in hooks] == [RecordingHook, RecordingHook]
    assert hooks[0].priority == 10 and hooks[1].priority == "NORMAL"
    assert cfgs[0] == dict(type="RecordingHook", name="a", priority=10)  # config.py must still show it


@pytest.mark.parametrize("priority", [101, -1, "URGENT", True, 2.5])
def test_invalid_priority_is_a_config_error_naming_the_entry(priority):
    cfgs = [dict(type="RecordingHook"), dict(type="RecordingHook", priority=priority)]
    with pytest.raises(ConfigError, match=r"hooks\[1\] \(RecordingHook\).*priority"):
        build_hooks(cfgs)


# ----------------------------------------------------------------------------- dispatch and proxy


def test_dispatch_tables_hold_only_overriding_hooks(tmp_path):
    trainer = make_trainer(tmp_path, """[
        dict(type="CheckpointLoader"),
        dict(type="IterationTimer"),
        dict(type="InformationWriter"),
        dict(type="RecordingHook"),
        dict(type="CheckpointSaver"),
    ]""")
    owners = {phase: [type(fn.__self__).__name__ for fn in fns] for phase, fns in trainer._dispatch.items()}
    # InformationWriter and the checkpoint hooks do nothing before a step: they are not called for it.
    assert owners["before_step"] == ["IterationTimer", "RecordingHook"]
    assert owners["before_epoch"] == ["RecordingHook"]
    assert owners["before_train"] == ["IterationTimer", "RecordingHook", "CheckpointSaver"]
    # Phases nobody overrides hold nothing (they cost one empty iteration).
    assert owners["after_backward"] == owners["before_val"] == owners["on_exception"] == []
    assert owners["after_step"] == ["IterationTimer", "InformationWriter", "RecordingHook", "CheckpointSaver"]
    # Each entry is a bound method of the registered hook instance, in priority order.
    assert all(fn.__self__ in trainer.hooks for fns in trainer._dispatch.values() for fn in fns)


def test_trainer_attribute_is_a_weak_proxy(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="RecordingHook"), dict(type="CounterHook")]', extra="epoch = 1\n")
    hook = trainer.hooks[0]
    assert isinstance(hook.trainer, weakref.ProxyType)
    assert hook.trainer.max_epoch == 1 and hook.trainer.cfg is trainer.cfg and hook.trainer.model is trainer.model
    # The hooks must not keep the trainer (and its model and loaders) alive.
    trainer.close()
    del trainer
    gc.collect()
    with pytest.raises(ReferenceError):
        hook.trainer.global_step


def test_modify_config_runs_before_components_are_built(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="ConfigTweakHook", lr=0.123, hidden=7)]')
    assert trainer.cfg.optimizer.lr == 0.123
    assert trainer.optimizer.defaults["lr"] == 0.123  # the optimizer was built from the changed config
    assert trainer.model_without_ddp.net[0].out_features == 7  # so was the model
    trainer.close()


# ----------------------------------------------------------------------------- state


HOOKS_WITH_STATE = """[
    dict(type="CheckpointLoader"),
    dict(type="RecordingHook", name="a"),
    dict(type="RecordingHook", name="b"),
    dict(type="CounterHook", increment=1),
    dict(type="CounterHook", increment=10),
    dict(type="CheckpointSaver"),
    dict(type="KillAtStep", step=6, signal_name="SIGTERM"),
]"""


def _stateful(trainer):
    recs = {h.name: h for h in trainer.hooks if isinstance(h, RecordingHook)}
    counters = [h for h in trainer.hooks if isinstance(h, CounterHook)]
    return recs, counters


def test_each_entry_keeps_its_state_through_checkpoint_and_resume(tmp_path):
    # SIGTERM at step 6 (mid epoch 2) is a pre-emption: checkpoint at step 6, then stop.
    first = make_trainer(tmp_path, HOOKS_WITH_STATE)
    with pytest.raises(TrainingPreempted):
        first.train()
    recs, counters = _stateful(first)
    assert recs["a"] is not recs["b"]
    assert recs["a"].steps_seen == recs["b"].steps_seen == 6  # not shared between entries
    assert [c.total for c in counters] == [6, 60]

    newest = sorted((tmp_path / "run" / "checkpoints").glob("step*"))[-1]
    assert newest.name.startswith("step000000006")
    saved = torch.load(newest / "rank00000.pth", weights_only=True)["hooks"]
    states = [(s["type"], s["state"]) for s in saved if s["type"] in ("RecordingHook", "CounterHook")]
    assert states == [("RecordingHook", {"steps_seen": 6}), ("RecordingHook", {"steps_seen": 6}),
                      ("CounterHook", {"total": 6}), ("CounterHook", {"total": 60})]
    del first
    RecordingHook.events.clear()

    second = make_trainer(tmp_path, HOOKS_WITH_STATE, options=["resume=True"])
    second.train()
    recs, counters = _stateful(second)
    # Restored, each entry to its own state, then counting on: 6 restored + 2 new steps.
    assert recs["a"].steps_seen == recs["b"].steps_seen == 2 * STEPS_PER_EPOCH
    assert [c.total for c in counters] == [2 * STEPS_PER_EPOCH, 20 * STEPS_PER_EPOCH]
    # The hooks already see the restored position in before_train, and only steps 7 and 8 ran.
    first_call = phases("a")[0]
    assert first_call[0] == "before_train" and first_call[2] == 6
    assert [p for p in phases("a") if p[0] == "after_step"] == [("after_step", 1, 7), ("after_step", 1, 8)]
