"""Evaluators in upstream pimm's vocabulary: class count, names and ignore
label from ``cfg.data``, upstream's SemSegEvaluator arguments, and the added
precision / F1 scores against values worked out by hand."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from pimm.engines.hooks.base import build_hooks
from pimm.evaluation import ClsEvaluator, SemSegEvaluator
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError

T = torch.tensor
NAMES = ["shower", "track", "michel", "delta"]


def config(**data):
    return Config(dict(data=dict(train=dict(type="X"), **data)))


def logits_for(pred, k=4):
    return F.one_hot(T(pred), k).float()


def run(evaluator, batches):
    evaluator.trainer = types.SimpleNamespace(device=torch.device("cpu"))
    evaluator.reset()
    for input_dict, output_dict in batches:
        evaluator.process(input_dict, output_dict)
    return evaluator.compute(evaluator.accumulators())


# Kept (target, pred): (0,0) (0,1) (1,1) (1,1) (0,0) (1,1) (1,2) (0,0); one
# point with target 255 predicted shower.  Confusion rows = target:
# shower [3,1,0,0]  track [0,3,1,0]  michel [0,0,0,0]  delta [0,0,0,0].
# Precision = hit / predicted: shower 3/3, track 3/4, michel 0/1, delta nan.
# F1 = 2 hit / (predicted + target): shower 6/7, track 6/8, michel 0, delta nan.
BATCHES = [({"segment": T([[0], [0], [1], [1], [255]])}, {"seg_logits": logits_for([0, 1, 1, 1, 0])}),
           ({"segment": T([0, 1, 1, 0])}, {"sem_logits": logits_for([0, 1, 2, 0])})]


def test_classes_names_and_ignore_index_come_from_data():
    hooks = build_hooks([dict(type="SemSegEvaluator")])
    evaluator = hooks[0]
    assert evaluator.num_classes is None
    evaluator.modify_config(config(num_classes=4, names=NAMES, ignore_index=255))
    assert (evaluator.num_classes, evaluator.class_names, evaluator.ignore_index) == (4, NAMES, 255)
    metrics = run(evaluator, BATCHES)  # (N, 1) targets and sem_logits, as upstream models produce
    assert metrics["confusion"] == [[3, 1, 0, 0], [0, 3, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]]
    assert metrics["iou_track"] == pytest.approx(0.6)
    assert metrics["precision_shower"] == 1.0 and metrics["precision_track"] == 0.75
    assert metrics["precision_michel"] == 0.0 and math.isnan(metrics["precision_delta"])
    assert metrics["f1_shower"] == pytest.approx(6 / 7) and metrics["f1_michel"] == 0.0
    assert metrics["mPrecision"] == pytest.approx(1.75 / 3)
    assert metrics["mF1"] == pytest.approx((6 / 7 + 0.75) / 3)
    assert metrics["mRecall"] == metrics["mAcc"] == pytest.approx(0.75)


def test_explicit_arguments_win_and_names_only_follow_matching_data():
    evaluator = SemSegEvaluator(num_classes=4, class_names=["a", "b", "c", "d"], ignore_index=-1)
    evaluator.modify_config(config(num_classes=4, names=NAMES, ignore_index=255))
    assert evaluator.class_names == ["a", "b", "c", "d"] and evaluator.ignore_index == -1
    other = SemSegEvaluator(num_classes=3)  # e.g. a 3-class head on 4-class data
    other.modify_config(config(num_classes=4, names=NAMES))
    assert other.class_names == ["0", "1", "2"]
    by_names = SemSegEvaluator(class_names=["x", "y"])
    by_names.modify_config(config())
    assert by_names.num_classes == 2 and by_names.ignore_index == -1
    names_only = SemSegEvaluator()
    names_only.modify_config(config(names=NAMES))
    assert names_only.num_classes == 4
    cls = ClsEvaluator()
    cls.modify_config(config(num_classes=2, names=["electron", "muon"]))
    assert cls.num_classes == 2 and cls.class_names == ["electron", "muon"]


def test_missing_or_inconsistent_classes_are_config_errors():
    with pytest.raises(ConfigError, match="SemSegEvaluator does not know the number of classes.*data.num_classes"):
        SemSegEvaluator().modify_config(config())
    with pytest.raises(ConfigError, match="data.names has 3 names for num_classes=4"):
        SemSegEvaluator().modify_config(config(num_classes=4, names=NAMES[:3]))
    with pytest.raises(ConfigError, match="data.num_classes"):
        SemSegEvaluator().modify_config(config(num_classes=0))
    with pytest.raises(ConfigError, match="ignore_index"):
        SemSegEvaluator(num_classes=2).modify_config(config(ignore_index="none"))
    with pytest.raises(ConfigError, match="ClsEvaluator does not know the number of classes"):
        run(ClsEvaluator(), [])  # built outside a trainer and never configured
    with pytest.raises(ConfigError, match="class_names"):
        ClsEvaluator(num_classes=3, class_names=["a"])


def test_upstream_semseg_arguments():
    macro = SemSegEvaluator(num_classes=4, class_names=NAMES, ignore_index=255, macro_ignore_class_ids=[2])
    metrics = run(macro, BATCHES)
    assert metrics["mIoU"] == pytest.approx((0.75 + 0.6) / 2)  # michel (IoU 0) left out of the mean
    assert metrics["iou_michel"] == 0.0
    assert "* left out" in macro.report(metrics)
    quiet = SemSegEvaluator(num_classes=4, class_names=NAMES, ignore_index=255, write_cls_iou=False)
    metrics = run(quiet, BATCHES)
    assert "iou_shower" not in metrics and metrics["per_class"]["iou_shower"] == 0.75
    assert quiet.report(metrics).splitlines()[1].split()[:3] == ["shower", "0.7500", "0.7500"]
    assert SemSegEvaluator(num_classes=2, every_n_steps=0).every_n_steps is None  # 0: after each epoch
    with pytest.raises(ConfigError, match="per_instance_metrics"):
        SemSegEvaluator(per_instance_metrics=True)
    with pytest.raises(ConfigError, match=r"macro_ignore_class_ids \[7\]"):
        SemSegEvaluator(macro_ignore_class_ids=[7]).modify_config(config(num_classes=4))
    evaluator = SemSegEvaluator(num_classes=4)
    evaluator.trainer = types.SimpleNamespace(device=torch.device("cpu"))
    evaluator.reset()
    with pytest.raises(KeyError, match="seg_logits"):
        evaluator.process({"segment": T([0])}, {"logits": logits_for([0])})
