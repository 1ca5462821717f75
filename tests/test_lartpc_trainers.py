"""End-to-end: the point-cloud trainers on the LArTPC generator (a few steps
each), RatioSampler mixing ratios, and exact resume of the multi-data-set loader."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from pimm.distributed.sampler import RatioSampler
from tests.support.run import ROOT, final_weights, run_tool, train_losses

TRANSFORM = """[dict(type="RandomRotate", angle=(-1, 1), axis="z"), dict(type="RandomJitter", sigma=0.1, clip=0.3),
     dict(type="LogTransform", key="energy"), dict(type="ToTensor"),
     dict(type="Collect", keys=("coord", "segment", "instance"), feat_keys=("energy",))]"""

BASE = f"""
_base_ = {str(ROOT / "configs" / "_base_" / "default_runtime.py")!r}
epoch = 2
batch_size = 2
_t = {TRANSFORM}
_gen = dict(type="LArTPCSynthDataset", transform=_t, points_per_event=(150, 300))
data = dict(train=dict(_gen, num_events=6, split="train"), val=dict(_gen, num_events=4, split="val"),
            test=dict(_gen, num_events=4, split="test"))
_backbone = dict(type="SparseUNet", in_channels=1, channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,))
optimizer = dict(type="AdamW", lr=0.002)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.2)
"""

SEMSEG = BASE + """
model = dict(type="DefaultSegmentor", num_classes=5, backbone=_backbone)
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=2),
         dict(type="SemSegEvaluator", num_classes=5), dict(type="CheckpointSaver", save_freq=2)]
"""

INSEG = BASE + """
train = dict(type="InsegTrainer")
model = dict(type="PointGroupLite", num_classes=5, backbone=_backbone)
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=2),
         dict(type="InsSegEvaluator", num_classes=5), dict(type="CheckpointSaver", save_freq=2)]
"""

MULTI = BASE + """
train = dict(type="MultiDatasetTrainer", ratios=[3, 1], samples_per_epoch=8)
data = dict(train=[dict(_gen, num_events=6, split="train"), dict(_gen, num_events=4, seed=9, split="train")],
            val=dict(_gen, num_events=4, split="val"))
model = dict(type="DefaultSegmentor", num_classes=5, backbone=_backbone)
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=2),
         dict(type="SemSegEvaluator", num_classes=5), dict(type="CheckpointSaver", save_freq=2)]
