"""Sonata as upstream's users run it, through tools/train.py: upstream's
pre-training config (configs/panda/pretrain/pretrain-sonata-v1m1-pilarnet-
smallmask.py) key for key, widths and run length shrunk, ``data_root``
pointing at files from tools/export_pilarnet.py; then upstream's linear-probe
fine-tuning config loading that run's student backbone; and kill -9 / resume
of pre-training, bit for bit."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

from tests.support.run import ROOT, env, final_weights, run_tool, train_losses

pytestmark = pytest.mark.slow

# Upstream's pretraining config with every key it sets; what differs is marked "shrunk".
PRETRAIN = '''
_base_ = ["../../_base_/default_runtime.py"]

batch_size = 2  # shrunk
num_worker = 0  # shrunk
batch_size_val = 2  # shrunk
mix_prob = 0
clip_grad = 3.0
empty_cache = False
enable_amp = False  # shrunk: bfloat16 autocast is slow on a CPU
amp_dtype = "bfloat16"
evaluate = True
find_unused_parameters = False
detect_anomaly = False
matmul_precision = "high"
deterministic = False
seed = 0
use_wandb = False  # shrunk: no W&B in tests
wandb_project = "Pretraining-Sonata-PILArNet-M"

grid_size = 0.001
warmup_ratio = 0.05

model = dict(
    type="Sonata-v1m1",
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("hilbert", "hilbert-trans", "z", "z-trans"),
        stride=(2, 2, 2),  # shrunk
        enc_depths=(1, 1, 1, 1),  # shrunk
        enc_channels=(8, 16, 24, 32),  # shrunk
        enc_num_head=(1, 2, 2, 4),  # shrunk
        enc_patch_size=(64, 64, 64, 64),  # shrunk
        mlp_ratio=4,
        qkv_bias=True,
        qk_scale=None,
        layer_scale=1e-5,
        attn_drop=0.0,
        proj_drop=0.0,
        drop_path=0.3,
        shuffle_orders=True,
        pre_norm=True,
        enable_rpe=False,
        enable_flash=True,
        upcast_attention=False,
        upcast_softmax=False,
        traceable=True,
        enc_mode=True,
        mask_token=True,
        cpe_first_layer_only=False,
        cpe_shared_weight=False,
    ),
    teacher_custom=dict(
        attn_drop=0.0,
        proj_drop=0.0,
        drop_path=0.0,
    ),
    head_in_channels=72,  # shrunk: 16 + 24 + 32
    head_hidden_channels=64,  # shrunk
    head_embed_channels=16,  # shrunk
    head_num_prototypes=32,  # shrunk
    num_global_view=2,
    num_local_view=6,
    mask_size_start=0.01,
    mask_size_base=0.075,
    mask_size_warmup_ratio=warmup_ratio,
    mask_ratio_start=0.5,
    mask_ratio_base=0.9,
    mask_ratio_warmup_ratio=warmup_ratio,
    mask_jitter=grid_size / 2,
    teacher_temp_start=0.04,
    teacher_temp_base=0.07,
    teacher_temp_warmup_ratio=warmup_ratio,
    student_temp=0.10,
    mask_loss_weight=2 / 8,
    roll_mask_loss_weight=2 / 8,
    unmask_loss_weight=4 / 8,
    momentum_base=0.994,
    momentum_final=1.0,
    match_max_r=2 * grid_size,
    up_cast_level=2,
)

epoch = 1  # shrunk
eval_epoch = 1  # added: upstream's trainer ignores the base's eval_epoch=800, pimm requires it to divide epoch
base_lr = 0.0026
lr_decay = 0.9

base_wd = 0.04
final_wd = 0.2

dec_depths = model["backbone"]["enc_depths"]
param_dicts = [
    dict(
        keyword=f"enc{e}.block{b}.",
        lr=base_lr * lr_decay ** (sum(dec_depths) - sum(dec_depths[:e]) - b - 1),
    )
    for e in range(len(dec_depths))
    for b in range(dec_depths[e])
]
del dec_depths

optimizer = dict(type="AdamW", lr=base_lr, weight_decay=base_wd)
scheduler = dict(
    type="OneCycleLR",
    max_lr=[base_lr] + [g["lr"] for g in param_dicts],
    pct_start=warmup_ratio,
    anneal_strategy="cos",
    div_factor=10.0,
    final_div_factor=1000.0,
)

transform = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="RandomScale", scale=[0.9, 1.1]),
    dict(type="GridSample", grid_size=grid_size, hash_type="fnv", mode="train", sum_keys=("energy",)),
    dict(type="LogTransform", min_val=0.01, max_val=20.0, log=True, keys=("energy",)),
    dict(type="Copy", keys_dict={"coord": "origin_coord"}),
    dict(
        type="MultiViewGenerator",
        view_keys=("coord", "origin_coord", "energy"),
        global_view_num=2,
        global_view_scale=(0.4, 1.0),
        local_view_num=6,
        local_view_scale=(0.1, 0.4),
        global_shared_transform=[
            dict(type="MultiplicativeRandomJitter", sigma=0.05, clip=0.05, keys=("energy"), p=0.8),
        ],
        global_transform=[
            dict(type="CenterShift", apply_z=False, axes=("x", "y", "z")),
            dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
            dict(type="RandomRotate", angle=[-1, 1], axis="x", center=[0, 0, 0], p=0.8),
            dict(type="RandomRotate", angle=[-1, 1], axis="y", center=[0, 0, 0], p=0.8),
            dict(type="RandomFlip", p=0.5, axes=("x", "y", "z")),
            dict(type="RandomJitter", sigma=grid_size / 4, clip=grid_size, keys=("coord",)),
        ],
        local_transform=[
            dict(type="CenterShift", apply_z=False, axes=("x", "y", "z")),
            dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
            dict(type="RandomRotate", angle=[-1, 1], axis="x", center=[0, 0, 0], p=0.8),
            dict(type="RandomRotate", angle=[-1, 1], axis="y", center=[0, 0, 0], p=0.8),
            dict(type="RandomFlip", p=0.5, axes=("x", "y", "z")),
            dict(type="RandomJitter", sigma=grid_size / 4, clip=grid_size, keys=("coord",)),
        ],
        max_size=30000,
    ),
    dict(type="ToTensor"),
    dict(type="Update", keys_dict={"grid_size": grid_size}),
    dict(
        type="Collect",
        keys=("global_origin_coord", "global_coord", "global_energy", "global_offset", "local_origin_coord",
              "local_coord", "local_energy", "local_offset", "grid_size", "name"),
        offset_keys_dict=dict(),
        global_feat_keys=("global_coord", "global_energy"),
        local_feat_keys=("local_coord", "local_energy"),
    ),
]

data = dict(
    num_classes=5,
    names=["shower", "track", "michel", "delta", "led"],
    train=dict(
        type="PILArNetH5Dataset",
        revision="v1",
        split="train",
        data_root=None,
        transform=transform,
        test_mode=False,
        energy_threshold=0.13,
        min_points=0,  # shrunk: the generated events are small
        max_len=1_000_000,
        remove_low_energy_scatters=False,
        loop=1,
    ),
    val=dict(
        type="PILArNetH5Dataset",
        revision="v1",
        split="val",
        data_root=None,
        transform=[
            dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
            dict(type="LogTransform", min_val=0.01, max_val=20.0, log=True, keys=("energy",)),
            dict(type="GridSample", grid_size=grid_size, hash_type="fnv", mode="train", return_grid_coord=True,
                 return_inverse=True),
            dict(type="Copy", keys_dict={"segment_motif": "segment"}),
            dict(type="ToTensor"),
            dict(type="Collect", keys=("coord", "grid_coord", "energy", "inverse", "segment"),
                 feat_keys=("coord", "energy")),
        ],
        test_mode=False,
        energy_threshold=0.13,
        min_points=0,  # shrunk
        max_len=10000,
        remove_low_energy_scatters=False,
        loop=1,
    ),
)

class_freqs = [1926651899, 2038240940, 34083197, 92015482, 1145363125]
class_weights = [sum(class_freqs) / f for f in class_freqs]

hooks = [
    dict(type="WandbNamer", keys=("model.type", "data.train.max_len", "amp_dtype", "seed"), sep="-"),
    dict(type="ParameterCounter", show_details=False, show_gradients=False, sort_by_params=True, min_params=1),
    dict(type="WeightDecayExclusion", exclude_bias_from_wd=True, exclude_norm_from_wd=True,
         exclude_gamma_from_wd=True, exclude_token_from_wd=True, exclude_ndim_1_from_wd=True),
    dict(type="CheckpointLoader"),
    dict(type="DtypeOverrider", class_patterns=["LayerNorm"], dtype="float32", override_parameters=True,
         methods_to_override=["forward"]),
    dict(type="ModelHook"),
    dict(type="WeightDecayScheduler", base_value=base_wd, final_value=final_wd, warmup_ratio=1.0),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter"),
    dict(type="CheckpointSaverIteration", save_freq=2),  # shrunk
    dict(type="GradientNormLogger", log_frequency=2, log_per_layer=False),  # shrunk
    dict(type="PretrainEvaluator", write_cls_iou=True, every_n_steps=4,  # shrunk
         max_train_events=3, max_test_events=3,  # shrunk
         train_config=dict(criteria=[dict(type="CrossEntropyLoss", weight=class_weights)])),
    dict(type="PrototypeUsageLogger", log_frequency=2, prefix="prototypes"),  # shrunk
    dict(type="FeatureStdMonitor", log_frequency=2, prefix="feature_std", monitor_student=True,
         monitor_teacher=True, track_channels=False),  # shrunk
    dict(type="ResourceUtilizationLogger", log_frequency=2, prefix="resources", log_per_gpu=True, log_cpu=True,
         log_system_memory=True),  # shrunk
]
'''

# Upstream's configs/panda/semseg/semseg-pt-v3m2-pilarnet-ft-5cls-lin.py with the same shrinking.
LIN = '''
_base_ = ["../../_base_/default_runtime.py"]

batch_size = 2  # shrunk
num_worker = 0  # shrunk
mix_prob = 0.0
clip_grad = None
empty_cache = False
enable_amp = False  # shrunk
amp_dtype = "bfloat16"
matmul_precision = "high"
seed = 0
evaluate = True
use_wandb = False  # shrunk
wandb_project = "PartSeg-Sonata-PILArNet-M"

class_freqs = [1926651899, 2038240940, 34083197, 92015482, 1145363125]
class_weights = [sum(class_freqs) / f for f in class_freqs]

model = dict(
    type="DefaultSegmentorV2",
    num_classes=5,
    backbone_out_channels=80,  # shrunk: 8 + 16 + 24 + 32
    backbone=dict(
        type="PT-v3m2",
        in_channels=4,
        order=("hilbert", "hilbert-trans", "z", "z-trans"),
        stride=(2, 2, 2),  # shrunk
        enc_depths=(1, 1, 1, 1),  # shrunk
        enc_channels=(8, 16, 24, 32),  # shrunk
        enc_num_head=(1, 2, 2, 4),  # shrunk
        enc_patch_size=(64, 64, 64, 64),  # shrunk
        dec_depths=(1, 1, 1),  # shrunk
        dec_channels=(8, 16, 24),  # shrunk
        dec_num_head=(1, 2, 2),  # shrunk
        dec_patch_size=(64, 64, 64),  # shrunk
        layer_scale=0.0,
        mlp_ratio=4,
        qkv_bias=True,
        qk_scale=None,
        attn_drop=0.0,
        proj_drop=0.0,
        drop_path=0.3,
        shuffle_orders=True,
        pre_norm=True,
        enable_rpe=False,
        enable_flash=True,
        upcast_attention=False,
        upcast_softmax=False,
        traceable=True,
        mask_token=False,
        enc_mode=True,
        freeze_encoder=False,
    ),
    criteria=[
        dict(type="CrossEntropyLoss", loss_weight=1.0, ignore_index=-1),
        # upstream also passes mode="multiclass", class_weights=None: pimm's LovaszLoss does not take them yet
        dict(type="LovaszLoss", loss_weight=1.0 / 20.0, ignore_index=-1),
    ],
    freeze_backbone=True,
)

epoch = 1  # shrunk
eval_epoch = 1  # shrunk
optimizer = dict(type="AdamW", lr=0.0015, weight_decay=0.01)
scheduler = dict(type="OneCycleLR", max_lr=[0.0015, 0.00015], pct_start=0.05, anneal_strategy="cos",
                 div_factor=10.0, final_div_factor=1000.0)
param_dicts = [dict(keyword="block", lr=0.00015)]
grid_size = 0.001
transform = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="LogTransform", min_val=1e-2, max_val=20.0, log=True),
    dict(type="GridSample", grid_size=0.001, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="CenterShift", apply_z=True),
    dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="x", center=[0, 0, 0], p=0.8),
    dict(type="RandomRotate", angle=[-1, 1], axis="y", center=[0, 0, 0], p=0.8),
    dict(type="RandomFlip", p=0.5),
    dict(type="RandomJitter", sigma=grid_size / 8, clip=grid_size),
    dict(type="Copy", keys_dict={"segment_motif": "segment"}),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "energy", "segment"), feat_keys=("coord", "energy")),
]
data = dict(
    num_classes=5,
    ignore_index=-1,
    names=["shower", "track", "michel", "delta", "led"],
    train=dict(type="PILArNetH5Dataset", revision="v1", split="train", data_root=None, transform=transform,
               test_mode=False, energy_threshold=0.0, min_points=0, max_len=1_000_000,
               remove_low_energy_scatters=False, loop=1),
    val=dict(type="PILArNetH5Dataset", revision="v1", split="val", data_root=None, transform=transform,
             test_mode=False, energy_threshold=0.13, min_points=0, max_len=1000, remove_low_energy_scatters=False,
             loop=1),
)

hooks = [
    dict(type="WandbNamer", keys=("model.type", "data.train.max_len", "amp_dtype", "seed"), extra="lin"),
    dict(type="DtypeOverrider", class_patterns=["LayerNorm"], dtype="float32", override_parameters=True,
         methods_to_override=["forward"]),
    dict(type="CheckpointLoader", keywords="module.student.backbone", replacement="module.backbone", strict=False),
    dict(type="GradientNormLogger", log_frequency=10),
    dict(type="IterationTimer", warmup_iter=2),
    dict(type="InformationWriter"),
    dict(type="SemSegEvaluator", every_n_steps=1000, write_cls_iou=True),
    dict(type="CheckpointSaver", save_freq=None, evaluator_every_n_steps=1000),
]
'''


@pytest.fixture(scope="module")
def upstream_tree(tmp_path_factory):
    """Upstream's config layout (configs/_base_, configs/panda/...) and exported PILArNet v1 files."""
    root = tmp_path_factory.mktemp("upstream")
    (root / "configs" / "_base_").mkdir(parents=True)
    for sub in ("pretrain", "semseg"):
        (root / "configs" / "panda" / sub).mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "support" / "upstream_style" / "_base_" / "default_runtime.py",
                root / "configs" / "_base_" / "default_runtime.py")
    (root / "configs" / "panda" / "pretrain" / "pretrain-sonata.py").write_text(PRETRAIN)
    (root / "configs" / "panda" / "semseg" / "ft-lin.py").write_text(LIN)
    data = root / "pilarnet"
    for split, events in (("train", 8), ("val", 6)):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(data),
                              "--num-events", str(events), "--seed", "5", "--split", split, "--revision", "v1",
                              "--events-per-file", "4"], capture_output=True, text=True, timeout=300, env=env())
        assert res.returncode == 0, res.stderr
    return root, data


