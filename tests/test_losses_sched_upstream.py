"""pimm's losses and learning-rate schedules against upstream pimm's values on
the same inputs (``tests/fixtures/losses/upstream_losses.json``, regenerated
by ``tests/fixtures/losses/make_reference.py`` from upstream's own code)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pimm.engines import SCHEDULERS
from pimm.engines.optim.scheduler import build_scheduler
from pimm.models.losses import LOSSES, build_criteria
from pimm.utils.errors import ConfigError

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "losses" / "upstream_losses.json").read_text())
INT_INPUTS = {"cls", "cls_full"}


def _inputs(kind):
    pred, target = FIXTURE["inputs"][kind]
    pred = torch.tensor(pred, dtype=torch.float32)
    target = torch.tensor(target, dtype=torch.long if kind in INT_INPUTS else torch.float32)
    return pred, target


@pytest.mark.parametrize("case", FIXTURE["losses"], ids=[c["name"] for c in FIXTURE["losses"]])
def test_loss_matches_upstream(case):
    pred, target = _inputs(case["input"])
    value = LOSSES.build(dict(case["cfg"]))(pred, target)
    torch.testing.assert_close(value.double(), torch.tensor(case["value"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-5)


def _optimizer():
    base_lrs = FIXTURE["schedules"]["base_lrs"]
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in base_lrs]
    return torch.optim.SGD([dict(params=[p], lr=lr) for p, lr in zip(params, base_lrs)], lr=base_lrs[0],
                           momentum=0.9)


# Where pimm differs from upstream by design (docs/coming-from.md): pimm's PolyLR reaches 0 at
# total_steps (upstream: (1 - s/(T+1))^p). Upstream's CosineAnnealingLR(last_epoch=k) is torch's
# recursive form, which keeps step k's lr for step k+1 and stays one step behind from then on;
# pimm's starts at the closed form of step k+1, as every other schedule does (checked below).
DIFFERENT_BY_DESIGN = {"poly", "cosine_last_epoch"}


@pytest.mark.parametrize("case", FIXTURE["schedules"]["cases"], ids=[c["name"] for c in FIXTURE["schedules"]["cases"]])
def test_schedule_matches_upstream(case):
    total = FIXTURE["schedules"]["total_steps"]
    optimizer = _optimizer()
    scheduler = build_scheduler(dict(case["cfg"]), optimizer, total)
    lrs = []
    for _ in case["lrs"]:
        lrs.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    if case["name"] == "cosine_last_epoch":
        k, base = case["cfg"]["last_epoch"], FIXTURE["schedules"]["base_lrs"]
        closed = [[lr * (1 + math.cos(math.pi * s / total)) / 2 for lr in base] for s in range(k + 1, total)]
        torch.testing.assert_close(torch.tensor(lrs), torch.tensor(closed), rtol=1e-12, atol=0)
        torch.testing.assert_close(torch.tensor(case["lrs"][0]), torch.tensor(
            [lr * (1 + math.cos(math.pi * k / total)) / 2 for lr in base]), rtol=1e-6, atol=0)
        return
    if case["name"] in DIFFERENT_BY_DESIGN:
        power = case["cfg"].get("power", 0.9)
        upstream_as_formula = [[lr * (1 - s / (total + 1)) ** power for lr in FIXTURE["schedules"]["base_lrs"]]
                               for s in range(len(lrs))]
        torch.testing.assert_close(torch.tensor(case["lrs"]), torch.tensor(upstream_as_formula), rtol=1e-6, atol=0)
        assert lrs[-1][0] != pytest.approx(case["lrs"][-1][0], rel=1e-3)
        return
    torch.testing.assert_close(torch.tensor(lrs, dtype=torch.float64), torch.tensor(case["lrs"], dtype=torch.float64),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("cfg", [dict(type="CosineAnnealingLR", eta_min=0.001), dict(type="ExpLR", gamma=0.3),
                                 dict(type="MultiStepWithWarmupLR", milestones=[0.3, 0.7], warmup_rate=0.2),
                                 dict(type="PolyLR", last_epoch=3), dict(type="OneCycleLR", max_lr=0.1, last_epoch=5)])
def test_schedule_resumes_exactly(cfg):
    """A scheduler rebuilt from its config and given the state of a run
    interrupted at step 7 continues with bit-identical lrs (per group)."""
    total = 20
    opt_a = _optimizer()
    uninterrupted = build_scheduler(dict(cfg), opt_a, total)
    expected, state = [], None
    for step in range(12):
        if step == 7:
            state = uninterrupted.state_dict()
        expected.append([g["lr"] for g in opt_a.param_groups])
        opt_a.step()
        uninterrupted.step()
    opt_b = _optimizer()
    resumed = build_scheduler(dict(cfg), opt_b, total)
    resumed.load_state_dict(state)
    got = []
    for _ in range(7, 12):
        got.append([g["lr"] for g in opt_b.param_groups])
        opt_b.step()
        resumed.step()
    assert got == expected[7:]


def test_every_registered_schedule_takes_last_epoch():
    for name in SCHEDULERS.keys():
        optimizer = _optimizer()
        extra = dict(milestones=[0.5]) if "MultiStep" in name else {}
        start = build_scheduler(dict(type=name, **extra), optimizer, 20)
        for _ in range(4):
            optimizer.step()
            start.step()
        later = build_scheduler(dict(type=name, last_epoch=3, **extra), _optimizer(), 20)
        assert later.last_epoch == 4 and later.get_last_lr() == pytest.approx(start.get_last_lr(), rel=1e-12), name


@pytest.mark.parametrize("cfg, words", [
    (dict(type="ExpLR", gamma=1.5), "gamma"),
    (dict(type="MultiStepWithWarmupLR", milestones=[0.8, 0.5]), "increasing"),
    (dict(type="CosineAnnealingLR", last_epoch=-2), "last_epoch"),
    (dict(type="PolyLR", last_epoch=2.5), "last_epoch"),
])
def test_bad_schedule_arguments_are_one_line(cfg, words):
    with pytest.raises(ConfigError, match=words):
        build_scheduler(cfg, _optimizer(), 20)


@pytest.mark.parametrize("cfg, words", [
    (dict(type="BinaryFocalLoss", alpha=1.0), "alpha"),
    (dict(type="SmoothL1RegressionLoss", reduction="avg"), "reduction"),
    (dict(type="DiceLoss", exponent=0), "exponent"),
    (dict(type="SmoothCELoss", smoothing_ratio=1.0), "smoothing_ratio"),
])
def test_bad_loss_arguments_are_one_line(cfg, words):
    with pytest.raises(ConfigError, match=words):
        LOSSES.build(cfg)


def test_smooth_ce_refuses_ignored_targets_with_a_clear_line():
    pred, target = _inputs("cls")
    with pytest.raises(ValueError, match="class ids"):
        LOSSES.build(dict(type="SmoothCELoss"))(pred, target)


def test_regression_loss_names_mismatched_shapes():
    with pytest.raises(ValueError, match="do not broadcast"):
        LOSSES.build(dict(type="MSERegressionLoss"))(torch.zeros(5, 3), torch.zeros(4, 3))


def test_criteria_refuses_per_element_binary_focal():
    with pytest.raises(ConfigError, match="one loss per point"):
        build_criteria([dict(type="BinaryFocalLoss", reduce=False)])


def test_new_losses_train_a_parameter():
    """Each new loss gives a gradient that lowers it (a step of SGD on the inputs)."""
    for cfg, kind in [(dict(type="SmoothCELoss"), "cls_full"), (dict(type="BinaryFocalLoss"), "bin"),
                      (dict(type="SmoothL1RegressionLoss"), "reg"), (dict(type="CrossEntropyHeadLoss"), "cls_full"),
                      (dict(type="DiceLoss"), "cls")]:
        pred, target = _inputs(kind)
        pred.requires_grad_(True)
        loss = LOSSES.build(cfg)
        before = loss(pred, target)
        before.backward()
        with torch.no_grad():
            after = loss(pred - 0.5 * pred.grad, target)
        assert after < before, cfg["type"]


def _instance_inputs():
    raw = FIXTURE["instance_inputs"]
    layer = lambda d: {k: [torch.tensor(t) for t in v] if k != "aux_outputs" else [layer(a) for a in v]  # noqa: E731
                       for k, v in d.items()}
    batch = {k: torch.tensor(v) for k, v in raw["batch"].items()}
    return layer(raw["pred"]), batch


def _select(pred, keys):
    out = {k: pred[k] for k in ("pred_masks", *keys) if k != "aux_outputs"}
    if "aux_outputs" in keys:
        out["aux_outputs"] = [_select(a, [k for k in keys if k != "aux_outputs"]) for a in pred["aux_outputs"]]
    return out


@pytest.mark.parametrize("case", FIXTURE["instance_losses"], ids=[c["name"] for c in FIXTURE["instance_losses"]])
def test_instance_loss_matches_upstream(case):
    pred, batch = _instance_inputs()
    loss, components = LOSSES.build(dict(case["cfg"]))(_select(pred, case["keys"]), batch)
    assert loss.item() == pytest.approx(case["value"], rel=1e-5, abs=1e-5)
    for key, value in case["components"].items():
        assert float(components[key]) == pytest.approx(value, rel=1e-5, abs=1e-5), key


def test_instance_loss_trains_the_masks_and_goes_through_criteria():
    pred, batch = _instance_inputs()
    masks = [m.clone().requires_grad_(True) for m in pred["pred_masks"]]
    criteria = build_criteria([dict(type="FastInstanceSegmentationLoss", truth_label="instance")])
    loss, components = criteria(dict(pred_masks=masks), batch)
    assert components["num_pairs"] == 5
    loss.backward()
    with torch.no_grad():
        stepped = [m - 2.0 * m.grad for m in masks]
    after, _ = criteria(dict(pred_masks=stepped), batch)
    assert after < loss


def test_instance_loss_one_line_errors():
    pred, batch = _instance_inputs()
    with pytest.raises(KeyError, match="truth_label"):
        LOSSES.build(dict(type="FastInstanceSegmentationLoss", truth_label="instance"))(pred, {"segment": batch["segment"]})
    with pytest.raises(ConfigError, match="all 0"):
        LOSSES.build(dict(type="FastInstanceSegmentationLoss", cost_mask=0, cost_dice=0))
    with pytest.raises(KeyError, match="pred_energy"):
        LOSSES.build(dict(type="FastInstanceSegmentationRegressionLoss", truth_label="instance",
                          regression_targets=[dict(name="energy")]))(dict(pred_masks=pred["pred_masks"]), batch)
    with pytest.raises(ConfigError, match="aggregation"):
        LOSSES.build(dict(type="FastInstanceSegmentationRegressionLoss",
                          regression_targets=[dict(name="energy", aggregation="max")]))


def test_assignment_is_minimal_on_every_small_matrix():
    import itertools

    import numpy as np

    from pimm.models.losses.assignment import linear_sum_assignment

    rng = np.random.default_rng(0)
    for _ in range(200):
        n, m = (int(v) for v in rng.integers(1, 6, 2))
        cost = rng.normal(size=(n, m))
        rows, cols = linear_sum_assignment(cost)
        perms = itertools.permutations(range(max(n, m)), min(n, m))
        best = min(sum(cost[i, p[i]] for i in range(n)) if n <= m else sum(cost[p[j], j] for j in range(m))
                   for p in perms)
        assert cost[rows, cols].sum() == pytest.approx(best, abs=1e-9)
        assert len(rows) == min(n, m) and list(rows) == sorted(rows) and len(set(cols)) == len(cols)


def test_unified_loss_refuses_overlap_mode_and_bad_heads_in_one_line():
    with pytest.raises(ConfigError, match="overlap=True"):
        LOSSES.build(dict(type="FastUnifiedInstanceLoss", query_heads=[dict(name="energy")], overlap=True))
    with pytest.raises(ConfigError, match="kind"):
        LOSSES.build(dict(type="FastUnifiedInstanceLoss", query_heads=[dict(name="pid", kind="ordinal")]))
    with pytest.raises(ConfigError, match="unknown key"):
        LOSSES.build(dict(type="FastUnifiedInstanceLoss", query_heads=[dict(name="pid", weight=2.0)]))


def test_onecycle_takes_pct_start_in_steps_as_upstream():
    a, b = _optimizer(), _optimizer()
    in_steps = build_scheduler(dict(type="OneCycleLR", max_lr=[0.1, 0.02], pct_start=5), a, 20)
    as_fraction = build_scheduler(dict(type="OneCycleLR", max_lr=[0.1, 0.02], pct_start=0.25), b, 20)
    for _ in range(19):
        assert in_steps.get_last_lr() == as_fraction.get_last_lr()
        a.step(), b.step()
        in_steps.step(), as_fraction.step()
    with pytest.raises(ConfigError, match="warm-up steps"):
        build_scheduler(dict(type="OneCycleLR", pct_start=30), _optimizer(), 20)
