"""Optimizer param groups and LR schedules: group assignment, config errors,
lr values against hand-computed formulas, and exact state_dict round trips."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from pimm.engines.optim import build_optimizer
from pimm.engines.optim.scheduler import build_scheduler
from pimm.engines.state.participants import OptimizerParticipant
from pimm.engines.state.restore import RestoreContext
from pimm.utils.errors import CheckpointError, ConfigError, RegistryError


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.ModuleDict({"block0": nn.Linear(3, 3), "norm": nn.LayerNorm(3)})
        self.head = nn.Linear(3, 2)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)


class DDPLike(nn.Module):
    """Stands in for DistributedDataParallel: parameters named ``module.*``."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.module = inner


ENTRIES = [dict(keyword="block", lr=1e-4), dict(keyword="bias", weight_decay=0.0), dict(keyword="head", lr_scale=0.1)]


def group_members(optimizer, model):
    ids = {id(p): name.removeprefix("module.") for name, p in model.named_parameters()}
    return {g["name"]: sorted(ids[id(p)] for p in g["params"]) for g in optimizer.param_groups}


# ---------------------------------------------------------------- optimizer


def test_param_groups_first_match_wins_and_options():
    model = Net()
    opt = build_optimizer(dict(type="AdamW", lr=1e-3, weight_decay=0.05), model, ENTRIES)
    assert [g["name"] for g in opt.param_groups] == ["default", "block", "bias", "head"]
    assert group_members(opt, model) == {
        "default": ["backbone.norm.weight"],
        # block0.bias also contains "bias", but "block" comes first.
        "block": ["backbone.block0.bias", "backbone.block0.weight"],
        "bias": ["backbone.norm.bias", "head.bias"],
        "head": ["head.weight"],
    }
    lr = {g["name"]: g["lr"] for g in opt.param_groups}
    wd = {g["name"]: g["weight_decay"] for g in opt.param_groups}
    assert lr == {"default": 1e-3, "block": 1e-4, "bias": 1e-3, "head": pytest.approx(1e-4)}
    assert wd == {"default": 0.05, "block": 0.05, "bias": 0.0, "head": 0.05}
    # Frozen parameters are in no group.
    in_groups = {id(p) for g in opt.param_groups for p in g["params"]}
    assert all(id(p) not in in_groups for p in model.frozen.parameters())
    assert isinstance(opt, torch.optim.AdamW)


def test_ddp_prefix_is_ignored():
    plain, wrapped_inner = Net(), Net()
    wrapped = DDPLike(wrapped_inner)
    a = build_optimizer(dict(type="SGD", lr=0.1, momentum=0.9), plain, ENTRIES)
    b = build_optimizer(dict(type="SGD", lr=0.1, momentum=0.9), wrapped, ENTRIES)
    assert group_members(a, plain) == group_members(b, wrapped)
    # A keyword anchored at the start of the unwrapped name matches the same way.
    c = build_optimizer(dict(type="SGD", lr=0.1), wrapped, [dict(keyword="head.", lr=0.5)])
    assert group_members(c, wrapped)["head."] == ["head.bias", "head.weight"]
    with pytest.raises(ConfigError) as err:
        build_optimizer(dict(type="SGD", lr=0.1), wrapped, [dict(keyword="module.head", lr=0.5)])
    assert "module.head" in str(err.value) and "backbone.block0.weight" in str(err.value)
    assert "module.backbone" not in str(err.value)


def test_lr_scale_uses_optimizer_default_lr_and_sgd_momentum_override():
    model = Net()
    # Adam's own default lr is 1e-3 when the config sets none.
    opt = build_optimizer(dict(type="Adam"), model, [dict(keyword="head", lr_scale=0.5, betas=(0.8, 0.9))])
    head = opt.param_groups[1]
    assert head["lr"] == pytest.approx(5e-4) and head["betas"] == (0.8, 0.9)
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)
    sgd = build_optimizer(dict(type="SGD", lr=0.2, momentum=0.9), model, [dict(keyword="head", momentum=0.0)])
    assert [g["momentum"] for g in sgd.param_groups] == [0.9, 0.0]


def test_keyword_matching_only_frozen_params_keeps_empty_group():
    model = Net()
    opt = build_optimizer(dict(type="SGD", lr=0.1), model, [dict(keyword="frozen", lr=0.0), dict(keyword="head")])
    assert [g["name"] for g in opt.param_groups] == ["default", "frozen", "head"]
    assert opt.param_groups[1]["params"] == []


