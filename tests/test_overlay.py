"""Event overlay of PILArNetH5Dataset (upstream's ``overlay_*`` options): the
same events as upstream's code for the same draws, options checked, voxel
merging by semantic priority, and exact mid-epoch resume of overlaid training."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pimm.datasets.overlay import EventOverlay, deduplicate_voxels
from pimm.datasets.pilarnet import PILArNetH5Dataset
from pimm.utils.errors import ConfigError
from tests.support.run import ROOT, final_weights, run_tool, train_losses

FIXTURES = Path(__file__).parent / "fixtures" / "overlay"
sys.path.insert(0, str(FIXTURES))
import make_reference  # noqa: E402  (the reference's events and digest, rebuilt bit for bit)


@pytest.fixture(scope="module")
def events(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pilarnet")
    make_reference.make_events(str(folder))
    return folder


def test_overlay_equals_upstreams_for_the_same_draws(events):
    records = json.loads((FIXTURES / "upstream_overlay.json").read_text())
    assert len(records) == 48 and any("overlay" in r["name"] for r in records)
    assert any("overlay" not in r["name"] for r in records)  # overlay_prob < 1 left some alone
    for r in records:
        n = tuple(r["n_events"]) if isinstance(r["n_events"], list) else r["n_events"]
        ds = PILArNetH5Dataset(str(events), min_points=0, overlay_n_events=n, overlay_prob=r["prob"],
                               overlay_allow_repeats=r["allow_repeats"])
        random.seed(r["seed"])
        out = ds[r["index"]]
        assert (out["name"], len(out["coord"])) == (r["name"], r["points"]), r
        assert {k: make_reference.digest(out[k]) for k in r["digests"]} == r["digests"], r


def test_overlaid_event_keeps_every_point_key_aligned_and_instances_distinct(events):
    base = PILArNetH5Dataset(str(events), min_points=0)
    ds = PILArNetH5Dataset(str(events), min_points=0, overlay_n_events=3, overlay_allow_repeats=False)
    random.seed(3)
    out = ds[2]
    n = len(out["coord"])
    assert n > len(base[2]["coord"]) and out["name"].endswith("_overlay3")
    assert all(len(out[k]) == n for k in ("energy", "segment", "instance", "interaction", "instance_particle"))
    voxels = np.round(out["coord"]).astype(np.int64)
    assert len(np.unique(voxels, axis=0)) == n  # no two points share a voxel
    first = base[2]
    assert np.array_equal(out["coord"][: len(first["coord"])][:10], first["coord"][:10])
    assert out["instance_particle"].max() > first["instance_particle"].max()


def test_disabled_overlay_draws_nothing_and_options_are_checked(events):
    plain = PILArNetH5Dataset(str(events), min_points=0, overlay_n_events=(1, 1))
    state = random.getstate()
    plain[0]
    assert random.getstate() == state
    for bad in (dict(overlay_n_events=0), dict(overlay_n_events=(3, 2)), dict(overlay_n_events=(1, 2, 3)),
                dict(overlay_prob=1.5), dict(overlay_n_events=2.5)):
        with pytest.raises(ConfigError, match="overlay_"):
            PILArNetH5Dataset(str(events), min_points=0, **bad)
    assert not EventOverlay(1).enabled and EventOverlay((1, 2)).enabled


def test_points_sharing_a_voxel_keep_the_highest_priority_class():
    data = dict(coord=np.array([[0, 0, 0], [0.2, 0, 0], [5, 5, 5], [0, 0.1, 0], [5, 5, 5.3]], np.float32),
                segment_motif=np.array([0, 1, 4, 1, 3]), energy=np.arange(5.0)[:, None])
    out = deduplicate_voxels(data, ["coord", "segment_motif", "energy"])
    # voxel (0,0,0): shower, track, track -> the first track; voxel (5,5,5): low energy vs delta -> delta
    assert out["energy"][:, 0].tolist() == [1.0, 4.0] and out["segment_motif"].tolist() == [1, 3]


TRAIN = """
_base_ = {base!r}
save_path = {save!r}
epoch = 2
batch_size = 2
num_worker = {workers}
_t = [dict(type="RandomRotate", angle=(-1, 1), axis="z"), dict(type="LogTransform", key="energy"),
      dict(type="ToTensor"), dict(type="Collect", keys=("coord", "segment"), feat_keys=("energy",))]
_events = dict(type="PILArNetH5Dataset", data_root={root!r}, min_points=0, transform=_t)
data = dict(train=dict(_events, overlay_n_events=(1, 3), overlay_prob=0.8), val=dict(_events, max_len=2))
model = dict(type="DefaultSegmentor", num_classes=5,
             backbone=dict(type="SparseUNet", in_channels=1, channels=(4, 8), enc_blocks=(1, 1), dec_blocks=(1,)))
optimizer = dict(type="AdamW", lr=0.01)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.2)
default_hooks = dict(checkpoint=dict(save_freq=4))
hooks = [dict(type="SemSegEvaluator", num_classes=5)]
"""


def _config(tmp_path, events, save, workers, extra=""):
    path = tmp_path / f"cfg_{save.name}.py"
    path.write_text(TRAIN.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"), save=str(save),
                                 root=str(events), workers=workers) + extra)
    return path


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_overlaid_training_resumes_mid_epoch_bit_identically(tmp_path, events, workers):
    reference = tmp_path / "ref"  # 12 events in batches of 2: 6 steps per epoch, 12 in all
    done = run_tool("train", _config(tmp_path, events, reference, workers))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s for s, _ in train_losses(reference)] == list(range(1, 13))
    crashed = tmp_path / "crashed"
    cfg = _config(tmp_path, events, crashed, workers, 'custom_imports = ["tests.support.toy"]\n'
                  'hooks = hooks + [dict(type="KillAtStep", step=6, wait_for_commit=True)]\n')
    assert run_tool("train", cfg).returncode == -9  # after step 4's checkpoint: mid-epoch 1
    resumed = run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from step000000004" in (crashed / "train.log").read_text()
    want, got = final_weights(reference), final_weights(crashed)
    assert all(torch.equal(want["state_dict"][k], got["state_dict"][k]) for k in want["state_dict"])
    assert train_losses(reference) == train_losses(crashed)
