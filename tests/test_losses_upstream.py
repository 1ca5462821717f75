"""The losses with upstream pimm's arguments, checked against hand computations
and the formulas of the papers (never against pimm's own loss code):

* Lovász-softmax / Lovász hinge (Berman et al. 2018): the Lovász extension
  ``sum_i m_(i) (Delta(S_i) - Delta(S_{i-1}))`` of the Jaccard loss
  ``Delta(M) = |M| / |G u M|`` (eq. 4), evaluated set by set below;
* focal loss (Lin et al. 2017): ``alpha (1 - p_t)^gamma (-log p_t)``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pimm.models.losses import LOSSES, build_criteria
from pimm.utils.errors import ConfigError

PROBS = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8]])
TARGET = torch.tensor([0, 0, 1])
# Per class, from the paper's set function (see test_lovasz_softmax_hand_computed):
CLASS0, CLASS1 = 0.3 + 0.2 / 6 + 0.1 / 3, 0.4


def jaccard_extension(errors: list[float], foreground: list[bool]) -> float:
    """The Lovász extension of Delta(M) = |M| / |G u M| at the error vector,
    straight from its definition: sort errors in decreasing order and sum each
    error times the increase of Delta when its point joins the set."""
    order = sorted(range(len(errors)), key=lambda i: -errors[i])
    ground = {i for i, f in enumerate(foreground) if f}

    def delta(members: set[int]) -> float:
        union = ground | members
        return len(members) / len(union) if union else 0.0

    total, chosen = 0.0, set()
    for i in order:
        before = delta(chosen)
        chosen = chosen | {i}
        total += errors[i] * (delta(chosen) - before)
    return total


def softmax_reference(probs: torch.Tensor, target: torch.Tensor, classes=None, weights=None) -> float:
    """Mean over the taken classes of the per-class extension (optionally times a weight)."""
    classes = sorted(set(target.tolist())) if classes is None else classes
    values = []
    for c in classes:
        fg = [bool(t == c) for t in target.tolist()]
        errors = [abs(float(f) - float(p)) for f, p in zip(fg, probs[:, c].tolist())]
        values.append(jaccard_extension(errors, fg) * (1.0 if weights is None else weights[c]))
    return sum(values) / len(values)


def lovasz(**kwargs):
    return LOSSES.build(dict(type="LovaszLoss", **kwargs))


def test_lovasz_softmax_hand_computed():
    # Class 0: errors (0.1, 0.6, 0.2), G = {0, 1}. Sorted: point 1 (Delta 1/2),
    # point 2 (2/3), point 0 (3/3): 0.6/2 + 0.2/6 + 0.1/3. Class 1: errors
    # (0.1, 0.6, 0.2), G = {2}: point 1 (1/2), point 2 (2/2): 0.6/2 + 0.2/2.
    assert jaccard_extension([0.1, 0.6, 0.2], [True, True, False]) == pytest.approx(CLASS0)
    assert jaccard_extension([0.1, 0.6, 0.2], [False, False, True]) == pytest.approx(CLASS1)
    loss = lovasz(mode="multiclass", ignore_index=-1)(PROBS.log(), TARGET)
    assert loss.item() == pytest.approx((CLASS0 + CLASS1) / 2, abs=1e-6)


def test_lovasz_softmax_matches_the_set_function_on_random_points():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 4, generator=g) * 2
    target = torch.randint(0, 3, (40,), generator=g)  # class 3 absent
    probs = logits.softmax(1)
    present = lovasz(mode="multiclass")(logits, target).item()
    assert present == pytest.approx(softmax_reference(probs, target), abs=1e-5)
    every = lovasz(mode="multiclass", classes="all")(logits, target).item()
    assert every == pytest.approx(softmax_reference(probs, target, classes=[0, 1, 2, 3]), abs=1e-5)


def test_lovasz_class_weights_multiply_each_class_and_keep_the_plain_mean():
    # upstream: mean over classes of w_c * L_c, not renormalised by the weights
    assert lovasz(mode="multiclass", class_weights=[2.0, 0.5])(PROBS.log(), TARGET).item() == pytest.approx(
        (2.0 * CLASS0 + 0.5 * CLASS1) / 2, abs=1e-6)
    assert lovasz(mode="multiclass", class_weights={1: 3.0})(PROBS.log(), TARGET).item() == pytest.approx(
        (CLASS0 + 3.0 * CLASS1) / 2, abs=1e-6)  # a class missing from the dict weighs 1
    assert lovasz(mode="multiclass", class_weights=None)(PROBS.log(), TARGET).item() == pytest.approx(
        (CLASS0 + CLASS1) / 2, abs=1e-6)


def test_lovasz_penalize_pred_weighs_each_point_by_its_predicted_class():
    # predictions (argmax) are (0, 1, 1): point weights (2, 0.5, 0.5).
    # Class 0 sorted: point 1 (0.6*0.5), point 2 (0.2*0.5), point 0 (0.1*2) with
    # Delta steps (1/2, 1/6, 1/3); class 1: same errors, steps (1/2, 1/2, 0).
    class0 = 0.3 / 2 + 0.1 / 6 + 0.2 / 3
    class1 = 0.3 / 2 + 0.1 / 2
    loss = lovasz(mode="multiclass", class_weights=[2.0, 0.5], penalize_pred=True)(PROBS.log(), TARGET)
    assert loss.item() == pytest.approx((class0 + class1) / 2, abs=1e-6)


def test_lovasz_class_seen_restricts_the_classes():
    assert lovasz(mode="multiclass", class_seen=[1])(PROBS.log(), TARGET).item() == pytest.approx(CLASS1, abs=1e-6)
    assert lovasz(mode="multiclass", class_seen=0)(PROBS.log(), TARGET).item() == pytest.approx(CLASS0, abs=1e-6)


def test_lovasz_per_image_is_the_mean_over_events():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(30, 3, generator=g)
    target = torch.randint(0, 3, (30,), generator=g)
    target[25:] = -1  # the second event keeps 5 of 10 points
    offset = torch.tensor([20, 30])
    probs = logits.softmax(1)
    first = softmax_reference(probs[:20], target[:20])
    keep = target[20:] >= 0
    second = softmax_reference(probs[20:][keep], target[20:][keep])
    loss = lovasz(mode="multiclass", per_image=True)(logits, target, offset=offset)
    assert loss.item() == pytest.approx((first + second) / 2, abs=1e-5)
    batch = lovasz(mode="multiclass")(logits, target).item()
    assert batch == pytest.approx(softmax_reference(probs[target >= 0], target[target >= 0]), abs=1e-5)
    assert batch != pytest.approx(loss.item(), abs=1e-3)
    with pytest.raises(ConfigError, match="per_image=True needs the batch's 'offset'"):
        lovasz(mode="multiclass", per_image=True)(logits, target)


def test_lovasz_per_image_gets_the_offset_through_the_criteria_sum():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(12, 3, generator=g)
    target = torch.randint(0, 3, (12,), generator=g)
    offset = torch.tensor([5, 12])
    criteria = build_criteria([dict(type="CrossEntropyLoss"), dict(type="LovaszLoss", per_image=True)])
    expected = F.cross_entropy(logits, target) + lovasz(per_image=True)(logits, target, offset=offset)
    torch.testing.assert_close(criteria(logits, target, offset=offset), expected)


def test_lovasz_hinge_binary_hand_computed():
    # errors 1 - s*(2y-1) = (-1, 2, 1.5); sorted: point 1 (y=1), point 2 (y=0),
    # point 0 (y=1); G = {0, 1}: Delta steps (1/2, 1/6, 1/3); relu(errors) (2, 1.5, 0).
    logits = torch.tensor([2.0, -1.0, 0.5])
    labels = torch.tensor([1, 1, 0])
    expected = 2.0 / 2 + 1.5 / 6
    assert jaccard_extension([0.0, 2.0, 1.5], [True, True, False]) == pytest.approx(expected)
    assert lovasz(mode="binary")(logits, labels).item() == pytest.approx(expected, abs=1e-6)
    assert lovasz(mode="binary")(logits[:, None], labels).item() == pytest.approx(expected, abs=1e-6)
    # an ignored point leaves the set
    with_ignored = lovasz(mode="binary", ignore_index=-1)(torch.tensor([2.0, -1.0, 0.5, 9.0]),
                                                          torch.tensor([1, 1, 0, -1]))
    assert with_ignored.item() == pytest.approx(expected, abs=1e-6)


def test_lovasz_hinge_multilabel_is_one_binary_problem_over_every_score():
    logits = torch.tensor([[2.0, -1.0], [0.5, 1.0]])
    labels = torch.tensor([[1, 1], [0, 1]])
    errors = [max(0.0, 1 - s * (2 * y - 1)) for s, y in zip(logits.reshape(-1).tolist(), labels.reshape(-1).tolist())]
    expected = jaccard_extension(errors, [bool(y) for y in labels.reshape(-1).tolist()])
    assert lovasz(mode="multilabel")(logits, labels).item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(mode="softmax"), "mode must be one of multiclass, binary, multilabel"),
    (dict(mode="multiclass", class_weights="heavy"), "class_weights must be"),
    (dict(mode="multiclass", class_seen="track"), "class_seen must be"),
])
def test_lovasz_bad_arguments_are_config_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        lovasz(**kwargs)


def test_lovasz_short_class_weights_name_the_count():
    with pytest.raises(ConfigError, match="class_weights has 1 entries but the model predicts 2 classes"):
        lovasz(mode="multiclass", class_weights=[1.0])(PROBS.log(), TARGET)


# ---------------------------------------------------------------------- focal
LOGITS = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]])
LABELS = torch.tensor([0, 2, 2, -1])


def softmax_row(row):
    exps = [math.exp(v) for v in row]
    return [e / sum(exps) for e in exps]


def focal_terms(gamma):
    """alpha-free focal term per kept point, from the paper's formula."""
    terms = []
    for row, t in zip(LOGITS.tolist(), LABELS.tolist()):
        if t < 0:
            continue
        p_t = softmax_row(row)[t]
        terms.append((1 - p_t) ** gamma * -math.log(p_t))
    return terms


