"""DefaultDataset (Pointcept's folder-per-scene ``.npy`` layout) and ConcatDataset:
what they read, bad layouts as one line, and exact mid-epoch resume through
``tools/train.py``."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pimm.datasets.concat import ConcatDataset
from pimm.datasets.default_dataset import DefaultDataset
from pimm.engines.registries import DATASETS
from pimm.utils.errors import ConfigError, UserError
from tests.support.run import ROOT, final_weights, run_tool, train_losses


def _scene(folder, n, seed, labels=True, color=True):
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True)
    np.save(folder / "coord.npy", rng.uniform(0, 10, (n, 3)))  # float64 on disk: read back as float32
    if color:
        np.save(folder / "color.npy", rng.uniform(0, 255, (n, 3)))
    if labels:
        np.save(folder / "segment.npy", rng.integers(0, 3, (n, 1)))
        np.save(folder / "instance.npy", rng.integers(0, 5, n))
    np.save(folder / "extra_not_an_asset.npy", np.zeros(2))
    (folder / "readme.txt").write_text("ignored")


@pytest.fixture
def root(tmp_path):
    for i, name in enumerate(["b_scene", "a_scene", "c_scene"]):
        _scene(tmp_path / "train" / name, 20 + i, i)
    _scene(tmp_path / "val" / "v0", 15, 9, labels=False, color=False)
    (tmp_path / "val.json").write_text(json.dumps(["train/a_scene", "val/v0"]))
    return tmp_path


def test_reads_every_asset_with_upstreams_types_and_fills_missing_labels(root):
    ds = DATASETS.build(dict(type="DefaultDataset", split="train", data_root=str(root), loop=2))
    assert len(ds) == 6
    assert [ds.get_data_name(i) for i in range(3)] == ["a_scene", "b_scene", "c_scene"]  # sorted, every machine
    item = ds[4]  # loop: index 4 is scene 1
    assert item["name"] == "b_scene" and item["split"] == "train"
    assert set(item) == {"coord", "color", "segment", "instance", "name", "split"}
    assert item["coord"].dtype == np.float32 and item["color"].dtype == np.float32 and item["coord"].shape == (20, 3)
    assert item["segment"].shape == (20,) and item["segment"].dtype == np.int32
    assert np.array_equal(item["segment"], np.load(root / "train" / "b_scene" / "segment.npy").reshape(-1))
    unlabelled = DefaultDataset(split="val", data_root=str(root))[0]
    assert np.all(unlabelled["segment"] == -1) and np.all(unlabelled["instance"] == -1)
    assert "color" not in unlabelled
    both = DefaultDataset(split=["train", "val"], data_root=str(root))
    assert len(both) == 4 and both[3]["split"] == "val"
    listed = DefaultDataset(split="val.json", data_root=str(root))
    assert [listed.get_data_name(i) for i in range(2)] == ["a_scene", "v0"]

    class CoordOnly(DefaultDataset):  # upstream's subclasses narrow or widen the assets this way
        VALID_ASSETS = ("coord", "segment")

    assert set(CoordOnly(split="train", data_root=str(root))[0]) == {"coord", "segment", "instance", "name", "split"}


def test_transform_is_applied_and_the_point_collate_batches_scenes(root):
    ds = DefaultDataset(split="train", data_root=str(root), transform=[
        dict(type="ToTensor"), dict(type="Collect", keys=("coord", "segment"), feat_keys=("color",))])
    batch = ds.collate_fn([ds[0], ds[1]])
    assert batch["coord"].shape == (41, 3) and batch["feat"].shape == (41, 3)
    assert batch["offset"].tolist() == [21, 41]


def test_bad_layouts_are_one_line_naming_the_path(root):
    def message(**kwargs):
        with pytest.raises(UserError) as info:
            DefaultDataset(data_root=str(root), **kwargs)[0]
        assert "\n" not in str(info.value)
        return str(info.value)

    assert "split 'test' is neither a folder nor a JSON file" in message(split="test")
    assert "train, val, val.json" in message(split="test")
    (root / "empty").mkdir()
    assert "empty holds no scene folders" in message(split="empty")
    (root / "train" / "a_scene" / "coord.npy").unlink()
    assert "a_scene has no coord.npy" in message(split="train")
    np.save(root / "train" / "a_scene" / "coord.npy", np.zeros((22, 3)))  # a_scene has 21 points
    assert "a_scene/color.npy has 21 rows but coord.npy has 22" in message(split="train")
    np.save(root / "train" / "a_scene" / "coord.npy", np.zeros((21, 2)))
    assert "coord.npy has shape (21, 2); it must be (N, 3)" in message(split="train")
    (root / "bad.json").write_text(json.dumps(["train/nope"]))
    assert "bad.json lists 1 scene folder(s) that do not exist" in message(split="bad.json")
    with pytest.raises(UserError, match="is not a folder"):
        DefaultDataset(data_root=str(root / "missing"))
    with pytest.raises(ConfigError, match="cache=True"):
        DefaultDataset(data_root=str(root), cache=True)


def test_concat_lays_children_end_to_end_with_loop(root):
    ds = DATASETS.build(dict(type="ConcatDataset", loop=2, datasets=[
        dict(type="DefaultDataset", split="train", data_root=str(root)),
        dict(type="DefaultDataset", split="val", data_root=str(root))]))
    assert len(ds) == 8 and ds.collate_fn is DefaultDataset.collate_fn
    assert [ds[i]["name"] for i in range(8)] == ["a_scene", "b_scene", "c_scene", "v0"] * 2
    assert ds.get_data_name(7) == "v0" and ds.locate(5) == (0, 1)
    with pytest.raises(IndexError):
        ds[8]
    with pytest.raises(ConfigError, match="non-empty list"):
        ConcatDataset([])


TRAIN = """
_base_ = {base!r}
save_path = {save!r}
epoch = 2
batch_size = 2
num_worker = {workers}
_t = [dict(type="RandomRotate", angle=(-1, 1), axis="z"), dict(type="RandomJitter", sigma=0.01, clip=0.05),
      dict(type="ToTensor"), dict(type="Collect", keys=("coord", "segment"), feat_keys=("color",))]
