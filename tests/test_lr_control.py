"""LR control as scheduler state: ``pimm.engines.scale_lr`` and the
``ReduceLROnPlateau`` hook.

The scale is part of the scheduler's state: saved with it, restored on resume
without re-application, never reported as a config change. The plateau hook
keeps the schedule's shape (lr = schedule x factor**k) and, killed and
resumed, gives the uninterrupted run bit for bit (ring example, real
processes).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from pimm.engines import scale_lr
from pimm.engines.hooks.base import EvalRun
from pimm.engines.hooks.lr_plateau import counts_for_plateau
from pimm.engines.optim import build_optimizer
from pimm.engines.optim.scheduler import MIN_LR_SCALE, build_scheduler
from pimm.utils.errors import CheckpointError, ConfigError
from tests.support.inprocess import hook_of, make_trainer, records
from tests.support.run import ROOT, final_weights, run_tool, train_losses

SCHEDULES = [
    dict(type="CosineWarmupLR", warmup_ratio=0.2),
    dict(type="CosineWarmupLR", warmup_steps=3, eta_min=1e-4),
    dict(type="OneCycleLR", pct_start=0.25),
    dict(type="MultiStepLR", milestones=[0.3, 0.7], gamma=0.5),
    dict(type="PolyLR", power=0.9),
    dict(type="ConstantLR"),
]


def build(spec, total=20):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    optimizer = build_optimizer(dict(type="AdamW", lr=0.01), model, [dict(keyword="1.", lr_scale=0.5)])
    return optimizer, build_scheduler(dict(spec), optimizer, total_steps=total)


def lrs(optimizer) -> list[float]:
    return [g["lr"] for g in optimizer.param_groups]


# ----------------------------------------------------------------------------- scale_lr


@pytest.mark.parametrize("spec", SCHEDULES, ids=lambda s: s["type"] + str(len(s)))
def test_the_scale_is_scheduler_state_restored_bit_identically(spec):
    optimizer, scheduler = build(spec)
    for _ in range(5):
        optimizer.step(), scheduler.step()
    assert scale_lr(optimizer, scheduler, 0.5) == 0.5
    assert scale_lr(optimizer, scheduler, 0.3) == 0.5 * 0.3
    state = scheduler.state_dict()
    assert state["lr_scale"] == 0.5 * 0.3
    # A scheduler rebuilt from the config and given the state: the same lrs, now and later.
    optimizer2, scheduler2 = build(spec)
    scheduler2.load_state_dict(state)
    for _ in range(15):
        assert lrs(optimizer2) == lrs(optimizer)
        optimizer.step(), scheduler.step(), optimizer2.step(), scheduler2.step()
    # The config's values are untouched: nothing for a resume to call a config change.
    assert [g["initial_lr"] for g in optimizer.param_groups] == [g["initial_lr"] for g in build(spec)[0].param_groups]


def test_the_schedule_keeps_its_shape():
    optimizer, scheduler = build(dict(type="OneCycleLR", pct_start=0.25))
    ref_optimizer, ref_scheduler = build(dict(type="OneCycleLR", pct_start=0.25))
    for step in range(19):
        if step in (4, 9):
            scale_lr(optimizer, scheduler, 0.5)
        k = (step >= 4) + (step >= 9)
        assert lrs(optimizer) == [lr * 0.5 ** k for lr in lrs(ref_optimizer)]  # powers of 2: exact
        optimizer.step(), scheduler.step(), ref_optimizer.step(), ref_scheduler.step()


def test_a_checkpoint_without_a_scale_is_unscaled_and_a_damaged_one_is_refused():
    optimizer, scheduler = build(SCHEDULES[0])
    optimizer.step(), scheduler.step()
    state = scheduler.state_dict()
    old = {k: v for k, v in state.items() if k != "lr_scale"}  # written before lr_scale existed
    optimizer2, scheduler2 = build(SCHEDULES[0])
    scheduler2.load_state_dict(old)
    assert scheduler2.lr_scale == 1.0 and lrs(optimizer2) == lrs(optimizer)
    for bad in (float("inf"), float("nan"), 0.0, -1.0):
        with pytest.raises(CheckpointError, match="lr_scale"):
            scheduler2.load_state_dict({**state, "lr_scale": bad})


@pytest.mark.parametrize("factor", [0, -0.5, float("nan"), float("inf"), True, "0.5", 1e-13])
def test_scale_lr_refuses_a_bad_factor_and_changes_nothing(factor):
    optimizer, scheduler = build(SCHEDULES[2])
    before = lrs(optimizer)
    with pytest.raises(ValueError):
        scale_lr(optimizer, scheduler, factor)
    assert lrs(optimizer) == before and scheduler.lr_scale == 1.0


def test_scale_lr_refuses_to_leave_the_scale_range_and_needs_a_pimm_scheduler():
    optimizer, scheduler = build(SCHEDULES[0])
    scale_lr(optimizer, scheduler, 1e-6)
    scale_lr(optimizer, scheduler, 1e-6)
    assert scheduler.lr_scale == pytest.approx(MIN_LR_SCALE)
    with pytest.raises(ValueError, match="outside"):
        scale_lr(optimizer, scheduler, 0.5)
    assert scheduler.lr_scale == pytest.approx(MIN_LR_SCALE) and all(lr > 0 for lr in lrs(optimizer))
    torch_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5)
    with pytest.raises(TypeError, match="pimm's schedulers"):
        scale_lr(optimizer, torch_scheduler, 0.5)
    with pytest.raises(ValueError, match="does not drive this optimizer"):
        scale_lr(build(SCHEDULES[0])[0], scheduler, 0.5)


def test_a_scaled_lr_survives_resume_without_a_config_change_warning(tmp_path, caplog):
    """A LiveControl lr change at step 2, stop at step 5 (checkpoint at 4), resume: the lr per step is
    the uninterrupted run's, and the resume reports no config change."""
    hooks = ('[dict(type="InformationWriter", log_frequency=2), dict(type="LiveControl", poll_every=2), '
             'dict(type="CheckpointSaver", save_freq=4), dict(type="WriteFileAtStep", step=1, name="control.json", '
             'text=\'{"revision": 1, "lr": 0.002}\')EXTRA]')
    ref = make_trainer(tmp_path / "ref", hooks.replace("EXTRA", ""))
    ref.train()
    first = make_trainer(tmp_path / "run", hooks.replace("EXTRA", ', dict(type="StopAtStep", step=5)'))
    first.train()
    shutil.rmtree(first.save_path / "checkpoints" / "step000000005-epoch0001")
    caplog.set_level(logging.INFO, logger="pimm")
    resumed = make_trainer(tmp_path / "run", hooks.replace("EXTRA", ""), options=["resume=True"])
    resumed.train()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Resumed from step000000004" in text
    assert "config wins" not in text.lower() and "Config differs" not in text
    lr = {r["step"]: r["train/lr"] for r in records(resumed.save_path) if "train/lr" in r}
    want = {r["step"]: r["train/lr"] for r in records(ref.save_path) if "train/lr" in r}
    assert lr == want and lr[3] == pytest.approx(0.002)


