"""Metrics against values worked out by hand on small examples."""

from __future__ import annotations

import math

import pytest
import torch

from pimm.evaluation.metrics import (
    adjusted_rand_index,
    classification_scores,
    confusion_matrix,
    match_instances,
    match_instances_per_class,
    segmentation_scores,
)

T = torch.tensor
nan = float("nan")


def same(a, b):
    """Element-wise equality of float lists where nan == nan."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (math.isnan(x) and math.isnan(y)) or x == pytest.approx(y), (a, b)
    return True


# ------------------------------------------------------------- segmentation

# Point 5 is ignored; the kept (target, pred) pairs are
# (0,0) (0,1) (1,1) (1,1) (2,0) (2,2) (0,0). Class 3 never occurs.
SEG_TARGET = T([0, 0, 1, 1, 2, -1, 2, 0])
SEG_PRED = T([0, 1, 1, 1, 0, 2, 2, 0])
SEG_CONF = [
    [2, 1, 0, 0],
    [0, 2, 0, 0],
    [1, 0, 1, 0],
    [0, 0, 0, 0],
]


def test_confusion_matrix_counts_and_ignore():
    conf = confusion_matrix(SEG_PRED, SEG_TARGET, num_classes=4)
    assert conf.dtype == torch.int64 and conf.tolist() == SEG_CONF
    # A different ignore value: 255 marks the ignored point instead of -1.
    target = SEG_TARGET.clone()
    target[5] = 255
    assert confusion_matrix(SEG_PRED, target, 4, ignore_index=255).tolist() == SEG_CONF


def test_confusion_matrix_sums_over_chunks():
    # What an all_reduce(SUM) across ranks relies on.
    whole = confusion_matrix(SEG_PRED, SEG_TARGET, 4)
    parts = confusion_matrix(SEG_PRED[:3], SEG_TARGET[:3], 4) + confusion_matrix(SEG_PRED[3:], SEG_TARGET[3:], 4)
    assert torch.equal(whole, parts)


def test_confusion_matrix_rejects_out_of_range_labels():
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        confusion_matrix(T([0, 3]), T([0, 1]), 3)
    with pytest.raises(ValueError):
        confusion_matrix(T([0, 1]), T([0, -2]), 3)  # -2 is not the ignore index


def test_segmentation_scores_by_hand():
    scores = segmentation_scores(T(SEG_CONF))
    # IoU = hit / (row sum + column sum - hit):
    #   class 0: 2 / (3 + 3 - 2) = 1/2;  class 1: 2 / (2 + 3 - 2) = 2/3;
    #   class 2: 1 / (2 + 1 - 1) = 1/2;  class 3: 0/0 -> nan (absent everywhere).
    assert same(scores["iou"], [0.5, 2 / 3, 0.5, nan])
    assert scores["mIoU"] == pytest.approx((0.5 + 2 / 3 + 0.5) / 3)  # = 5/9
    # acc = hit / row sum: 2/3, 2/2, 1/2, nan.
    assert same(scores["acc"], [2 / 3, 1.0, 0.5, nan])
    assert scores["mAcc"] == pytest.approx(13 / 18)
    assert scores["allAcc"] == pytest.approx(5 / 7)  # 5 hits of 7 kept points


def test_segmentation_class_predicted_but_absent_from_target():
    # target [0, 0], pred [0, 2], 3 classes: class 2 is only predicted.
    scores = segmentation_scores(confusion_matrix(T([0, 2]), T([0, 0]), 3))
    # class 0: 1 / (2 + 1 - 1) = 1/2; class 1 nan; class 2: 0 / (0 + 1 - 0) = 0 (a false positive counts).
    assert same(scores["iou"], [0.5, nan, 0.0])
    assert scores["mIoU"] == pytest.approx(0.25)
    assert same(scores["acc"], [0.5, nan, nan])
    assert scores["mAcc"] == pytest.approx(0.5)
    assert scores["allAcc"] == pytest.approx(0.5)


def test_segmentation_scores_of_empty_matrix_are_nan():
    scores = segmentation_scores(torch.zeros(2, 2, dtype=torch.long))
    assert math.isnan(scores["mIoU"]) and math.isnan(scores["allAcc"])


def test_classification_scores_by_hand():
    # (target, pred): (0,0) (0,1) (1,1) (2,2) (2,2) (1,2); class 3 has no sample.
    conf = confusion_matrix(T([0, 1, 1, 2, 2, 2]), T([0, 0, 1, 2, 2, 1]), 4)
    scores = classification_scores(conf)
    assert scores["confusion"] == [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 2, 0], [0, 0, 0, 0]]
    assert scores["acc"] == pytest.approx(4 / 6)
    assert same(scores["class_acc"], [0.5, 0.5, 1.0, nan])
    assert scores["mAcc"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------- ARI


@pytest.mark.parametrize(
    "true, pred, expected",
    [
        # Cells 2,1,1 -> sum C(n_ij,2) = 1; rows (2,2) -> 2; cols (2,1,1) -> 1; C(4,2) = 6.
        # expected = 2*1/6 = 1/3, max = (2+1)/2 = 3/2 -> (1 - 1/3) / (3/2 - 1/3) = 4/7.
        ([0, 0, 1, 1], [0, 0, 1, 2], 4 / 7),
        # Cells 2,1,1,2 -> 2; rows (3,3) -> 6; cols (2,2,2) -> 3; C(6,2) = 15.
        # expected = 6*3/15 = 1.2, max = 4.5 -> 0.8 / 3.3 = 8/33.
        ([0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 2, 2], 8 / 33),
        # All cells 1 -> 0; rows 2, cols 2; expected 4/6, max 2 -> (-2/3)/(4/3) = -1/2.
        ([0, 0, 1, 1], [0, 1, 0, 1], -0.5),
        # One cluster vs singletons: index 0, rows 6, cols 0 -> expected 0, max 3 -> 0.
        ([0, 0, 0, 0], [0, 1, 2, 3], 0.0),
        # Identical partitions, and the two degenerate identical cases.
        ([3, 3, 8, 8, 8], [1, 1, 0, 0, 0], 1.0),
        ([4, 4, 4], [9, 9, 9], 1.0),
        ([0, 1, 2], [5, 6, 7], 1.0),
        ([2], [7], 1.0),
    ],
)
def test_adjusted_rand_index_known_values(true, pred, expected):
    assert adjusted_rand_index(T(true), T(pred)) == pytest.approx(expected, abs=1e-12)
    # Symmetric in its arguments.
    assert adjusted_rand_index(T(pred), T(true)) == pytest.approx(expected, abs=1e-12)


def test_adjusted_rand_index_ignores_true_minus_one_and_label_values():
    # After dropping the -1 points this is the 4/7 example above.
    assert adjusted_rand_index(T([0, 0, -1, 1, 1, -1]), T([0, 0, 5, 1, 2, 5])) == pytest.approx(4 / 7)
    torch.manual_seed(0)
    true = torch.randint(0, 5, (200,))
    pred = torch.randint(0, 4, (200,))
    perm_true = torch.randperm(5) * 1000 + 17  # relabel with arbitrary ids
    perm_pred = torch.randperm(4) - 50  # negative pred labels are ordinary labels
    assert adjusted_rand_index(perm_true[true], perm_pred[pred]) == pytest.approx(adjusted_rand_index(true, pred))
    assert math.isnan(adjusted_rand_index(T([-1, -1]), T([0, 1])))


# ---------------------------------------------------------------- instances

# gt instance 1 = points 0-3, instance 2 = points 4-7; points 8, 9 are ignored.
# pred 7 = points 0-2, pred 8 = points 4, 5 (+ ignored 8, 9), pred 9 = points 6, 7.
GT = T([1, 1, 1, 1, 2, 2, 2, 2, -1, -1])
PRED = T([7, 7, 7, -1, 8, 8, 9, 9, 8, 8])


def test_match_instances_threshold_is_strict():
    # IoU(1,7) = 3/4; IoU(2,8) = 2/(4+2-2) = 1/2; IoU(2,9) = 1/2.
    # Only (1,7) is > 0.5: tp 1, fp 2 (8 and 9), fn 1 (instance 2).
    assert match_instances(GT, PRED) == (1, 2, 1)
    assert match_instances(GT, PRED, iou_threshold=0.75) == (0, 3, 2)


def test_match_instances_low_threshold_is_one_to_one():
    # At 0.25 both 8 and 9 pass for instance 2 but only one may match it.
    assert match_instances(GT, PRED, iou_threshold=0.25) == (2, 1, 0)
    # One prediction covering two halves: IoU 1/2 with each gt -> nothing matches at 0.5,
    # and at 0.4 it still matches only one of them.
    assert match_instances(T([1, 1, 2, 2]), T([5, 5, 5, 5])) == (0, 1, 2)
    assert match_instances(T([1, 1, 2, 2]), T([5, 5, 5, 5]), iou_threshold=0.4) == (1, 0, 1)


def test_match_instances_edge_cases():
    assert match_instances(T([1, 1, 2]), T([-1, -1, -1])) == (0, 0, 2)  # no predictions
    assert match_instances(T([-1, -1]), T([3, 3])) == (0, 0, 0)  # everything ignored
    # Ids are arbitrary labels: renaming them changes nothing.
    assert match_instances(torch.where(GT >= 0, GT * 1000 + 3, GT), torch.where(PRED >= 0, 40 - PRED, PRED)) == (1, 2, 1)
    with pytest.raises(ValueError):
        match_instances(GT, PRED, iou_threshold=1.0)


def test_match_instances_per_class_by_hand():
    gt_ids = T([1, 1, 1, 2, 2, 2, 3, 3, 9, 9, 10])
    gt_sem = T([0, 0, 1, 1, 1, 1, 2, 2, 2, 1, -1])
    pred_ids = T([4, 4, 4, 5, 5, 5, 6, 6, -1, -1, -1])
    pred_sem = T([0, 0, 0, 2, 2, 1, 2, 2, 0, 0, 0])
    # gt classes by majority: 1 -> 0 (votes 0,0,1); 2 -> 1; 3 -> 2; 9 -> 1 (tie 2/1, lowest wins);
    # 10 has only ignored labels -> not counted.
    # pred classes: 4 -> 0; 5 -> 2 (votes 2,2,1); 6 -> 2.
    # Pairs with IoU 1: (1,4) class 0 = 0 -> tp; (2,5) class 1 != 2 -> no match; (3,6) class 2 -> tp.
    tp, fp, fn = match_instances_per_class(gt_ids, pred_ids, gt_sem, pred_sem, num_classes=3)
    assert tp.tolist() == [1, 0, 1]
    assert fp.tolist() == [0, 0, 1]  # pred classes [0, 2, 2] minus tp
    assert fn.tolist() == [0, 2, 0]  # gt classes [0, 1, 2, 1] minus tp
    assert tp.dtype == torch.int64


def test_match_instances_per_class_agrees_with_class_agnostic_for_one_class():
    sem = torch.zeros_like(GT)
    for threshold in (0.25, 0.5):
        tp, fp, fn = match_instances_per_class(GT, PRED, sem, sem, num_classes=2, iou_threshold=threshold)
        assert (int(tp.sum()), int(fp.sum()), int(fn.sum())) == match_instances(GT, PRED, threshold)
        assert tp[1] == fp[1] == fn[1] == 0
