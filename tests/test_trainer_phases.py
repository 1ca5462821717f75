"""DefaultTrainer built in named phases, testing outside the trainer (Tester),
and one prepare_config for the command line and for trainers built from Python."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import TRAINERS, DefaultTrainer, TrainerBase  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config, prepare_config  # noqa: E402
from pimm.engines import testers  # noqa: E402
from pimm.utils.config import Config  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.inprocess import SMALL, make_trainer  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402

HOOKS = 'hooks = [dict(type="ClsEvaluator", num_classes=2), dict(type="CheckpointSaver", async_write=False)]\n'


def _config(tmp_path, body: str = "", name: str = "run") -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_toy_config(tmp_path, tmp_path / name, SMALL.format(epoch=1) + HOOKS + body)


def test_init_reads_as_its_phases_and_every_track_call_is_in_one_block():
    source = inspect.getsource(DefaultTrainer.__init__)
    phases = ["self.configure_process()", "self.build_components(", "self.register_state()", "self.wire_hooks("]
    positions = [source.index(p) for p in phases]
    assert positions == sorted(positions)
    assert "mode" not in inspect.signature(DefaultTrainer.__init__).parameters
    # track() is called in register_state only (pimm's trainers add theirs through extra_state).
    for cls in {TRAINERS.get(name) for name in TRAINERS.keys()} - {None}:
        if not cls.__module__.startswith("pimm."):
            continue
        for name, member in vars(cls).items():
            if callable(member) and name not in ("register_state", "track"):
                assert "self.track(" not in inspect.getsource(member), f"{cls.__name__}.{name} calls track()"


class WithCounter(DefaultTrainer):
    """A trainer that adds one participant through extra_state."""

    def build_components(self, *args, **kwargs):
        super().build_components(*args, **kwargs)
        self.counter = torch.nn.Linear(1, 1)

    def extra_state(self):
        return [("counter", self.counter, "rank")]


def test_a_trainer_adds_state_before_the_hooks(tmp_path):
    cfg, hooks = load_config(str(_config(tmp_path)), [], world_size=1)
    trainer = WithCounter(cfg, hooks=hooks)
    names = list(trainer.checkpointer.participants())
    assert names[-3:] == ["loader", "counter", "hooks"]


def test_a_trainer_built_from_python_prepares_its_config_like_the_command_line(tmp_path):
    path = _config(tmp_path, 'hooks = hooks + [dict(type="CheckpointLoader", key_map=[("a.", "b.")])]\n')
    cfg = Config.fromfile(str(path))
    assert cfg.weight_key_map is None
    del cfg["grad_accum_steps"]  # a key the config leaves out
    trainer = DefaultTrainer(cfg)  # no hooks given: prepare_config runs here
    assert cfg.grad_accum_steps == 1  # the runtime defaults were applied
    assert cfg.weight_key_map == [["a.", "b."]]  # hooks' modify_config ran
    # The named default_hooks too, as on the command line; the list's CheckpointLoader and
    # CheckpointSaver replace the defaults of their types.
    assert [type(h).__name__ for h in trainer.hooks] == [
        "CheckpointLoader", "IterationTimer", "InformationWriter", "ClsEvaluator", "LiveControl",
        "OnDemandValidation", "ProgressBar", "CheckpointSaver"]
    assert [h.origin for h in trainer.hooks if type(h).__name__.startswith("Checkpoint")] == ["hooks[2]", "hooks[1]"]
    # A bad value gives the command line's one-line error, from Python too.
    bad = Config.fromfile(str(path))
    bad.batch_size = 0
    with pytest.raises(ConfigError, match="batch_size"):
        DefaultTrainer(bad)
    with pytest.raises(ConfigError, match="mode must be 'train' or 'test'"):
        prepare_config(Config.fromfile(str(path)), 1, mode="serve")


def test_testing_builds_a_tester_not_a_half_built_trainer(tmp_path):
    trainer = make_trainer(tmp_path / "a", '[dict(type="ClsEvaluator", num_classes=2), '
                                           'dict(type="CheckpointSaver", async_write=False)]', epoch=1)
    trainer.train()
    weight = trainer.save_path / "model" / "model_last.pth"
    expected = trainer.test(weight)["ClsEvaluator"]
    cfg, hooks = load_config(str(_config(tmp_path / "b")), [f"weight={weight}"], world_size=1, mode="test")
    tester = build_trainer(cfg, mode="test", hooks=hooks)
    assert isinstance(tester, testers.Tester) and not isinstance(tester, TrainerBase)
    assert not hasattr(tester, "optimizer") and not hasattr(tester, "train")
    results = tester.test()["ClsEvaluator"]
    assert results == expected  # the same weights score the same through either
    written = json.loads((tester.save_path / "test_metrics.json").read_text())
    assert written["weight"] == str(weight) and written["metrics"]["ClsEvaluator"] == results


def test_the_tester_collates_as_the_trainer_the_config_names(tmp_path):
    cfg, hooks = load_config(str(_config(tmp_path)), ["train.type=InsegTrainer", "weight=None"], world_size=1,
                             mode="train")
    tester = testers.Tester(cfg, hooks=hooks)
    assert tester.default_collate_fn == "inseg_collate_fn" == TRAINERS.get("InsegTrainer").default_collate_fn
    assert tester.test_loader.collate_fn.__name__ == "inseg_collate_fn"
    with pytest.raises(ConfigError, match="needs the weights"):
        tester.test()