# ----------------------------------------------------------------------------- ReduceLROnPlateau


PLATEAU = ('[dict(type="ClsEvaluator", num_classes=2), '
           'dict(type="ReduceLROnPlateau", monitor="val/acc", factor=0.5, patience={patience}{extra})]')


def plateau_hook(tmp_path, patience=0, extra=""):
    trainer = make_trainer(tmp_path, PLATEAU.format(patience=patience, extra=extra),
                           extra='scheduler = dict(type="ConstantLR")\n')
    hook = hook_of(trainer, "ReduceLROnPlateau")
    hook.before_train()
    return trainer, hook


def evaluate(trainer, hook, value, kind="scheduled", prefix="val"):
    hook.after_val({"val/acc": value}, EvalRun(kind=kind, prefix=prefix, step=trainer.global_step))


def test_only_scheduled_evaluations_of_the_monitor_prefix_count(tmp_path):
    trainer, hook = plateau_hook(tmp_path / "a")
    assert hook.mode == "max"  # ClsEvaluator declares val/acc as larger-is-better
    start = trainer.optimizer.param_groups[0]["lr"]
    evaluate(trainer, hook, 0.9)
    for kind, prefix in (("final", "val"), ("on_demand", "val"), ("scheduled", "val_ema")):
        evaluate(trainer, hook, 0.1, kind, prefix)
    assert trainer.scheduler.lr_scale == 1.0 and hook.best == 0.9
    evaluate(trainer, hook, 0.9)  # equal is no improvement
    assert trainer.scheduler.lr_scale == 0.5 and trainer.optimizer.param_groups[0]["lr"] == start * 0.5
    # The frozen ``run`` description decides.
    assert not counts_for_plateau(EvalRun(kind="on_demand", prefix="val", step=0), "val")
    run = EvalRun(kind="scheduled", prefix="val", step=0)
    assert counts_for_plateau(run, "val") and not counts_for_plateau(run, "val_ema")


