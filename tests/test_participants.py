"""The participant protocol (state_dict / restore, an adapter for plain
load_state_dict objects), the documented restore order, and the one step
loop that runs traced and untraced alike."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.state import participants as participants_module  # noqa: E402
from pimm.engines.state.manager import CheckpointManager  # noqa: E402
from pimm.engines.state.participants import (Participant, StateDictParticipant,  # noqa: E402
                                             as_participant)
from pimm.engines.loop.trainer_base import TrainerBase  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.observe.tracing import build_tracer  # noqa: E402
from tests.support.inprocess import SMALL, make_trainer, records  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402
from tests.support.participants import Counter  # noqa: E402


class Adaptive:
    """A participant of its own: restore(state, context)."""

    def __init__(self):
        self.restored = "nothing"

    def state_dict(self):
        return {"x": 1}

    def restore(self, state, context):
        self.restored = state


def test_plain_objects_are_adapted_and_participants_kept():
    own = Adaptive()
    assert isinstance(own, Participant) and as_participant(own) is own
    counter = Counter(3)
    adapted = as_participant(counter)
    assert isinstance(adapted, StateDictParticipant) and isinstance(adapted, Participant)
    assert adapted.state_dict() == {"value": 3}
    adapted.restore({"value": 7}, context=None)
    assert counter.value == 7
    adapted.restore(None, context=None)  # no state for this rank (another world size): left as it is
    assert counter.value == 7
    with pytest.raises(TypeError, match="int cannot be a checkpoint participant"):
        as_participant(5)


def test_the_manager_restores_plain_and_protocol_participants(tmp_path):
    counter, own, rank_counter = Counter(5), Adaptive(), Counter(9)
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.register("counter", counter)
    manager.register("own", own)
    manager.register("rank_counter", rank_counter, scope="rank")
    manager.save(global_step=1, epoch=0)
    manager.wait()
    counter.value, rank_counter.value = 0, 0
    manager.restore(manager.load_latest())
    assert (counter.value, rank_counter.value, own.restored) == (5, 9, {"x": 1})
    # Another world size: per-rank states are skipped and the adapter leaves the object as built.
    rank_counter.value = 1
    manager.restore(manager.load_latest(), skip_rank_states=True)
    assert rank_counter.value == 1


ORDER: list[str] = []


@HOOKS.register_module(force=True)
class OrderProbe(HookBase):
    """Records when its state comes back and the phases after the restore."""

    priority = "HIGHEST"

    def state_dict(self):
        return {"seen": 1}

    def load_state_dict(self, state):
        ORDER.append("hooks")

    def after_load_checkpoint(self):
        ORDER.append("after_load_checkpoint")

    def before_train(self):
        ORDER.append("before_train")


def test_restore_order_is_registration_order_hooks_last_then_after_load_checkpoint(tmp_path, monkeypatch):
    hooks = '[dict(type="CheckpointSaver", async_write=False), dict(type="OrderProbe")]'
    first = make_trainer(tmp_path, hooks, epoch=1)
    first.train()
    names = {}
    for cls in (participants_module.ModelParticipant, participants_module.OptimizerParticipant,
                participants_module.SchedulerParticipant, participants_module.TrainStateParticipant,
                participants_module.RNGParticipant, participants_module.MetaParticipant,
                participants_module.LoaderParticipant, participants_module.StateDictParticipant):
        original = cls.restore

        def spy(self, state, context, _original=original):
            ORDER.append(names.get(id(self), type(self).__name__))
            return _original(self, state, context)
        monkeypatch.setattr(cls, "restore", spy)
    ORDER.clear()
    resumed = make_trainer(tmp_path, hooks, epoch=2, options=["resume=True"])
    names.update({id(p): name for name, p in resumed.checkpointer.participants().items()})
    resumed.train()
    layout = list(resumed.checkpointer.participants())
    assert layout == ["model", "optimizer", "scheduler", "scaler", "train_state", "metrics", "writer", "meta",
                      "rng", "loader", "hooks"]
    assert ORDER[:len(layout) + 2] == [*layout, "after_load_checkpoint", "before_train"]


HOOKS_LINE = 'hooks = [dict(type="InformationWriter", log_frequency=1)]\n'


def test_the_one_step_loop_trains_identically_with_tracing_on(tmp_path):
    assert not hasattr(TrainerBase, "_run_epoch_traced")
    plain = make_trainer(tmp_path / "plain", HOOKS_LINE.removeprefix("hooks = "), epoch=1)
    plain.train()
    (tmp_path / "traced").mkdir()
    cfg, hooks = load_config(str(write_toy_config(tmp_path / "traced", tmp_path / "traced" / "run",
                                                  SMALL.format(epoch=1) + HOOKS_LINE)),
                             ["structured_logging.enabled=True"], world_size=1)
    traced = build_trainer(cfg, hooks=hooks, tracer=build_tracer(cfg.structured_logging, cfg.save_path, 0, 1))
    traced.train()
    losses = [[r["train/loss"] for r in records(t.save_path) if "train/loss" in r] for t in (plain, traced)]
    assert len(losses[0]) == 4 and losses[0] == losses[1]
    for a, b in zip(plain.model_without_ddp.parameters(), traced.model_without_ddp.parameters()):
        assert torch.equal(a, b)
    spans = [r["name"] for path in sorted((traced.save_path / "trace").glob("*.jsonl"))
             for r in map(json.loads, path.read_text().splitlines()) if r["ph"] == "X"]
    assert spans.count("step") == 4 and spans.count("after_step") == 4