def test_focal_loss_hand_computed():
    terms = focal_terms(2.0)
    loss = LOSSES.build(dict(type="FocalLoss", gamma=2.0, ignore_index=-1))(LOGITS, LABELS)
    assert loss.item() == pytest.approx(sum(terms) / 3, abs=1e-6)  # mean over the 3 kept points
    summed = LOSSES.build(dict(type="FocalLoss", gamma=2.0, reduction="sum", loss_weight=0.5))(LOGITS, LABELS)
    assert summed.item() == pytest.approx(0.5 * sum(terms), abs=1e-6)
    per_point = LOSSES.build(dict(type="FocalLoss", gamma=2.0, reduction="none"))(LOGITS, LABELS)
    torch.testing.assert_close(per_point, torch.tensor(terms + [0.0]))


def test_focal_loss_with_gamma_zero_is_cross_entropy():
    loss = LOSSES.build(dict(type="FocalLoss", gamma=0.0))(LOGITS, LABELS)
    torch.testing.assert_close(loss, F.cross_entropy(LOGITS, LABELS, ignore_index=-1))


def test_focal_weight_follows_the_predicted_class_unless_penalize_pred():
    weight = [1.0, 10.0, 100.0]
    terms = focal_terms(2.0)
    predicted = [0, 1, 2]  # argmax of the kept rows
    true = [0, 2, 2]
    by_prediction = LOSSES.build(dict(type="FocalLoss", weight=weight))(LOGITS, LABELS)
    assert by_prediction.item() == pytest.approx(sum(weight[c] * t for c, t in zip(predicted, terms)) / 3, rel=1e-6)
    by_truth = LOSSES.build(dict(type="FocalLoss", weight=weight, penalize_pred=True))(LOGITS, LABELS)
    assert by_truth.item() == pytest.approx(sum(weight[c] * t for c, t in zip(true, terms)) / 3, rel=1e-6)


