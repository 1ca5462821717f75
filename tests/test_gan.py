"""Several networks, several optimizers: ``optimizer = dict(disc=..., gen=...)``
with GANTrainer on a tiny RingGAN (8x16 ring images).

Covers: the multi-optimizer config builds one OptimStep per part over that
part's parameters (own scheduler, scaler, clipping, checkpoint participants);
wrong names are one-line errors (exit 2 from the command line); SIGKILL +
``resume=True`` is bit-identical for both networks and both optimizers; a
2-process DDP run trains (slow).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import pimm.cli

pimm.cli.register_all()

from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.state.manager import CheckpointManager  # noqa: E402
from pimm.utils.errors import UserError  # noqa: E402
from tests.support.run import ROOT, final_weights, run_tool  # noqa: E402
from tests.test_resume import SIGKILLED, Run  # noqa: E402

STEPS_PER_EPOCH, EPOCHS = 4, 3  # 64 events, batch 16
TOTAL = STEPS_PER_EPOCH * EPOCHS

GAN_CONFIG = '''
_base_ = {base!r}
custom_imports = ["tests.support.toy"]
save_path = {save_path!r}
seed = 3
epoch = {epochs}
batch_size = 16
batch_size_val = 32
num_worker = 0
train = dict(type="GANTrainer")
model = dict(type="RingGAN", image_size=(8, 16), channels=1, latent_dim=8, width=4, depth=3)
optimizer = dict(disc=dict(type="Adam", lr=1e-3, betas=(0.5, 0.999)),
                 gen=dict(type="AdamW", lr=2e-3, betas=(0.5, 0.999)))
scheduler = dict(disc=dict(type="ConstantLR"), gen=dict(type="CosineWarmupLR", warmup_ratio=0.25))
clip_grad = dict(gen=5.0)
log_grad_norm = True
data = dict(
    train=dict(type="CherenkovRingDataset", num_events=64, split="train", image_size=(8, 16), with_time=False,
               in_memory=True),
    val=dict(type="CherenkovRingDataset", num_events=32, split="val", image_size=(8, 16), with_time=False,
             in_memory=True),
)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=2),
    dict(type="RingGANEvaluator"),
    dict(type="CheckpointSaver", save_freq=3, keep_last=2, async_write=False),
    dict(type="KillAtStep", step=10**9, signal_name="SIGKILL"),
]
'''


def write_config(directory: Path, save_path: Path, extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "gan_cfg.py"
    base = str(ROOT / "configs" / "_base_" / "default_runtime.py")
    path.write_text(GAN_CONFIG.format(base=base, save_path=str(save_path), epochs=EPOCHS) + extra)
    return path


def make_trainer(tmp_path: Path, *options: str, extra: str = ""):
    cfg, hooks = load_config(str(write_config(tmp_path / "cfg", tmp_path / "run", extra)), list(options),
                             world_size=1)
    return build_trainer(cfg, hooks=hooks)


def one_line_error(tmp_path: Path, *options: str, extra: str = "") -> str:
    with pytest.raises(UserError) as info:
        make_trainer(tmp_path, *options, extra=extra)
    message = str(info.value)
    assert "\n" not in message
    return message


# -- the config builds ------------------------------------------------------------
def test_multi_optimizer_config_builds_one_optim_step_per_part(tmp_path):
    trainer = make_trainer(tmp_path)
    model = trainer.model_without_ddp
    assert list(trainer.optim_steps) == ["disc", "gen"] and trainer.order == ("disc", "gen")
    for name in ("disc", "gen"):
        part = trainer.optim_parts[name]
        own = {id(p) for p in getattr(model, name).parameters()}
        held = {id(p) for group in part.optimizer.param_groups for p in group["params"]}
        assert held == own, f"optimizer {name} must hold exactly model.{name}'s parameters"
        assert part.step is trainer.optim_steps[name] and part.step.optimizer is part.optimizer
    disc, gen = trainer.optim_parts["disc"], trainer.optim_parts["gen"]
    assert type(disc.optimizer).__name__ == "Adam" and type(gen.optimizer).__name__ == "AdamW"
    assert type(disc.scheduler).__name__ == "ConstantLR" and type(gen.scheduler).__name__ == "CosineWarmupLR"
    assert disc.scaler is not gen.scaler
    assert disc.step.clip_grad is None and gen.step.clip_grad == 5.0  # clip_grad = dict(gen=5.0)
    assert trainer.optimizer is None and trainer.optim_step is None  # no single optimizer to mistake for all
    names = set(trainer.checkpointer.participants())
    assert {"optimizer/disc", "optimizer/gen", "scheduler/disc", "scheduler/gen", "scaler/disc",
            "scaler/gen", "model"} <= names
    assert not {"optimizer", "scheduler", "scaler"} & names


def test_one_scheduler_for_every_part_and_param_dicts_per_part(tmp_path):
    trainer = make_trainer(tmp_path, extra='scheduler = dict(type="ConstantLR")\n'
                                           'clip_grad = 1.0\n'
                                           'param_dicts = dict(gen=[dict(keyword="project", lr_scale=0.5)])\n')
    disc, gen = trainer.optim_parts["disc"], trainer.optim_parts["gen"]
    assert type(disc.scheduler).__name__ == type(gen.scheduler).__name__ == "ConstantLR"
    assert disc.step.clip_grad == gen.step.clip_grad == 1.0
    assert [g["name"] for g in gen.optimizer.param_groups] == ["default", "project"]
    assert gen.optimizer.param_groups[1]["lr"] == pytest.approx(1e-3)
    assert [g["name"] for g in disc.optimizer.param_groups] == ["default"]


def test_each_part_steps_its_own_network_and_logs_its_metrics(tmp_path):
    trainer = make_trainer(tmp_path, "epoch=1")
    model = trainer.model_without_ddp
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    after = model.state_dict()
    for name in ("disc", "gen"):
        changed = [k for k in after if k.startswith(name + ".") and k.endswith("weight")
                   and not torch.equal(before[k], after[k])]
        assert changed, f"model.{name} was not trained"
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    step1 = next(r for r in records if r["step"] == 1 and "train/loss" in r)
    for key in ("train/loss/disc", "train/loss/gen", "train/lr/disc", "train/lr/gen", "train/grad_norm/disc",
                "train/grad_norm/gen", "train/disc_acc/disc"):
        assert math.isfinite(step1[key]), key
    assert step1["train/loss"] == pytest.approx(step1["train/loss/disc"] + step1["train/loss/gen"], rel=1e-5)
    assert "train/lr" not in step1
    val = next(r for r in records if "val/stat_gap" in r)
    assert 0.0 <= val["val/disc_acc"] <= 1.0 and val["val/stat_gap"] >= 0.0


# -- wrong names: one line each ----------------------------------------------------
def test_a_part_that_is_no_submodule_is_a_one_line_error(tmp_path):
    message = one_line_error(tmp_path, extra='optimizer = dict(disc=dict(type="Adam"), generator=dict(type="Adam"))\n'
                                             'scheduler = None\nclip_grad = None\n')
    assert "optimizer.generator" in message and "RingGAN" in message and "parts: gen, disc" in message


@pytest.mark.parametrize("extra, expected", [
    ('scheduler = dict(disc=dict(type="ConstantLR"))\n', "scheduler has no entry for optimizer part 'gen'"),
    ('scheduler = dict(disc=dict(type="ConstantLR"), gen=dict(type="ConstantLR"), gan=dict(type="ConstantLR"))\n',
     "scheduler.gan: no optimizer part is named 'gan'"),
    ('clip_grad = dict(dics=1.0)\n', "clip_grad.dics: no optimizer part is named 'dics'"),
    ('param_dicts = [dict(keyword="project", lr_scale=0.5)]\n', "param_dicts="),
    ('train = dict(type="GANTrainer", order=["disc", "generator"])\n', "train.order names 'generator'"),
    ('optimizer = dict(disc=dict(type="Adam"), gen=dict(lr=1e-3))\n', "optimizer.gen"),
    ('optimizer = dict(disc=dict(type="Adam", lrr=1e-3), gen=dict(type="Adam"))\n', "optimizer part 'disc'"),
    ('optimizer = dict(type="Adam", lr=1e-3)\nscheduler = None\nclip_grad = None\n', "GANTrainer trains several"),
    ('train = dict(type="DefaultTrainer")\n', "DefaultTrainer steps one optimizer"),
], ids=["scheduler-missing", "scheduler-unknown", "clip-unknown", "param-dicts-list", "order", "no-type",
        "bad-option", "single-optimizer", "default-trainer"])
def test_wrong_part_names_are_one_line_errors(tmp_path, extra, expected):
    assert expected in one_line_error(tmp_path, extra=extra)


def test_the_command_line_refuses_a_wrong_part_with_exit_2(tmp_path):
    config = write_config(tmp_path / "cfg", tmp_path / "run")
    result = run_tool("train", config, '+optimizer.dis={"type":"Adam"}')  # a third, misspelt part
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "optimizer.dis" in lines[0] and "gen, disc" in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


# -- exact resume ------------------------------------------------------------------
class GanRun(Run):
    """test_resume's Run (subprocess, stall watchdog) on the GAN config."""

    def __init__(self, root: Path, name: str):
        Run._count += 1
        self.save = Path(root) / name
        self.cfg = write_config(Path(root) / f"cfg{Run._count}-{name}", self.save)
        self.output = self.cfg.parent / "output.txt"