@pytest.mark.parametrize(
    "entries, cfg, exc, needle",
    [
        ([dict(keyword="nope", lr=1.0)], dict(type="AdamW", lr=1e-3), ConfigError, "'nope' matches no parameter"),
        ([dict(lr=1.0)], dict(type="AdamW", lr=1e-3), ConfigError, "keyword"),
        ([dict(keyword="head", lr=1.0, lr_scale=0.1)], dict(type="AdamW", lr=1e-3), ConfigError, "both 'lr' and 'lr_scale'"),
        ([dict(keyword="head", momentun=0.9)], dict(type="SGD", lr=1e-3), ConfigError, "'momentun' is not an option of SGD"),
        ([dict(keyword="head"), dict(keyword="head")], dict(type="SGD", lr=1e-3), ConfigError, "listed twice"),
        ([dict(keyword="head", lr_scale=-1)], dict(type="SGD", lr=1e-3), ConfigError, "lr_scale must be a number >= 0"),
        (None, dict(type="AdamW", lr=1e-3, wieght_decay=0.1), RegistryError, "did you mean 'weight_decay'"),
        (None, dict(type="AdamW", lr=-1.0), ConfigError, "Invalid learning rate"),
        ([dict(keyword="head", betas=(2.0, 0.9))], dict(type="Adam", lr=1e-3), ConfigError, "beta"),
        (None, dict(type="AdamWW", lr=1e-3), RegistryError, "did you mean 'AdamW'"),
        (None, dict(lr=1e-3), ConfigError, "dict(type="),
    ],
)
def test_optimizer_config_errors(entries, cfg, exc, needle):
    with pytest.raises(exc) as err:
        build_optimizer(cfg, Net(), entries)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_no_trainable_parameters_is_an_error():
    model = Net().requires_grad_(False)
    with pytest.raises(ConfigError, match="no trainable parameters"):
        build_optimizer(dict(type="SGD", lr=0.1), model)


def test_optimizer_state_round_trip():
    torch.manual_seed(0)
    model = Net()
    opt = build_optimizer(dict(type="AdamW", lr=1e-2), model, ENTRIES)
    for _ in range(2):
        opt.zero_grad()
        model.head(model.backbone["block0"](torch.randn(4, 3))).sum().backward()
        opt.step()
    clone = Net()
    clone.load_state_dict(model.state_dict())
    opt2 = build_optimizer(dict(type="AdamW", lr=1e-2), clone, ENTRIES)
    # Deep copy: torch's load_state_dict would otherwise share the moment
    # tensors between the two optimizers (a checkpoint goes through disk).
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    x = torch.randn(4, 3)
    for m, o in ((model, opt), (clone, opt2)):
        o.zero_grad()
        m.head(m.backbone["block0"](x)).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------- schedulers


def make(cfg, total_steps, lrs=(1.0, 0.1), optim="AdamW"):
    """An optimizer with one group per lr (ratio 10:1 by default) and its scheduler."""
    params = [nn.Parameter(torch.zeros(1)) for _ in lrs]
    opt = getattr(torch.optim, optim)([{"params": [p], "lr": lr} for p, lr in zip(params, lrs)])
    return opt, build_scheduler(cfg, opt, total_steps)


def lr_trace(cfg, total_steps, lrs=(1.0, 0.1)):
    """lrs[t] = the group lrs used by optimizer step t, for t in 0..total_steps."""
    opt, sched = make(cfg, total_steps, lrs)
    trace = []
    for _ in range(total_steps):
        trace.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    trace.append([g["lr"] for g in opt.param_groups])
    return trace


def cos_anneal(start, end, pct):
    return end + (start - end) * (1 + math.cos(math.pi * pct)) / 2