def pretrain(root, data, save, *options, timeout=900):
    return run_tool("train", root / "configs" / "panda" / "pretrain" / "pretrain-sonata.py", f"save_path={save}",
                    f"data.train.data_root={data}", f"data.val.data_root={data}", *options, timeout=timeout)


def test_upstream_pretraining_then_linear_probe_loads_the_student(upstream_tree, tmp_path):
    root, data = upstream_tree
    save = tmp_path / "pretrain"
    res = pretrain(root, data, save)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    scalars = {k: v for r in records for k, v in r.items()}
    losses = [v for _, v in train_losses(save)]
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)  # 8 events, batch 2
    for key in ("train/mask_loss", "train/roll_mask_loss", "train/unmask_loss", "params/mask_size",
                "params/momentum", "params/teacher_temp", "params/wd", "grad_norm/total",
                "prototypes/student/mask_head/used_count", "prototypes/student/unmask_head/assignment_entropy",
                "feature_std/student/global_std", "feature_std/teacher/channel_min_std", "resources/cpu_percent",
                "val/mIoU", "val/mF1", "val/iou_track"):
        assert key in scalars, key
    steps = {r["step"]: r for r in records if "params/wd" in r}
    assert steps[1]["params/wd"] == pytest.approx(0.04) and steps[4]["params/wd"] > steps[2]["params/wd"]
    assert 0 < scalars["prototypes/student/mask_head/used_count"] <= 32
    log = (save / "train.log").read_text()
    assert "WeightDecayExclusion: 10 optimizer groups" in log  # (1 default + 4 blocks) x (decay, no decay)
    assert "DtypeOverrider:" in log and "ParameterCounter:" in log
    resolved = (save / "config.py").read_text() if (save / "config.py").exists() else ""
    assert "Sonata-v1m1-1M-bfloat16-0" in resolved or "Sonata-v1m1-1M-bfloat16-0" in log
    assert sorted(p.name for p in (save / "model").glob("*")) and any((save / "model").iterdir())

    state = final_weights(save)["state_dict"]
    student = {k[len("student.backbone."):]: v for k, v in state.items() if k.startswith("student.backbone.")}
    teacher = {k[len("teacher.backbone."):]: v for k, v in state.items() if k.startswith("teacher.backbone.")}
    assert student and student.keys() == teacher.keys()
    assert any(not torch.equal(student[k], teacher[k]) for k in student)  # the teacher is an EMA, not a copy

    # Upstream's lin config starting from this run: the student backbone is the frozen encoder.
    lin = tmp_path / "lin"
    upstream_file = tmp_path / "sonata-upstream-format.pth"
    torch.save({"state_dict": {"module." + k: v for k, v in state.items()}}, upstream_file)
    for weight, name in ((save / "model" / "model_last.pth", "lin"), (upstream_file, "lin-upstream")):
        run = tmp_path / name
        res = run_tool("train", root / "configs" / "panda" / "semseg" / "ft-lin.py", f"save_path={run}",
                       f"data.train.data_root={data}", f"data.val.data_root={data}", f"weight={weight}", timeout=900)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        log = (run / "train.log").read_text()
        assert f"Loaded {len(student) - 1}/" in log or f"Loaded {len(student)}/" in log, log[-3000:]
        tuned = final_weights(run)["state_dict"]
        backbone = {k[len("backbone."):]: v for k, v in tuned.items() if k.startswith("backbone.")}
        shared = [k for k in backbone if k in student]
        assert len(shared) >= len(student) - 1  # all but the mask token, which the fine-tune model lacks
        for key in shared:
            assert torch.equal(backbone[key], student[key]), key
    lin = tmp_path / "lin"
    assert "val/mIoU" in {k for line in open(lin / "metrics.jsonl") for k in json.loads(line)}