def test_focal_all_ignored_is_a_zero_with_a_graph():
    logits = LOGITS.clone().requires_grad_()
    loss = LOSSES.build(dict(type="FocalLoss"))(logits, torch.full((4,), -1))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))


def test_focal_bad_weight_and_gamma():
    with pytest.raises(ConfigError, match="weight has 2 entries but the model predicts 3 classes"):
        LOSSES.build(dict(type="FocalLoss", weight=[1.0, 2.0]))(LOGITS, LABELS)
    with pytest.raises(ConfigError, match="gamma must be >= 0"):
        LOSSES.build(dict(type="FocalLoss", gamma=-1))


# -------------------------------------------------------------- cross-entropy
def test_cross_entropy_upstream_arguments():
    kept = LABELS >= 0
    nll = [-math.log(softmax_row(r)[t]) for r, t in zip(LOGITS[kept].tolist(), LABELS[kept].tolist())]
    ce = LOSSES.build(dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1))
    assert ce(LOGITS, LABELS).item() == pytest.approx(sum(nll) / 3, abs=1e-6)
    assert ce(LOGITS, LABELS[:, None]).item() == pytest.approx(sum(nll) / 3, abs=1e-6)  # (N, 1) targets
    summed = LOSSES.build(dict(type="CrossEntropyLoss", reduction="sum"))
    assert summed(LOGITS, LABELS).item() == pytest.approx(sum(nll), abs=1e-6)
    legacy = LOSSES.build(dict(type="CrossEntropyLoss", size_average=False))  # torch's old spelling of "sum"
    assert legacy.reduction == "sum"


def test_a_per_point_reduction_cannot_be_a_model_loss():
    with pytest.raises(ConfigError, match="reduction='none' returns one loss per point"):
        build_criteria([dict(type="CrossEntropyLoss", reduction="none")])
    with pytest.raises(ConfigError, match="reduction must be one of mean, sum, none"):
        LOSSES.build(dict(type="FocalLoss", reduction="avg"))


def test_segmentor_hands_the_batch_offset_to_a_per_event_lovasz():
    from pimm.engines.registries import MODELS
    from tests.test_ptv3 import TINY, lartpc_like_batch

    torch.manual_seed(0)
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8, backbone=TINY,
                              criteria=[dict(type="LovaszLoss", mode="multiclass", per_image=True)])).eval()
    batch = lartpc_like_batch(counts=(60, 40))
    with torch.no_grad():
        out = model(batch)
    probs, target = out["seg_logits"].softmax(1), batch["segment"]
    expected = (softmax_reference(probs[:60], target[:60]) + softmax_reference(probs[60:], target[60:])) / 2
    assert out["loss"].item() == pytest.approx(expected, abs=1e-5)