SCHEDULE_CASES = {
    # T=100, warm-up 10 steps from 0.1*lr, cosine down to 0.01*lr.
    #   t=0: 0.1; t=5: 0.1 + 0.9*5/10 = 0.55; t=10: 1.0;
    #   t=55: progress (55-10)/90 = 0.5 -> 0.01 + 0.99*0.5 = 0.505; t=100: 0.01.
    "cosine": (
        dict(type="CosineWarmupLR", warmup_steps=10, warmup_start_factor=0.1, min_lr_ratio=0.01),
        100,
        {0: 0.1, 5: 0.55, 10: 1.0, 55: 0.505, 100: 0.01},
    ),
    # warmup_ratio 0.2 of 50 = 10 steps from 0; eta_min absolute 0.2:
    #   t=0: 0; t=10: 1.0; t=30: progress 0.5 -> 0.2 + 0.8*0.5 = 0.6; t=50: 0.2.
    "cosine_ratio_eta": (
        dict(type="WarmupCosineLR", warmup_ratio=0.2, warmup_start_factor=0.0, eta_min=0.2),
        50,
        {0: 0.0, 10: 1.0, 30: 0.6, 50: 0.2},
    ),
    # (1 - t/10)^2: t=0: 1; t=5: 0.25; t=9: 0.01; t=10: 0.
    "poly": (dict(type="PolyLR", power=2.0), 10, {0: 1.0, 5: 0.25, 9: 0.01, 10: 0.0}),
    # milestones 0.6, 0.8 of 10 steps -> steps 6 and 8: lr 1 before 6, 0.5 from 6, 0.25 from 8.
    "multistep_frac": (
        dict(type="MultiStepLR", milestones=[0.6, 0.8], gamma=0.5),
        10,
        {0: 1.0, 5: 1.0, 6: 0.5, 7: 0.5, 8: 0.25, 10: 0.25},
    ),
    # Absolute steps 3 and 7, gamma 0.1.
    "multistep_abs": (
        dict(type="MultiStepLR", milestones=[3, 7]),
        10,
        {0: 1.0, 2: 1.0, 3: 0.1, 6: 0.1, 7: 0.01, 10: 0.01},
    ),
    "constant": (dict(type="Constant"), 7, {0: 1.0, 3: 1.0, 7: 1.0}),
    # OneCycle, T=100, pct_start 0.25, div 10, final div 100: initial 0.1, peak 1.0,
    # min 0.001. Phase 1 ends at step 0.25*100-1 = 24, phase 2 at 99.
    #   t=0: 0.1; t=12: halfway up, 0.55; t=24: 1.0; t=99: 0.001;
    #   t=62: cos from 1.0 to 0.001 at pct (62-24)/75.
    "onecycle": (
        dict(type="OneCycleLR", pct_start=0.25, div_factor=10.0, final_div_factor=100.0),
        100,
        {0: 0.1, 12: 0.55, 24: 1.0, 62: cos_anneal(1.0, 0.001, 38 / 75), 99: 0.001},
    ),
    # linear annealing: t=62 is 38/75 of the way from 1.0 to 0.001.
    "onecycle_linear": (
        dict(type="OneCycleLR", pct_start=0.25, div_factor=10.0, final_div_factor=100.0, anneal_strategy="linear"),
        100,
        {0: 0.1, 12: 0.55, 24: 1.0, 62: 1.0 + (0.001 - 1.0) * 38 / 75, 99: 0.001},
    ),
}


@pytest.mark.parametrize("case", sorted(SCHEDULE_CASES))
def test_schedule_values_and_group_ratio(case):
    cfg, total, expected = SCHEDULE_CASES[case]
    trace = lr_trace(cfg, total)
    for step, lr in expected.items():
        assert trace[step][0] == pytest.approx(lr, abs=1e-12), (case, step)
    if "eta_min" in cfg:
        return  # an absolute floor is the same for every group, by design
    # The second group (lr 0.1) follows the same shape: ratio preserved.
    for step in range(total):
        assert trace[step][1] == pytest.approx(0.1 * trace[step][0], rel=1e-9, abs=1e-15)


def test_onecycle_max_lr_forms_and_momentum():
    opt, _ = make(dict(type="OneCycleLR", max_lr=2.0, pct_start=0.5), 10)
    assert [g["max_lr"] for g in opt.param_groups] == pytest.approx([2.0, 0.2])
    opt, _ = make(dict(type="OneCycleLR", max_lr=[3.0, 1.0], pct_start=0.5), 10)
    assert [g["max_lr"] for g in opt.param_groups] == [3.0, 1.0]
    # Adam's beta1 cycles from max_momentum (0.95) at the start to base (0.85) at the peak.
    opt, sched = make(dict(type="OneCycleLR", pct_start=0.5), 10)
    assert opt.param_groups[0]["betas"][0] == pytest.approx(0.95)
    for _ in range(4):  # phase 1 ends at step 0.5*10-1 = 4
        opt.step()
        sched.step()
    assert opt.param_groups[0]["betas"] == pytest.approx((0.85, 0.999))


def test_onecycle_steps_exactly_total_steps():
    opt, sched = make(dict(type="OneCycleLR", pct_start=0.05), 20)  # 0.05*20 = 1: zero-length warm-up phase
    for _ in range(20):
        opt.step()
        sched.step()
    with pytest.raises(ValueError, match="total steps is 20"):
        sched.step()