def test_pretraining_resumes_exactly_after_kill(upstream_tree, tmp_path):
    """Teacher, schedules and the views' random crops continue bit for bit."""
    root, data = upstream_tree
    fast = ("hooks.PretrainEvaluator.every_n_steps=0", "evaluate=False")
    reference = tmp_path / "ref"
    assert pretrain(root, data, reference, *fast).returncode == 0
    crashed = tmp_path / "crashed"
    cfg_dir = root / "configs" / "panda" / "pretrain"
    killer = cfg_dir / "pretrain-sonata-kill.py"
    killer.write_text(PRETRAIN + 'custom_imports = ["tests.support.toy"]\n'
                      'hooks = hooks + [dict(type="KillAtStep", step=3, wait_for_commit=True)]\n')
    common = (f"save_path={crashed}", f"data.train.data_root={data}", f"data.val.data_root={data}", *fast)
    assert run_tool("train", killer, *common, timeout=900).returncode == -9
    res = run_tool("train", killer, *common, "resume=True", "hooks.KillAtStep.step=-1", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    ref, got = final_weights(reference)["state_dict"], final_weights(crashed)["state_dict"]
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    assert train_losses(reference) == train_losses(crashed)
    ref_records = [json.loads(line) for line in open(reference / "metrics.jsonl")]
    got_records = [json.loads(line) for line in open(crashed / "metrics.jsonl")]
    sched = ("params/mask_size", "params/momentum", "params/teacher_temp", "params/wd")
    assert [{k: r[k] for k in sched if k in r} for r in ref_records if "params/momentum" in r] == \
        [{k: r[k] for k in sched if k in r} for r in got_records if "params/momentum" in r]
