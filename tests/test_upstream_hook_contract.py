"""Upstream's extension examples run on pimm unmodified, and the hook contract
they write against (``trainer.writer``, ``trainer.storage``, ``trainer.comm_info``,
``trainer.best_metric_value``) is a view over pimm's metric channel:
``my/value`` reaches metrics.jsonl, TensorBoard and W&B; a user evaluator's
published metric decides ``model_best.pth``."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tests.support import fake_wandb
from tests.support.inprocess import committed_steps

ROOT = Path(__file__).resolve().parents[1]

CONFIG = '''
_base_ = {base!r}
custom_imports = ["tests.support.upstream_examples.glue"]
save_path = {save_path!r}
epoch = {epoch}
batch_size = 4
num_worker = 0
use_wandb = {use_wandb}
model = dict(
    type="MySegmentor",
    num_classes=3,
    backbone_out_channels=16,
    backbone=dict(type="TinyPointBackbone", in_channels=4, out_channels=16),
    criteria=[
        dict(type="CrossEntropyLoss", ignore_index=-1, loss_weight=1.0),
        dict(type="TverskyLoss", alpha=0.3, beta=0.7, ignore_index=-1, loss_weight=1.0),
    ],
)
_transform = [
    dict(type="RandomEnergyDropout", ratio=0.1, p=0.5),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "segment"), feat_keys=("coord", "energy")),
]
data = dict(
    train=dict(type="MyEvents", data_root={data_root!r}, split="train", transform=_transform),
    val=dict(type="MyEvents", data_root={data_root!r}, split="val", transform=_transform[1:]),
)
train = dict(type="DefaultTrainer", collate_fn="point_collate_fn", val_collate_fn="point_collate_fn")
optimizer = dict(type="AdamW", lr=0.01)
hooks = [
    dict(type="InformationWriter", log_frequency=2),
    dict(type="MyScalarHook", every=2),
    {evaluator},
    dict(type="CheckpointSaver", keep_last=1, keep_best=True),
]
'''


@pytest.fixture
def events(tmp_path):
    from tests.support.upstream_examples.glue import write_events

    write_events(tmp_path / "data", "train", 16, seed=0)
    write_events(tmp_path / "data", "val", 8, seed=1)
    return tmp_path / "data"


@pytest.fixture
def wandb_stand_in(monkeypatch):
    fake_wandb.reset()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    return fake_wandb


def _train(tmp_path, events, *, epoch=3, values=None, greater=True, use_wandb=False, options=(), run="run",
           evaluator=None):
    from pimm.engines.run.launch import build_trainer, load_config

    cfg_path = tmp_path / f"{run}_cfg.py"
    cfg_path.write_text(CONFIG.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                                      save_path=str(tmp_path / run), epoch=epoch, data_root=str(events),
                                      use_wandb=use_wandb, evaluator=evaluator or
                                      f"dict(type='UpstreamStyleEvaluator', values={values!r}, "
                                      f"greater_is_better={greater!r})"))
    cfg, hooks = load_config(str(cfg_path), list(options), world_size=1)
    trainer = build_trainer(cfg, hooks=hooks)
    trainer.train()
    return trainer


def _records(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in open(save_path / "metrics.jsonl")]


def _tensorboard_tags(save_path: Path) -> dict[str, list[int]]:
    """``{tag: [steps]}`` of the scalars in the run's event files (read with
    tensorboardX's protos: records are length, crc, Event, crc)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    tags: dict[str, list[int]] = {}
    for path in sorted((save_path / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    tags.setdefault(value.tag, []).append(event.step)
    return tags


def test_the_four_examples_train_and_my_value_reaches_every_sink(tmp_path, events, wandb_stand_in):
    trainer = _train(tmp_path, events, use_wandb=True)
    save_path = tmp_path / "run"
    assert trainer.global_step == 12  # 16 events / batch 4 * 3 epochs
    # The model, the loss and the transform of the examples were the ones used.
    assert type(trainer.model_without_ddp).__name__ == "MySegmentor"
    assert [type(c).__name__ for c in trainer.model_without_ddp.criteria.losses] == ["CrossEntropyLoss",
                                                                                    "TverskyLoss"]
    assert type(trainer.train_loader.dataset.transform.transforms[0]).__name__ == "RandomEnergyDropout"
    records = _records(save_path)
    jsonl_steps = [r["step"] for r in records if "my/value" in r]
    assert jsonl_steps == [2, 4, 6, 8, 10, 12] and all(r["my/value"] == 1.0 for r in records if "my/value" in r)
    assert _tensorboard_tags(save_path)["my/value"] == [2, 4, 6, 8, 10, 12]
    run = wandb_stand_in.runs[-1]
    assert [step for step, _ in wandb_stand_in.history(run.id, "my/value")] == [2, 4, 6, 8, 10, 12]
    assert not run.dropped
    # The evaluator's writer calls and storage averages went out too.
    assert [r["step"] for r in records if "val/point_acc" in r] == [4, 8, 12]
    assert all(0.0 <= r["val/point_acc"] <= 1.0 for r in records if "val/point_acc" in r)


def test_a_user_evaluators_published_metric_decides_model_best(tmp_path, events):
    trainer = _train(tmp_path, events, values=[0.2, 0.9, 0.5])
    best = torch.load(tmp_path / "run" / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == 0.9 and best["metric_name"] == "val/published" and best["global_step"] == 8
    assert trainer.best_metric_value == 0.9
    assert committed_steps(tmp_path / "run") == [8, 12]  # keep_best kept the best checkpoint beside the newest


def test_a_metric_published_mid_epoch_saves_that_steps_weights(tmp_path, events):
    """The best is taken after the step that published it, not at the next checkpoint."""
    from pimm.engines.hooks.base import HookBase

    trainer = _train(tmp_path, events, epoch=2, evaluator="dict(type='StepMetricPublisher', at={3: 0.9, 6: 0.5})")
    best = torch.load(tmp_path / "run" / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == 0.9 and best["global_step"] == 3 and best["metric_name"] == "val/stepwise"
    assert "current_metric_value" not in trainer.comm_info and isinstance(trainer.hooks[0], HookBase)
    assert trainer.comm_info["epoch"] == 1 and trainer.comm_info["iter_per_epoch"] == 4  # upstream's keys


def test_smaller_is_better_when_the_evaluator_says_so(tmp_path, events):
    trainer = _train(tmp_path, events, values=[0.5, 0.1, 0.3], greater=False)
    best = torch.load(tmp_path / "run" / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == 0.1 and best["global_step"] == 8
    assert trainer.metrics.direction("val/published") == "min"


def test_the_best_value_survives_a_resume(tmp_path, events):
    """Epoch 2's 0.9 stays the best when the resumed third epoch publishes 0.5."""
    _train(tmp_path, events, epoch=2, values=[0.2, 0.9, 0.5])
    trainer = _train(tmp_path, events, epoch=3, values=[0.2, 0.9, 0.5], options=["resume=True"])
    assert trainer.start_epoch == 2 and trainer.best_metric_value == 0.9
    best = torch.load(tmp_path / "run" / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == 0.9 and best["global_step"] == 8


def test_storage_histories_are_per_epoch_and_shared_on_the_channel():
    from pimm.engines.loop.trainer_base import TrainerBase

    trainer = TrainerBase()
    storage = trainer.storage
    storage.put_scalar("val_loss", 2.0)
    storage.put_scalar("val_loss", torch.tensor(4.0), n=3)
    history = storage.history("val_loss")
    assert (history.val, history.latest, history.total, history.count) == (4.0, 4.0, 14.0, 4)
    assert history.avg == pytest.approx(3.5)
    assert trainer.metrics.latest("val_loss") == 4.0
    storage.put_scalars(a=1.0, b=2.0)
    assert storage.latest()["b"] == (2.0, 0)
    trainer.reset_epoch_histories()
    assert storage.history("val_loss").count == 0 and storage.history("a").total == 0
    with pytest.raises(KeyError, match="no history 'nope'.*known: a, b, val_loss"):
        storage.history("nope")
    assert trainer.best_metric_value == -math.inf
    assert trainer.comm_info["iter_info"] == ""