ROUND_TRIP_CFGS = [cfg for cfg, _, _ in SCHEDULE_CASES.values()]


@pytest.mark.parametrize("cfg", ROUND_TRIP_CFGS, ids=sorted(SCHEDULE_CASES, key=list(SCHEDULE_CASES).index))
def test_state_dict_round_trip_is_exact(cfg):
    total, split = 40, 13

    def groups_snapshot(opt):
        return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]

    opt, sched = make(cfg, total)
    reference = []
    for step in range(total):
        if step == split:
            buf = io.BytesIO()
            torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, buf)
        reference.append(groups_snapshot(opt))
        opt.step()
        sched.step()

    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    params = [nn.Parameter(torch.zeros(1)) for _ in range(2)]
    opt2 = torch.optim.AdamW([{"params": [p], "lr": lr} for p, lr in zip(params, (1.0, 0.1))])
    sched2 = build_scheduler(cfg, opt2, total)  # the documented order: build, then load both
    opt2.load_state_dict(saved["optimizer"])
    sched2.load_state_dict(saved["scheduler"])
    for step in range(split, total):
        # Bit-identical: every group value (lr, betas, ...) compared with ==.
        assert groups_snapshot(opt2) == reference[step], (cfg["type"], step)
        opt2.step()
        sched2.step()


def test_loading_optimizer_state_for_other_group_count_fails():
    opt, _ = make(dict(type="PolyLR"), 10, lrs=(1.0, 0.1))
    other, _ = make(dict(type="PolyLR"), 10, lrs=(1.0,))
    context = RestoreContext.__new__(RestoreContext)
    context.path = Path("step000000005-epoch0000")
    with pytest.raises(CheckpointError, match="has 2 optimizer param groups, the config builds 1"):
        OptimizerParticipant(other).restore(opt.state_dict(), context)


def test_scheduler_resumes_progress_with_the_configured_length():
    """Config wins for schedule parameters: a longer schedule continues from the saved step."""
    opt, sched = make(dict(type="PolyLR", power=1.0), 10, lrs=(1.0,))
    for _ in range(4):
        opt.step()
        sched.step()
    longer_opt, longer = make(dict(type="PolyLR", power=1.0), 20, lrs=(1.0,))
    longer.load_state_dict(sched.state_dict())
    assert longer.total_steps == 20 and longer.last_epoch == 4
    assert longer_opt.param_groups[0]["lr"] == pytest.approx(1.0 * (1 - 4 / 20))


@pytest.mark.parametrize(
    "cfg, total, needle",
    [
        (dict(type="PolyLR"), 0, "total_steps=0"),
        (dict(type="CosineWarmupLR"), -5, "total_steps=-5"),
        (dict(type="MultiStepLR", milestones=[0.5, 1.5]), 10, "milestone 1.5"),
        (dict(type="MultiStepLR", milestones=[0.0, 0.5]), 10, "milestone 0.0"),
        (dict(type="MultiStepLR", milestones=[0.8, 0.6]), 10, "strictly increasing"),
        (dict(type="MultiStepLR", milestones=[0.5, 8]), 10, "mix fractions"),
        (dict(type="CosineWarmupLR", warmup_steps=10), 10, "warm-up (10 steps) must be shorter than training (10 steps)"),
        (dict(type="CosineWarmupLR", warmup_ratio=1.2), 10, "warmup_ratio must be in [0, 1)"),
        (dict(type="CosineWarmupLR", warmup_steps=2, warmup_ratio=0.1), 10, "not both"),
        (dict(type="PolyLR", power=-1.0), 10, "power must be in [0, inf]"),
        (dict(type="OneCycleLR", pct_start=1.0), 10, "pct_start must be in (0, 1)"),
        (dict(type="OneCycleLR", max_lr=[1.0]), 10, "max_lr has 1 values"),
        (dict(type="PolyLR", total_steps=5), 10, "scheduler.total_steps is filled in by the trainer"),
    ],
)
def test_scheduler_config_errors(cfg, total, needle):
    with pytest.raises(ConfigError) as err:
        make(cfg, total)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_unknown_scheduler_and_foreign_scheduler_types():
    with pytest.raises(RegistryError, match="PolyLR"):
        make(dict(type="PolyLRR"), 10)
    # A scheduler class that does not take total_steps is built without it.
    opt, sched = make(dict(type=torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5), 10)
    assert isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for _ in range(2):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.5