_scenes = dict(type="DefaultDataset", data_root={root!r}, transform=_t)
data = dict(train=dict(type="ConcatDataset", datasets=[dict(_scenes, split="train"), dict(_scenes, split="more")]),
            val=dict(_scenes, split="train"))
model = dict(type="DefaultSegmentor", num_classes=3,
             backbone=dict(type="SparseUNet", in_channels=3, channels=(4, 8), enc_blocks=(1, 1), dec_blocks=(1,)))
optimizer = dict(type="AdamW", lr=0.01)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.2)
default_hooks = dict(checkpoint=dict(save_freq=2))
hooks = [dict(type="SemSegEvaluator", num_classes=3)]
"""


def _train_config(tmp_path, root, save, workers, extra=""):
    path = tmp_path / f"cfg_{save.name}.py"
    path.write_text(TRAIN.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"), save=str(save),
                                 root=str(root), workers=workers) + extra)
    return path


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_concat_of_default_datasets_resumes_mid_epoch_bit_identically(tmp_path, root, workers):
    for i in range(3):
        _scene(root / "more" / f"m{i}", 25, 20 + i)
    reference = tmp_path / "ref"  # 6 scenes in batches of 2: 3 steps per epoch, 6 in all
    done = run_tool("train", _train_config(tmp_path, root, reference, workers))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s for s, _ in train_losses(reference)] == list(range(1, 7))
    crashed = tmp_path / "crashed"
    cfg = _train_config(tmp_path, root, crashed, workers, 'custom_imports = ["tests.support.toy"]\n'
                        'hooks = hooks + [dict(type="KillAtStep", step=5, wait_for_commit=True)]\n')
    assert run_tool("train", cfg).returncode == -9  # after step 4's checkpoint: mid-epoch 2
    resumed = run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from step000000004" in (crashed / "train.log").read_text()
    want, got = final_weights(reference), final_weights(crashed)
    assert all(torch.equal(want["state_dict"][k], got["state_dict"][k]) for k in want["state_dict"])
    assert train_losses(reference) == train_losses(crashed)


def test_test_mode_gives_fragments_scored_on_every_point(root):
    """upstream's test_mode/test_cfg: each item is one scene's fragments plus its
    full-resolution points (pimm.datasets.fragments)."""
    grid = dict(type="GridSample", grid_size=0.5, hash_type="ravel", mode="test")
    pack = [dict(type="ToTensor"), dict(type="Collect", keys=("coord", "index"), feat_keys=("coord",))]
    ds = DefaultDataset(data_root=str(root), split="train", test_mode=True, loop=3,
                        test_cfg=dict(voxelize=grid, post_transform=pack))
    assert len(ds) == len(DefaultDataset(data_root=str(root), split="train"))  # loop is 1 in test mode
    item = ds[0]
    plain = DefaultDataset(data_root=str(root), split="train")[0]
    assert item["fragment_list"] and len(item["origin_coord"]) == len(plain["coord"])
    covered = np.concatenate([np.asarray(f["index"]) for f in item["fragment_list"]])
    assert sorted(set(covered.tolist())) == list(range(len(plain["coord"])))  # every point in some fragment
    with pytest.raises(ConfigError, match="voxelise"):
        DefaultDataset(data_root=str(root), test_mode=True, test_cfg=dict(voxelise=grid))