"""

pytestmark = pytest.mark.slow


def _write(tmp_path, text, save_path, extra=""):
    path = tmp_path / f"cfg_{save_path.name}.py"
    path.write_text(text + f"\nsave_path = {str(save_path)!r}\n" + extra)
    return path


def _records(save_path):
    return [json.loads(line) for line in open(save_path / "metrics.jsonl")]


@pytest.mark.parametrize("text,metric", [(SEMSEG, "val/mIoU"), (INSEG, "val/ARI")], ids=["semseg", "inseg"])
def test_point_trainers_train_evaluate_and_test(tmp_path, text, metric):
    save = tmp_path / "run"
    cfg = _write(tmp_path, text, save)
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr
    records = _records(save)
    assert [s for s, _ in train_losses(save)] == list(range(1, 7))  # 2 epochs x 3 steps
    evaluated = [r[metric] for r in records if metric in r]
    assert len(evaluated) == 2 and all(0.0 <= v <= 1.0 for v in evaluated)
    best = torch.load(save / "model" / "model_best.pth", weights_only=True)
    assert best["metric"] == max(evaluated)
    result = run_tool("test", cfg, f"weight={save / 'model' / 'model_best.pth'}")
    assert result.returncode == 0, result.stderr
    metrics = json.loads((save / "test_metrics.json").read_text())["metrics"]
    assert metric.split("/")[1] in next(iter(metrics.values()))


def _assert_kill_and_resume_is_exact(tmp_path, text, steps):
    reference = tmp_path / "ref"
    result = run_tool("train", _write(tmp_path, text, reference))
    assert result.returncode == 0, result.stderr
    assert [s for s, _ in train_losses(reference)] == list(range(1, steps + 1))
    crashed = tmp_path / "crashed"
    cfg = _write(tmp_path, text, crashed, extra='custom_imports = ["tests.support.toy"]\n'
                 'hooks = hooks + [dict(type="KillAtStep", step=3)]\n')
    assert run_tool("train", cfg).returncode == -9
    assert run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1").returncode == 0
    ref, got = final_weights(reference), final_weights(crashed)
    assert all(torch.equal(ref["state_dict"][k], got["state_dict"][k]) for k in ref["state_dict"])
    assert train_losses(reference) == train_losses(crashed)


def test_inseg_trainer_resumes_exactly(tmp_path):
    _assert_kill_and_resume_is_exact(tmp_path, INSEG, steps=6)  # 2 epochs x 3 steps


def test_multi_dataset_trainer_mixes_and_resumes_exactly(tmp_path):
    _assert_kill_and_resume_is_exact(tmp_path, MULTI, steps=8)  # 8 samples / batch 2, 2 epochs


def test_ratio_sampler_follows_ratios_and_uses_small_sets_fully():
    sampler = RatioSampler([50, 1000], [0.5, 0.5], samples_per_epoch=4000, seed=3)
    order = sampler.global_order()
    from_small = [i for i in order if i < 50]
    assert abs(len(from_small) / len(order) - 0.5) < 0.03
    # The small set is cycled through whole permutations before repeating.
    first_round = from_small[:50]
    assert sorted(first_round) == list(range(50))
    counts = Counter(from_small)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_ratio_sampler_shards_and_seeds_do_not_depend_on_world_size():
    single = RatioSampler([10, 30], [1, 3], samples_per_epoch=24, seed=1, with_seeds=True)
    ranks = [RatioSampler([10, 30], [1, 3], samples_per_epoch=24, seed=1, rank=r, world_size=2, with_seeds=True)
             for r in range(2)]
    interleaved = [key for pair in zip(*[list(s) for s in ranks]) for key in pair]
    assert interleaved == list(single)
    single.set_epoch(1)
    assert list(single) != interleaved


@pytest.mark.slow
@pytest.mark.parametrize("text,metric", [(INSEG, "val/ARI"), (MULTI, "val/mIoU")], ids=["inseg", "multi"])
def test_point_trainers_under_fsdp_train_like_ddp(tmp_path, text, metric):
    """InsegTrainer and MultiDatasetTrainer with ``parallel.strategy=fsdp`` on
    two processes: the same losses and weights as DDP to float rounding (the
    sparse U-Net's BatchNorm statistics included), and the evaluation runs."""
    runs = {}
    for strategy in ("ddp", "fsdp"):
        save = tmp_path / strategy
        result = run_tool("train", _write(tmp_path, text, save), f"parallel.strategy={strategy}", num_gpus=2)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = save
    ddp, fsdp = train_losses(runs["ddp"]), train_losses(runs["fsdp"])
    assert [s for s, _ in fsdp] == [s for s, _ in ddp] and len(ddp) > 0
    torch.testing.assert_close(torch.tensor([v for _, v in fsdp]), torch.tensor([v for _, v in ddp]), atol=1e-4, rtol=0)
    a, b = final_weights(runs["fsdp"])["state_dict"], final_weights(runs["ddp"])["state_dict"]
    assert list(a) == list(b) and any("running_mean" in key for key in a)
    for key in a:
        torch.testing.assert_close(a[key].float(), b[key].float(), atol=1e-4, rtol=0, msg=key)
    assert [r[metric] for r in _records(runs["fsdp"]) if metric in r]
    newest = sorted((runs["fsdp"] / "checkpoints").glob("step*"))[-1]
    assert json.loads((newest / "COMMITTED").read_text())["sharded"] == ["model", "optimizer"]  # really FSDP