def newest_state(run: GanRun) -> dict:
    newest = CheckpointManager(run.save / "checkpoints").committed()[-1]
    return torch.load(newest / "common.pth", weights_only=True)


def assert_same_tensors(got, want, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got, want), f"{where} differs"
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), f"{where}: keys differ"
        for key in want:
            assert_same_tensors(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_tensors(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.slow
def test_sigkill_then_resume_is_bit_identical_for_both_networks_and_optimizers(tmp_path):
    ref = GanRun(tmp_path, "ref")
    ref.train()
    run = GanRun(tmp_path, "killed")
    for step in (5, 8):  # between checkpoints (3, 6, 9, 12): resumes from 3, then from 6
        run.train(f"hooks.KillAtStep.step={step}", "resume=True", expect=SIGKILLED)
    run.train("resume=True")
    assert run.log().count("Resumed from") == 2

    got, want = final_weights(run.save), final_weights(ref.save)
    assert got["global_step"] == want["global_step"] == TOTAL
    assert any(k.startswith("gen.") for k in want["state_dict"]) and any(k.startswith("disc.") for k in want["state_dict"])
    assert_same_tensors(got["state_dict"], want["state_dict"], "model_last.pth")
    got_state, want_state = newest_state(run), newest_state(ref)
    for name in ("optimizer/disc", "optimizer/gen", "scheduler/disc", "scheduler/gen", "scaler/disc", "scaler/gen"):
        assert name in want_state, name
        assert_same_tensors(got_state[name], want_state[name], name)
    assert want_state["optimizer/gen"]["state"], "the generator's optimizer has no moments: nothing was compared"
    assert run.records() == ref.records(), "metrics.jsonl after the resumes differs from the uninterrupted run's"


@pytest.mark.slow
def test_two_process_ddp_run_trains_both_parts(tmp_path):
    run = GanRun(tmp_path, "ddp")
    run.train("batch_size=32", num_gpus=2)  # 16 per process: 2 steps per epoch
    weights = final_weights(run.save)
    assert weights["global_step"] == 2 * EPOCHS
    records = run.records()
    steps = [r for r in records if "train/loss/gen" in r]
    assert [r["step"] for r in steps] == list(range(1, 2 * EPOCHS + 1))
    assert all(math.isfinite(r["train/grad_norm/disc"]) and math.isfinite(r["train/grad_norm/gen"]) for r in steps)
    assert any("val/stat_gap" in r for r in records)


@pytest.mark.slow
def test_fsdp_shards_each_network_trains_like_ddp_and_resumes_exactly(tmp_path):
    ddp, fsdp, killed = GanRun(tmp_path, "ddp"), GanRun(tmp_path, "fsdp"), GanRun(tmp_path, "killed")
    ddp.train("batch_size=32", num_gpus=2)  # 16 per process: 2 steps per epoch, 6 in all
    fsdp.train("batch_size=32", "parallel.strategy=fsdp", num_gpus=2)
    assert "in 3 unit(s) (RingDiscriminator, RingGenerator and the root)" in fsdp.log()
    got, want = final_weights(fsdp.save)["state_dict"], final_weights(ddp.save)["state_dict"]
    assert got.keys() == want.keys()
    for key in want:  # reduce-scatter and all-reduce sum in other orders: equal to float rounding
        assert torch.allclose(got[key].float(), want[key].float(), rtol=1e-4, atol=1e-5), key
    newest = CheckpointManager(fsdp.save / "checkpoints").committed()[-1]
    manifest = json.loads((newest / "COMMITTED").read_text())
    assert manifest["sharded"] == ["model", "optimizer/disc", "optimizer/gen"]

    # Both ranks SIGKILL themselves after step 4, once step 3's checkpoint is committed;
    # the launcher reports them and exits 1.
    killed.train("batch_size=32", "parallel.strategy=fsdp", "hooks.KillAtStep.step=4",
                 "hooks.KillAtStep.wait_for_commit=True", expect=1, num_gpus=2)
    killed.train("batch_size=32", "parallel.strategy=fsdp", "resume=True", num_gpus=2)
    assert killed.log().count("Resumed from step000000003") == 1
    assert_same_tensors(final_weights(killed.save)["state_dict"], got, "FSDP model_last.pth after the resume")


def test_a_hook_acting_on_the_single_optimizer_lr_is_refused_in_one_line(tmp_path):
    trainer = make_trainer(tmp_path, extra='hooks = [dict(type="RingGANEvaluator"), '
                                           'dict(type="ReduceLROnPlateau", monitor="val/stat_gap")]\n')
    with pytest.raises(UserError) as info:
        trainer.train()
    assert "ReduceLROnPlateau acts on a single optimizer" in str(info.value) and "(disc, gen)" in str(info.value)
    assert "\n" not in str(info.value)


def test_scheduler_interval_applies_to_every_part(tmp_path):
    trainer = make_trainer(tmp_path, "scheduler_interval=2")
    for name in ("disc", "gen"):
        assert trainer.optim_steps[name].scheduler_interval == 2
        assert f"optim_step/{name}" in trainer.checkpointer.participants()
    # the cosine schedule of gen spans the 12 updates in 6 scheduler steps
    assert trainer.optim_parts["gen"].scheduler.total_steps == TOTAL // 2
