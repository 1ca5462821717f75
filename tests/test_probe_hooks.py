"""Upstream's OnlineLinearProbe and EventLinearProbeEvaluator: what they fit,
what they log, that they leave the run alone, and their one-line refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pimm.engines.registries import HOOKS, MODELS
from pimm.evaluation.probes import class_scores
from pimm.utils.errors import ConfigError
from tests.support.inprocess import hook_of, make_trainer, records


@MODELS.register_module("ProbeToyMLP", force=True)
class ProbeToyMLP(nn.Module):
    """The toy MLP, stashing its detached hidden features and labels for the probe (as upstream's models do)."""

    def __init__(self, dim=8, hidden=16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 2)

    def forward(self, batch):
        hidden = self.body(batch["x"])
        self._probe_feat = hidden.detach()
        self._probe_segment_motif = batch["label"]
        logits = self.head(hidden)
        return {"cls_logits": logits, "loss": nn.functional.cross_entropy(logits, batch["label"])}


def test_online_probe_learns_logs_and_leaves_the_model_alone(tmp_path):
    hooks = '[dict(type="OnlineLinearProbe", num_classes=2, lr=0.05, log_frequency=4, class_names=["a", "b"])]'
    probed = make_trainer(tmp_path / "probed", hooks, extra='model = dict(type="ProbeToyMLP")\n', epoch=3)
    probed.train()
    plain = make_trainer(tmp_path / "plain", "[]", extra='model = dict(type="ProbeToyMLP")\n', epoch=3)
    plain.train()
    for (name, a), (_, b) in zip(plain.model_without_ddp.state_dict().items(),
                                 probed.model_without_ddp.state_dict().items()):
        assert torch.equal(a, b), name  # no gradient and no random draw leaked into the run
    rows = [r for r in records(tmp_path / "probed" / "run") if "online_probe/accuracy" in r]
    assert [r["step"] for r in rows] == [4, 8, 12]
    assert {"online_probe/macro_f1", "online_probe/f1_a", "online_probe/precision_b"} <= set(rows[0])
    hook = hook_of(probed, "OnlineLinearProbe")
    restored = HOOKS.build(dict(type="OnlineLinearProbe", num_classes=2, lr=0.05, log_frequency=4))
    restored.trainer = probed
    restored.load_state_dict(hook.state_dict())
    for a, b in zip(hook.probe.parameters(), restored.probe.parameters()):
        assert torch.equal(a, b)
    assert restored.step_count == hook.step_count == 12


def test_online_probe_does_nothing_without_stashed_features(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="OnlineLinearProbe", num_classes=2)]')
    trainer.train()
    assert hook_of(trainer, "OnlineLinearProbe").probe is None


class _EventModel(nn.Module):
    def forward(self, batch, return_point=False):
        return {"point": {"feat": batch["feat"], "offset": batch["offset"]}}


def _event_batches(n_events=40, points=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_events) % 2
    batches = []
    for chunk in labels.split(8):
        feat = torch.cat([torch.randn(points, 3, generator=g) + torch.tensor([3.0 * int(c), 0.0, 0.0])
                          for c in chunk])
        batches.append(dict(feat=feat, offset=torch.arange(1, len(chunk) + 1) * points, event_label=chunk.clone()))
    return batches


class _Metrics:
    def __init__(self):
        self.rows = []

    def publish_local(self, scalars, step=None):
        self.rows.append((step, scalars))


def _fake_trainer(split="val"):
    loader = SimpleNamespace(dataset=SimpleNamespace(split=split))
    loader.__iter__ = None
    batches = _event_batches()

    class Loader(list):
        dataset = SimpleNamespace(split=split)

    return SimpleNamespace(model_without_ddp=_EventModel(), val_loader=Loader(batches), device=torch.device("cpu"),
                           autocast=torch.autograd.grad_mode.no_grad, cfg=dict(evaluate=True, data=dict(
                               names=["electron", "muon"])), metrics=_Metrics(), logger=logging.getLogger("pimm"),
                           comm_info={}, global_step=7, train_loader=SimpleNamespace(
                               dataset=SimpleNamespace(split="train")))


def test_event_probe_separates_separable_events_and_publishes_the_best_f1():
    hook = HOOKS.build(dict(type="EventLinearProbeEvaluator", train_config=dict(learning_rates=[1e-3, 0.1],
                                                                                  epochs=50)))
    trainer = _fake_trainer()
    hook.trainer = trainer
    metrics = hook.evaluate()
    assert metrics["event_probe/val/mF1"] == 1.0 and metrics["event_probe/val/mIoU"] == 1.0
    assert "event_probe/val/cls_1-muon F1" in metrics
    assert trainer.comm_info["current_metric_name"] == "event_probe/mF1"
    assert trainer.comm_info["current_metric_value"] == 1.0
    assert trainer.metrics.rows[0][0] == 7


def test_event_probe_split_is_per_class_and_seeded():
    hook = HOOKS.build(dict(type="EventLinearProbeEvaluator", train_fraction=0.25, seed=3))
    x, y = torch.arange(20.0)[:, None], torch.arange(20) % 2
    a = hook.split(x, y)
    b = hook.split(x, y)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert (a[1] == 0).sum() == (a[1] == 1).sum() == round(10 * 0.25)
    assert not set(a[0].flatten().tolist()) & set(a[2].flatten().tolist())


@pytest.mark.parametrize("split", ["train", "all"])
def test_event_probe_refuses_training_data(split):
    hook = HOOKS.build(dict(type="EventLinearProbeEvaluator"))
    hook.trainer = _fake_trainer(split)
    with pytest.raises(ConfigError, match="not held-out"):
        hook.evaluate()


def test_class_scores_match_hand_counts():
    s = class_scores(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 1, 1, 1]), 2)
    assert s["precision"].tolist() == [0.5, 1.0] and s["recall"].tolist() == pytest.approx([1.0, 2 / 3])
    assert s["iou"].tolist() == pytest.approx([0.5, 2 / 3])


@pytest.mark.parametrize("cfg, words", [
    (dict(type="EventLinearProbeEvaluator", train_fraction=1.0), "train_fraction"),
    (dict(type="EventLinearProbeEvaluator", train_config=dict(lr=0.1)), "train_config"),
    (dict(type="OnlineLinearProbe", num_classes=3, weight=[1.0, 2.0]), "weight"),
])
def test_bad_arguments_are_one_line(cfg, words):
    with pytest.raises(ConfigError, match=words):
        HOOKS.build(cfg)
