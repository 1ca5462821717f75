"""PT-v3 through tools/train.py: upstream's tiny semseg config as written
(only ``data_root`` points at files from tools/export_pilarnet.py), a strict
warm start from an upstream-style file renamed by
``CheckpointLoader(keywords=..., replacement=...)``, and exact kill/resume."""

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

# Upstream pimm's configs/tests/tiny_semseg.py, as upstream wrote it (the copy
# tests/test_upstream_semseg_configs.py also trains); its _base_ is upstream's
# default runtime, kept in tests/support/upstream_style/_base_.
UPSTREAM_TINY_SEMSEG = (ROOT / "tests" / "support" / "upstream_configs" / "tests" / "tiny_semseg.py").read_text()


@pytest.fixture(scope="module")
def upstream_tree(tmp_path_factory):
    """Upstream's config tree (configs/_base_, configs/tests) and exported PILArNet files."""
    root = tmp_path_factory.mktemp("upstream")
    (root / "configs" / "_base_").mkdir(parents=True)
    (root / "configs" / "tests").mkdir()
    shutil.copy(ROOT / "tests" / "support" / "upstream_style" / "_base_" / "default_runtime.py",
                root / "configs" / "_base_" / "default_runtime.py")
    (root / "configs" / "tests" / "tiny_semseg.py").write_text(UPSTREAM_TINY_SEMSEG)
    data = root / "pilarnet"
    for split, events in (("train", 8), ("val", 4)):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(data),
                              "--num-events", str(events), "--seed", "3", "--split", split,
                              "--events-per-file", "4"], capture_output=True, text=True, timeout=300, env=env())
        assert res.returncode == 0, res.stderr
    return root, data


def test_upstream_tiny_semseg_trains_one_epoch_and_warm_starts_strictly(upstream_tree, tmp_path):
    root, data = upstream_tree
    config = root / "configs" / "tests" / "tiny_semseg.py"
    save = tmp_path / "run"
    res = run_tool("train", config, f"save_path={save}", f"data.train.data_root={data}",
                   f"data.val.data_root={data}", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)  # 8 events, batch 4
    val = next(r for r in records if "val/mIoU" in r)
    assert 0.0 <= val["val/mIoU"] <= 1.0
    assert {f"val/iou_{n}" for n in ("shower", "track", "michel", "delta", "led")} <= set(val)
    state = final_weights(save)["state_dict"]
    assert state["backbone.enc.enc0.block0.cpe.0.weight"].shape == (8, 3, 3, 3, 8)  # spconv's layout

    # The same weights as an upstream fine-tuning file would hold them (DDP
    # prefix, backbone under student.), loaded strictly through the hook's renaming.
    upstream = {("module.student." + k if k.startswith("backbone.") else "module." + k): v for k, v in state.items()}
    torch.save({"epoch": 1, "state_dict": upstream}, tmp_path / "upstream.pth")
    warm = tmp_path / "warm"
    res = run_tool("train", config, f"save_path={warm}", f"data.train.data_root={data}",
                   f"data.val.data_root={data}", f"weight={tmp_path / 'upstream.pth'}",
                   "hooks.CheckpointLoader.keywords=module.student.backbone",
                   "hooks.CheckpointLoader.replacement=module.backbone", "hooks.CheckpointLoader.strict=True",
                   "evaluate=False", timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    log = (warm / "train.log").read_text()
    assert f"Loaded {len(state)}/{len(state)} model tensors" in log
    # strict: a tensor the model has no place for stops the run with one line
    upstream["module.student.head.weight"] = torch.zeros(2)
    torch.save({"state_dict": upstream}, tmp_path / "extra.pth")
    res = run_tool("train", config, f"save_path={tmp_path / 'extra'}", f"data.train.data_root={data}",
                   f"data.val.data_root={data}", f"weight={tmp_path / 'extra.pth'}",
                   "hooks.CheckpointLoader.keywords=module.student.backbone",
                   "hooks.CheckpointLoader.replacement=module.backbone", "hooks.CheckpointLoader.strict=True",
                   timeout=900)
    assert res.returncode == 2 and "not in the model: student.head.weight" in res.stderr, res.stderr[-2000:]


PTV3_SEMSEG = f"""
_base_ = {str(ROOT / "configs" / "_base_" / "default_runtime.py")!r}
epoch = 2
batch_size = 2
_t = [dict(type="RandomRotate", angle=(-1, 1), axis="z"), dict(type="GridSample", grid_size=1.0,
      return_grid_coord=True), dict(type="LogTransform", key="energy"), dict(type="ToTensor"),
      dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("energy",))]
_gen = dict(type="LArTPCSynthDataset", transform=_t, points_per_event=(150, 300))
data = dict(train=dict(_gen, num_events=6, split="train"), val=dict(_gen, num_events=4, split="val"))
model = dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8,
             backbone=dict(type="PT-v3m2", in_channels=1, order=("z", "hilbert"), stride=(2,), enc_depths=(2, 1),
                           enc_channels=(8, 16), enc_num_head=(2, 2), enc_patch_size=(16, 16), dec_depths=(1,),
                           dec_channels=(8,), dec_num_head=(2,), dec_patch_size=(16,), mlp_ratio=2, drop_path=0.2,
                           attn_drop=0.1, shuffle_orders=True))
optimizer = dict(type="AdamW", lr=0.002)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.2)
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=2),
         dict(type="SemSegEvaluator", num_classes=5), dict(type="CheckpointSaver", save_freq=2)]
"""


def test_ptv3_kill_and_resume_is_exact(tmp_path):
    """Order shuffling, drop path and attention dropout draw from the RNG
    streams the checkpoint restores: the resumed run ends bit-identical."""
    from tests.test_lartpc_trainers import _assert_kill_and_resume_is_exact

    _assert_kill_and_resume_is_exact(tmp_path, PTV3_SEMSEG, steps=6)