def test_patience_cooldown_threshold_and_min_lr(tmp_path):
    trainer, hook = plateau_hook(tmp_path / "a", patience=1, extra=", cooldown=1, threshold=0.1, min_lr=1e-3")
    assert trainer.optimizer.param_groups[0]["lr"] == 0.01
    evaluate(trainer, hook, 0.5)
    evaluate(trainer, hook, 0.54)  # within the 10 % relative threshold: no improvement (1/1)
    assert trainer.scheduler.lr_scale == 1.0
    evaluate(trainer, hook, 0.54)  # 2 > patience: reduce, then one evaluation of cooldown
    assert trainer.scheduler.lr_scale == 0.5
    evaluate(trainer, hook, 0.1)  # cooldown: not counted
    evaluate(trainer, hook, 0.1)
    assert trainer.scheduler.lr_scale == 0.5
    evaluate(trainer, hook, 0.1)
    assert trainer.scheduler.lr_scale == 0.25
    evaluate(trainer, hook, 0.56)  # beats 0.5 by more than 10 %
    assert hook.best == 0.56 and hook.num_bad == 0
    for _ in range(20):
        evaluate(trainer, hook, 0.0)
    # 0.125 and then the factor that reaches min_lr exactly (0.1 of the configured lr), no further.
    assert trainer.scheduler.lr_scale == pytest.approx(0.1) and hook.reductions == 4
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)


@pytest.mark.parametrize("options, match", [
    ("factor=1.0", "factor"), ("patience=-1", "patience"), ("threshold_mode='x'", "threshold_mode"),
    ("mode='min'", "contradicts"), ("cooldown=0.5", "cooldown"), ("min_lr=-1", "min_lr"),
])
def test_bad_options_are_config_errors(tmp_path, options, match):
    with pytest.raises(ConfigError, match=match):
        plateau_hook(tmp_path / "a", extra=", " + options)


# ----------------------------------------------------------------------------- the ring example, killed

RING = '''
_base_ = {base!r}
custom_imports = ["tests.support.toy"]
save_path = {save!r}
epoch = 3
data = dict(
    train=dict(type="CherenkovRingDataset", num_events=512, split="train", in_memory=True),
    val=dict(type="CherenkovRingDataset", num_events=256, split="val", in_memory=True),
    test=dict(type="CherenkovRingDataset", num_events=256, split="test", in_memory=True),
)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2, every_n_steps=3),
    dict(type="ReduceLROnPlateau", monitor="val/acc", factor=0.5, patience=0),
    dict(type="CheckpointSaver", save_freq=5, keep_last=2, async_write=False),
    dict(type="KillAtStep", step=10**9),
]
'''
RING_STEPS = 24  # 512 events / batch 64 x 3 epochs


def ring_run(root: Path, name: str) -> tuple[Path, Path]:
    save = root / name
    cfg = root / f"{name}.py"
    cfg.write_text(RING.format(base=str(ROOT / "configs" / "rings" / "cls-cnn.py"), save=str(save)))
    return cfg, save


def metric_records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # three processes on the ring example: about 2 minutes on 2 cores
def test_ring_plateau_scales_the_schedule_and_resumes_bit_identically_after_two_sigkills(tmp_path):
    ref_cfg, ref = ring_run(tmp_path, "ref")
    done = run_tool("train", ref_cfg)
    assert done.returncode == 0, done.stderr[-3000:]
    lr = {r["step"]: r["train/lr"] for r in metric_records(ref) if "train/lr" in r}
    acc = {r["step"]: r["val/acc"] for r in metric_records(ref) if "val/acc" in r}
    assert sorted(lr) == list(range(1, RING_STEPS + 1)) and sorted(acc) == list(range(3, RING_STEPS + 1, 3))

    # lr = schedule x 0.5**k, k = evaluations without improvement (patience 0, rel threshold 1e-4)
    # before the step; the schedule is the config's OneCycleLR, rebuilt here.
    param = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=3e-3)
    schedule = build_scheduler(dict(type="OneCycleLR", pct_start=0.15), optimizer, total_steps=RING_STEPS)
    best, k, expected = None, 0, {}
    for step in range(1, RING_STEPS + 1):
        expected[step] = optimizer.param_groups[0]["lr"] * 0.5 ** k
        optimizer.step(), schedule.step()
        if step in acc:
            if best is None or acc[step] > best * (1 + 1e-4):
                best = acc[step]
            else:
                k += 1
    assert lr == expected
    reductions = (ref / "train.log").read_text().count("ReduceLROnPlateau: ")
    assert reductions == k >= 2, "the run must have evaluations without improvement, or it tests nothing"

    cfg, save = ring_run(tmp_path, "killed")
    rng = random.Random("ring-plateau")
    kills = [rng.choice(range(4, 12)), rng.choice(range(13, 23))]
    for step in kills:
        killed = run_tool("train", cfg, f"hooks.KillAtStep.step={step}", "resume=True")
        assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_tool("train", cfg, "resume=True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (save / "train.log").read_text()
    assert log.count("Resumed from") == 2 and "config wins" not in log.lower(), kills

    got, want = final_weights(save)["state_dict"], final_weights(ref)["state_dict"]
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert train_losses(save) == train_losses(ref)
    assert {r["step"]: r["train/lr"] for r in metric_records(save) if "train/lr" in r} == lr
    assert metric_records(save) == metric_records(ref)
