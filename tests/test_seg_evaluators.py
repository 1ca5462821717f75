"""SemSegEvaluator and InsSegEvaluator against scores worked out by hand.

The evaluators are driven directly (reset / process / accumulators / compute)
with a fake trainer, and once through ``EvaluatorBase.evaluate`` with a fixed
model, so the accumulation over batches and the hook plumbing are both checked.
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch
import torch.nn.functional as F

from pimm.engines.registries import HOOKS
from pimm.evaluation import InsSegEvaluator, SemSegEvaluator
from pimm.utils.errors import ConfigError

T = torch.tensor
NAMES = ["shower", "track", "michel", "delta"]


def fake_trainer(**extra):
    return types.SimpleNamespace(device=torch.device("cpu"), **extra)


def logits_for(pred_labels, num_classes=4):
    """Logits whose argmax is ``pred_labels``."""
    return F.one_hot(T(pred_labels), num_classes).float() * 3.0 - 1.0


def run(evaluator, batches):
    """[(input, output), ...] -> compute(accumulators()), as the hook does on one rank."""
    evaluator.trainer = fake_trainer()
    evaluator.reset()
    for input_dict, output_dict in batches:
        evaluator.process(input_dict, output_dict)
    return evaluator.compute(evaluator.accumulators())


def assert_metrics(metrics, expected):
    for key, value in expected.items():
        if isinstance(value, float) and math.isnan(value):
            assert math.isnan(metrics[key]), (key, metrics[key])
        else:
            assert metrics[key] == pytest.approx(value), (key, metrics[key], value)


# ------------------------------------------------------------------ semantic

def semseg_batches(ignore):
    # Batch 1: point 4 is ignored (its prediction, shower, must not count).
    # Batch 2: one track point predicted michel.
    # Kept (target, pred): (0,0) (0,1) (1,1) (1,1) | (0,0) (1,1) (1,2) (0,0)
    # Confusion, rows = target:   shower [3,1,0,0]  track [0,3,1,0]
    #                             michel [0,0,0,0]  delta [0,0,0,0]
    return [
        ({"segment": T([0, 0, 1, 1, ignore])}, {"seg_logits": logits_for([0, 1, 1, 1, 0])}),
        ({"segment": T([0, 1, 1, 0])}, {"seg_logits": logits_for([0, 1, 2, 0])}),
    ]


# IoU = hit / (in target + in pred - hit):
#   shower 3/(4+3-3) = 0.75; track 3/(4+4-3) = 0.6; michel 0/(0+1-0) = 0 (only
#   predicted); delta nan (absent everywhere).  mIoU = (0.75+0.6+0)/3 = 0.45.
# acc = hit / in target: shower 3/4, track 3/4, michel nan, delta nan; mAcc 0.75.
# allAcc = 6 correct / 8 kept points.
SEMSEG_EXPECTED = {
    "mIoU": 0.45, "mAcc": 0.75, "allAcc": 0.75,
    "iou_shower": 0.75, "iou_track": 0.6, "iou_michel": 0.0, "iou_delta": math.nan,
    "acc_shower": 0.75, "acc_track": 0.75, "acc_michel": math.nan, "acc_delta": math.nan,
}


@pytest.mark.parametrize("ignore", [-1, 255])
def test_semseg_scores_by_hand(ignore):
    evaluator = SemSegEvaluator(num_classes=4, ignore_index=ignore, class_names=NAMES)
    metrics = run(evaluator, semseg_batches(ignore))
    assert_metrics(metrics, SEMSEG_EXPECTED)
    assert metrics["points"] == [4, 4, 0, 0]
    assert metrics["confusion"] == [[3, 1, 0, 0], [0, 3, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert SemSegEvaluator.metric_name == "mIoU" and SemSegEvaluator.greater_is_better
    acc = evaluator.accumulators()["confusion"]
    assert acc.dtype == torch.int64 and acc.device.type == "cpu"


def test_semseg_reset_clears_and_report_names_classes():
    evaluator = SemSegEvaluator(num_classes=4, class_names=NAMES)
    run(evaluator, semseg_batches(-1))
    evaluator.reset()
    assert int(evaluator.accumulators()["confusion"].sum()) == 0
    metrics = run(evaluator, semseg_batches(-1))
    table = evaluator.report(metrics)
    lines = table.splitlines()
    for name in NAMES:
        assert any(line.startswith(name) for line in lines), table
    shower = next(line for line in lines if line.startswith("shower")).split()
    assert shower == ["shower", "0.7500", "0.7500", "4"]
    delta = next(line for line in lines if line.startswith("delta")).split()
    assert delta == ["delta", "nan", "nan", "0"]


def test_semseg_default_names_keys_and_errors():
    metrics = run(SemSegEvaluator(num_classes=4), semseg_batches(-1))
    assert metrics["iou_1"] == pytest.approx(0.6) and math.isnan(metrics["acc_3"])
    evaluator = SemSegEvaluator(num_classes=3, logits_key="logits")
    evaluator.trainer = fake_trainer()
    evaluator.reset()
    with pytest.raises(KeyError, match="logits"):
        evaluator.process({"segment": T([0])}, {"seg_logits": logits_for([0], 3)})
    with pytest.raises(ValueError, match=r"\(N, 3\)"):
        evaluator.process({"segment": T([0])}, {"logits": logits_for([0], 4)})
    with pytest.raises(ConfigError, match="class_names"):
        SemSegEvaluator(num_classes=3, class_names=NAMES)
    with pytest.raises(ConfigError, match="num_classes"):
        SemSegEvaluator(num_classes=0)


# ------------------------------------------------------------------ instance

def inseg_batches(ignore, with_logits=True):
    """Three events with a labelled point, one without.

    Batch A, event 0 (points 0-5): gt ids [0,0,0,1,1,-1], pred [5,5,5,7,7,7].
      Point 5 is ignored, so pred 7 is {3,4}: both instances match with IoU 1.
      ARI 1 (identical partitions).  tp 2.
      Classes: gt0 shower, gt1 track; pred5 shower, pred7 track -> shower tp, track tp.
    Batch A, event 1 (points 6-9): gt [1,1,2,2], pred [7,7,7,9].
      Ids 1 and 7 reappear from event 0 and must not merge with it.
      IoU(gt1, pred7) = 2/3 -> match; IoU(gt2, pred9) = 1/2, not above 0.5.
      tp 1, fp 1 (pred9), fn 1 (gt2).
      ARI: contingency cells (1,7)=2 (2,7)=1 (2,9)=1; index 1, rows C(2,2)*2 = 2,
      cols C(3,2) = 3, pairs C(4,2) = 6; expected 2*3/6 = 1, max 2.5 -> ARI 0.
      Classes: gt1 track, gt2 michel; pred7 votes [1,1,1] track, pred9 michel
      -> track tp; michel fp 1, fn 1.
    Batch B, event 0 (points 0-4): gt [0,0,1,1,1], pred [3,3,3,4,4].
      IoU(gt0, pred3) = 2/3, IoU(gt1, pred4) = 2/3 -> tp 2.
      ARI: cells 2,1,2 -> index 2; rows 1+3 = 4, cols 3+1 = 4, pairs 10;
      expected 1.6, max 4 -> ARI 0.4/2.4 = 1/6.
      Classes: gt0 shower, gt1 track (one point ignored, not voting);
      pred3 shower, pred4 predicted michel -> shower tp; the class mismatch
      leaves track fn 1 and michel fp 1.
    Batch B, event 1: no labelled point -> no ARI (nan, skipped), no instances.

    Class-agnostic: tp 5, fp 1, fn 1 -> precision = recall = F1 = 5/6.
    ARI = (1 + 0 + 1/6) / 3 = 7/18.
    Per class: shower tp 2 -> 1, 1, 1; track tp 2 fn 1 -> P 1, R 2/3, F1 4/5;
    michel tp 0 fp 2 fn 1 -> 0, 0, 0; delta absent -> nan. mF1 = 1.8/3 = 0.6.
    """
    a_in = {"instance": T([0, 0, 0, 1, 1, -1, 1, 1, 2, 2]), "offset": T([6, 10]),
            "segment": T([0, 0, 0, 1, 1, ignore, 1, 1, 2, 2])}
    a_out = {"instance_pred": T([5, 5, 5, 7, 7, 7, 7, 7, 7, 9])}
    b_in = {"instance": T([0, 0, 1, 1, 1, -1, -1]), "offset": T([5, 7]),
            "segment": T([0, 0, 1, ignore, 1, ignore, ignore])}
    b_out = {"instance_pred": T([3, 3, 3, 4, 4, 0, 0])}
    if with_logits:
        a_out["seg_logits"] = logits_for([0, 0, 0, 1, 1, 2, 1, 1, 1, 2])
        b_out["seg_logits"] = logits_for([0, 0, 0, 2, 2, 1, 1])
    return [(a_in, a_out), (b_in, b_out)]


INSEG_AGNOSTIC = {"ARI": 7 / 18, "precision": 5 / 6, "recall": 5 / 6, "F1": 5 / 6}
INSEG_PER_CLASS = {
    "precision_shower": 1.0, "recall_shower": 1.0, "F1_shower": 1.0,
    "precision_track": 1.0, "recall_track": 2 / 3, "F1_track": 0.8,
    "precision_michel": 0.0, "recall_michel": 0.0, "F1_michel": 0.0,
    "precision_delta": math.nan, "recall_delta": math.nan, "F1_delta": math.nan,
    "mF1": 0.6,
}


@pytest.mark.parametrize("ignore", [-1, 255])
def test_inseg_scores_by_hand(ignore):
    evaluator = InsSegEvaluator(num_classes=4, ignore_index=ignore, class_names=NAMES)
    metrics = run(evaluator, inseg_batches(ignore))
    assert_metrics(metrics, {**INSEG_AGNOSTIC, **INSEG_PER_CLASS})
    assert metrics["counts"] == {"tp": 5, "fp": 1, "fn": 1}
    assert metrics["class_counts"]["michel"] == {"tp": 0, "fp": 2, "fn": 1}
    acc = evaluator.accumulators()
    assert int(acc["ari_events"]) == 3  # the unlabelled event is skipped
    assert acc["ari_sum"].dtype == torch.float64 and acc["counts"].dtype == torch.int64
    assert InsSegEvaluator.metric_name == "ARI" and InsSegEvaluator.greater_is_better


def test_inseg_events_do_not_merge():
    # Batch A alone: tp 3 (event 0: 2, event 1: 1), fp 1, fn 1. Read as one
    # event, gt 1 = {3,4,6,7} and pred 7 = {3,4,6,7,8} would match at 4/5 and
    # the counts would differ (tp 2, fp 1, fn 1).
    batch = inseg_batches(-1, with_logits=False)[0]
    metrics = run(InsSegEvaluator(num_classes=4), [batch])
    assert metrics["counts"] == {"tp": 3, "fp": 1, "fn": 1}
    assert metrics["ARI"] == pytest.approx(0.5)  # (1 + 0) / 2
    merged = ({**batch[0], "offset": T([10])}, batch[1])
    assert run(InsSegEvaluator(num_classes=4), [merged])["counts"] == {"tp": 2, "fp": 1, "fn": 1}


def test_inseg_without_logits_is_class_agnostic():
    evaluator = InsSegEvaluator(num_classes=4, class_names=NAMES)
    metrics = run(evaluator, inseg_batches(-1, with_logits=False))
    assert_metrics(metrics, INSEG_AGNOSTIC)
    assert not any(key.startswith(("F1_", "precision_", "recall_")) for key in metrics)
    assert "mF1" not in metrics
    assert "class-agnostic" in evaluator.report(metrics)
    # logits_key=None ignores logits even when the model gives them.
    metrics = run(InsSegEvaluator(num_classes=4, logits_key=None), inseg_batches(-1))
    assert "F1_0" not in metrics and metrics["F1"] == pytest.approx(5 / 6)


def test_inseg_report_and_empty_and_errors():
    evaluator = InsSegEvaluator(num_classes=4, class_names=NAMES)
    metrics = run(evaluator, inseg_batches(-1))
    table = evaluator.report(metrics)
    lines = table.splitlines()
    for name in NAMES:
        assert any(line.startswith(name) for line in lines), table
    assert next(line for line in lines if line.startswith("track")).split() == \
        ["track", "1.0000", "0.6667", "0.8000", "2", "0", "1"]
    assert "0.3889" in lines[0]  # ARI 7/18

    # No batches at all: every score undefined, nothing crashes.
    empty = run(InsSegEvaluator(num_classes=2), [])
    assert all(math.isnan(empty[k]) for k in ("ARI", "precision", "recall", "F1"))

    evaluator.reset()
    with pytest.raises(KeyError, match="instance_pred"):
        evaluator.process(inseg_batches(-1)[0][0], {})
    bad_offset = {**inseg_batches(-1)[0][0], "offset": T([6, 9])}
    with pytest.raises(ValueError, match="offset"):
        evaluator.process(bad_offset, inseg_batches(-1)[0][1])
    with pytest.raises(ConfigError, match="iou_threshold"):
        InsSegEvaluator(num_classes=4, iou_threshold=1.0)


# ------------------------------------------------------- through evaluate()

class FixedModel(torch.nn.Module):
    """Returns prepared outputs in order, with a loss, and records its mode."""

    def __init__(self, outputs, losses):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.outputs, self.losses = outputs, losses
        self.calls, self.modes = 0, []

    def forward(self, batch):
        self.modes.append(self.training)
        out = dict(self.outputs[self.calls], loss=torch.tensor(self.losses[self.calls]))
        self.calls += 1
        return out


@pytest.mark.parametrize("kind", ["semseg", "inseg"])
def test_evaluate_path(kind):
    if kind == "semseg":
        evaluator, pairs, expected = SemSegEvaluator(4, class_names=NAMES), semseg_batches(-1), SEMSEG_EXPECTED
    else:
        evaluator, pairs = InsSegEvaluator(4, class_names=NAMES), inseg_batches(-1)
        expected = {**INSEG_AGNOSTIC, **INSEG_PER_CLASS}
    model = FixedModel([out for _, out in pairs], losses=[1.0, 2.0])
    model.train()
    evaluator.trainer = fake_trainer(autocast=contextlib.nullcontext, to_device=lambda batch: batch)
    loader = [inp for inp, _ in pairs]
    metrics = evaluator.evaluate(loader, model)  # the model the trainer hands over
    assert_metrics(metrics, expected)
    assert metrics["loss"] == pytest.approx(1.5)
    assert model.modes == [False, False] and model.training  # eval inside, train mode restored
    assert HOOKS.get(type(evaluator).__name__) is type(evaluator)
