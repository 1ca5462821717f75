"""Hardening round 6, data: readers check what they read, and upstream's
plain-Dataset example trains.

* LUCiD: offsets that decrease or run past their arrays are one line naming
  the file and the key (events read other events' hits silently before); a bad
  sensor index is named as it is (the minimum, when the minimum is wrong); a
  training and a held-out set that would share events are refused;
  ``tools/make_lucid.py`` refuses a ``--dataset-name`` that leaves its folder
  and never writes a shard twice.
* PILArNet (HDF5 and parquet), LUCiD and ``DefaultDataset``: NaN / inf
  coordinates and energies and labels out of range are one line naming the
  file, the event and the key when the event is read; an empty PILArNet event
  is a well-defined empty event.
* A plain ``torch.utils.data.Dataset`` of point events (upstream's
  ``add_dataset.md``) trains with no collate named: upstream's trainer
  concatenates point events, torch's default collate cannot stack them.
"""

from __future__ import annotations

import gc
import importlib.util
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from pimm.datasets.default_dataset import DefaultDataset
from pimm.datasets.lucid import LUCiDDataset
from pimm.datasets.lucid_generator import generate_lucid
from pimm.datasets.lucid_ssl import LUCiDEventSSLDataset
from pimm.datasets.pilarnet import PILArNetH5Dataset, decode_event, write_pilarnet_h5
from pimm.engines.registries import COLLATE_FNS, DATASETS
from pimm.utils.errors import ConfigError, UserError

ROOT = Path(__file__).resolve().parents[1]


def one_line(call, error=UserError) -> str:
    with pytest.raises(error) as info:
        call()
    text = str(info.value)
    assert "\n" not in text, text
    return text


# ---------------------------------------------------------------- LUCiD


@pytest.fixture(scope="module")
def lucid(tmp_path_factory):
    """Two species of 12 events in shards of 6 (small PMT grid)."""
    root = tmp_path_factory.mktemp("lucid")
    for species in ("electron", "muon"):
        generate_lucid(root / species, 12, species, events_per_file=6, image_size=(8, 16))
    return root


def _copy(lucid, tmp_path, species="muon") -> Path:
    import shutil

    target = tmp_path / species
    shutil.copytree(lucid / species, target)
    return target


def _edit(path, key, change):
    with h5py.File(path, "a") as f:
        values = f[key][:]
        change(values)
        del f[key]
        f[key] = values


def test_lucid_hit_offsets_that_decrease_are_one_line_naming_file_and_key(lucid, tmp_path):
    root = _copy(lucid, tmp_path)
    shard = root / "sensor" / "wc_sensor_0001.h5"
    before = LUCiDDataset(root)[7]["energy"].copy()

    def swap(offsets):
        offsets[2], offsets[3] = offsets[3], offsets[2]  # event 2 ends before it starts

    _edit(shard, "event_hit_offsets", swap)
    text = one_line(lambda: LUCiDDataset(root))
    assert str(shard) in text and "event_hit_offsets decreases at entry" in text and "event" in text
    assert before.size  # the unchanged set read fine


def test_lucid_offsets_past_the_end_are_one_line_naming_the_arrays(lucid, tmp_path):
    root = _copy(lucid, tmp_path)
    shard = root / "sensor" / "wc_sensor_0000.h5"
    _edit(shard, "event_hit_offsets", lambda o: o.__setitem__(-1, o[-1] + 50))
    text = one_line(lambda: LUCiDDataset(root))
    assert str(shard) in text and "event_hit_offsets runs to" in text and "event_hit_sensor_idx has" in text
    seg = root / "seg" / "wc_seg_0001.h5"
    _edit(shard, "event_hit_offsets", lambda o: o.__setitem__(-1, o[-1] - 50))  # repaired
    _edit(seg, "segment_offset", lambda o: o.__setitem__(slice(3, None), o[3:] + 1000))
    text = one_line(lambda: LUCiDDataset(root, modalities=("seg",)))
    assert str(seg) in text and "segment_offset runs to" in text


def test_lucid_particle_offsets_are_checked_too(lucid, tmp_path):
    root = _copy(lucid, tmp_path)
    shard = root / "sensor" / "wc_sensor_0000.h5"
    _edit(shard, "particle_event_offset", lambda o: o.__setitem__(slice(2, 4), o[2:4][::-1]))
    text = one_line(lambda: LUCiDDataset(root, output_mode="labels"))
    assert str(shard) in text and "particle_event_offset decreases" in text


def test_lucid_bad_sensor_message_names_the_bad_index(lucid, tmp_path):
    root = _copy(lucid, tmp_path)
    shard = root / "sensor" / "wc_sensor_0000.h5"
    with h5py.File(shard, "r") as f:
        first = int(f["event_hit_offsets"][1])
    _edit(shard, "event_hit_sensor_idx", lambda s: s.__setitem__(first, -3))  # event 1's first hit
    dataset = LUCiDDataset(root)
    text = one_line(lambda: dataset[1])
    assert f"{shard}, event 1" in text and "sensor -3" in text and "0..127" in text


def test_lucid_nan_charges_and_segment_positions_name_file_event_and_key(lucid, tmp_path):
    root = _copy(lucid, tmp_path)
    shard = root / "sensor" / "wc_sensor_0001.h5"
    with h5py.File(shard, "r") as f:
        first = int(f["event_hit_offsets"][4])
    _edit(shard, "event_hit_PE", lambda v: v.__setitem__(first + 1, np.nan))
    dataset = LUCiDDataset(root)
    dataset[9]  # another event of the shard reads fine
    text = one_line(lambda: dataset[10])
    assert f"{shard}, event 4: event_hit_PE holds nan at row 1" in text
    ssl = LUCiDEventSSLDataset(tmp_path, ["muon"], split="all")
    assert "event_hit_PE" in one_line(lambda: ssl[10])
    seg = root / "seg" / "wc_seg_0000.h5"
    _edit(seg, "end_z", lambda v: v.__setitem__(0, np.inf))
    text = one_line(lambda: LUCiDDataset(root, modalities=("seg",))[0])
    assert f"{seg}, event 0: end_z holds inf at row 0" in text


def test_lucid_train_and_val_that_would_share_events_are_refused(lucid):
    common = dict(data_root=str(lucid), configs=["electron", "muon"], holdout_strategy="head")
    train = LUCiDEventSSLDataset(split="train", holdout_events_per_config=5, **common)
    text = one_line(lambda: LUCiDEventSSLDataset(split="val", holdout_events_per_config=8, **common), ConfigError)
    assert "split 'val' (holdout_events_per_config=8" in text and "split 'train' (holdout_events_per_config=5" in text
    assert "share 6 event(s)" in text  # events 5, 6, 7 of each config
    val = LUCiDEventSSLDataset(split="val", holdout_events_per_config=5, **common)  # the same holdout: disjoint
    assert len(train) + len(val) == 24
    # built the other way round, and with a fraction: the same refusal
    del train, val
    gc.collect()  # the refused build's traceback held the training set in a cycle
    val = LUCiDEventSSLDataset(split="val", holdout_fraction=0.5, holdout_events_per_config=None, **common)
    assert "holdout_fraction=0.5" in one_line(lambda: LUCiDEventSSLDataset(
        split="train", holdout_events_per_config=2, **common), ConfigError)
    del val
    gc.collect()
    LUCiDEventSSLDataset(split="train", holdout_events_per_config=2, **common)  # nothing held out is alive


def _make_lucid_tool():
    spec = importlib.util.spec_from_file_location("make_lucid_tool", ROOT / "tools" / "make_lucid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_lucid_refuses_a_dataset_name_that_leaves_its_folder(tmp_path, capsys):
    tool = _make_lucid_tool()
    out = tmp_path / "a" / "b"
    args = ["--out", str(out), "--num-events", "2", "--image-size", "4", "8"]
    assert tool.main(args + ["--dataset-name", "wc-v2.1"]) == 0
    written = {p: p.read_bytes() for p in tmp_path.rglob("*.h5")}
    # (no "error:" line; log lines may reach stderr when an earlier in-process test set up pimm's logger)
    assert len(written) == 4 and "error:" not in capsys.readouterr().err
    for species in ("electron", "muon"):
        assert len(LUCiDDataset(out / species, dataset_name="wc-v2.1")) == 2
    # "../../evil": both species' shards were out/evil_*_0000.h5, the second over the first
    for name in ("../../evil", "x/y", "..", ""):
        assert tool.main(args + ["--dataset-name", name, "--overwrite"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and err[0].startswith("error: --dataset-name")
    assert tool.main(args + ["--species", "muon", "muon", "--overwrite"]) == 2
    assert "'muon' twice" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*.h5")} == written  # nothing written or replaced
    with pytest.raises(UserError, match="not a plain file-name prefix"):
        generate_lucid(tmp_path / "lib", 1, "muon", dataset_name="../up")


# ---------------------------------------------------------------- PILArNet


def _events(n=3, points=30, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        instance = np.repeat(np.arange(3), points // 3)
        out.append(dict(coord=rng.uniform(0, 700, size=(points, 3)).astype(np.float32),
                        energy=rng.uniform(0.1, 5, size=(points, 1)).astype(np.float32),
                        segment=np.repeat(np.array([0, 1, 2]), points // 3), instance=instance,
                        interaction=np.zeros(points, np.int64)))
    return out


def _h5(tmp_path, events, revision="v2") -> Path:
    path = tmp_path / "events.h5"
    write_pilarnet_h5(events, path, revision=revision)
    return path


def _edit_point(path, event, column, row, value):
    with h5py.File(path, "a") as f:
        point = np.asarray(f["point"][event]).reshape(-1, 8)
        point[row, column] = value
        f["point"][event] = point.ravel()


@pytest.mark.parametrize("column,value,key", [(1, np.nan, "'coord'"), (2, -np.inf, "'coord'"),
                                              (3, np.nan, "'energy'")])
def test_pilarnet_non_finite_values_name_file_event_and_key(tmp_path, column, value, key):
    path = _h5(tmp_path, _events())
    _edit_point(path, 1, column, 4, value)
    dataset = PILArNetH5Dataset(path, min_points=0)
    dataset[0], dataset[2]  # the other events read fine
    text = one_line(lambda: dataset[1])
    assert text.startswith(f"{path}, event 1, key {key}") and "at row 4" in text


def test_pilarnet_a_nan_energy_is_refused_even_under_an_energy_threshold(tmp_path):
    path = _h5(tmp_path, _events())
    _edit_point(path, 0, 3, 0, np.nan)
    dataset = PILArNetH5Dataset(path, min_points=0, energy_threshold=0.5)  # NaN > 0.5 is False: dropped silently
    assert "key 'energy'" in one_line(lambda: dataset[0])


def test_pilarnet_labels_outside_the_classes_are_refused_and_the_ignore_index_kept(tmp_path):
    events = _events()
    events[2]["segment"] = events[2]["segment"].copy()
    events[2]["segment"][:10] = 7
    path = _h5(tmp_path, events)
    dataset = PILArNetH5Dataset(path, min_points=0)
    text = one_line(lambda: dataset[2])
    assert text.startswith(f"{path}, event 2, key 'segment'") and "label 7" in text and "0..4" in text
    events[2]["segment"][:10] = -1  # the ignore index
    path = _h5(tmp_path, events)
    assert (PILArNetH5Dataset(path, min_points=0)[2]["segment"] == -1).sum() == 10
    with pytest.raises(UserError, match="label -1"):
        PILArNetH5Dataset(path, min_points=0, ignore_index=255)[2]


@pytest.mark.parametrize("revision", ["v1", "v2", "v3"])
def test_an_empty_pilarnet_event_is_a_well_defined_empty_event(tmp_path, revision):
    events = _events(2)
    empty = {k: v[:0] for k, v in events[0].items()}
    path = _h5(tmp_path, [events[0], empty, events[1]], revision)
    dataset = PILArNetH5Dataset(path, min_points=0, revision=revision)
    full, item = dataset[0], dataset[1]
    assert set(item) == set(full)
    for key, value in full.items():
        if isinstance(value, np.ndarray):
            assert item[key].shape == (0, *value.shape[1:]) and item[key].dtype == value.dtype, key
    assert len(PILArNetH5Dataset(path, min_points=1, revision=revision)) == 2  # min_points leaves it out
    assert decode_event(np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros(0, np.float32),
                        "v3")["coord"].shape == (0, 3)


def test_pilarnet_parquet_rows_are_checked_the_same_way(tmp_path):
    pytest.importorskip("pyarrow")
    from pimm.datasets.pilarnet_parquet import PILArNetParquetDataset, PILArNetParquetIterableDataset
    from pimm.datasets.parquet_files import write_pilarnet_parquet

    events = _events()
    events[1]["coord"] = events[1]["coord"].copy()
    events[1]["coord"][3, 0] = np.nan
    path = tmp_path / "train.parquet"
    write_pilarnet_parquet(events, path)
    dataset = PILArNetParquetDataset(data_root=str(path), min_points=0)
    dataset[0]
    text = one_line(lambda: dataset[1])
    assert text.startswith(f"{path}, row 1, key 'coord'") and "nan at row" in text
    stream = PILArNetParquetIterableDataset(data_root=str(path), min_points=0, shuffle=False)
    with pytest.raises(UserError, match="key 'coord'"):
        list(stream)


# ---------------------------------------------------------------- DefaultDataset


def _scene(root: Path, name: str, n=20, **arrays):
    folder = root / "train" / name
    folder.mkdir(parents=True)
    rng = np.random.default_rng(len(name))
    np.save(folder / "coord.npy", rng.normal(size=(n, 3)).astype(np.float32))
    np.save(folder / "segment.npy", rng.integers(0, 4, size=n))
    for asset, value in arrays.items():
        np.save(folder / f"{asset}.npy", value)
    return folder


def test_default_dataset_checks_coordinates_strengths_and_labels(tmp_path):
    coord = np.zeros((20, 3), np.float32)
    coord[6, 1] = np.nan
    _scene(tmp_path, "a_good")
    bad = _scene(tmp_path, "b_nan_coord", coord=coord)
    strength = np.ones((20, 1), np.float32)
    strength[2] = np.inf
    bad_strength = _scene(tmp_path, "c_inf_strength", strength=strength)
    labels = np.zeros(20, np.int64)
    labels[5] = -4
    bad_label = _scene(tmp_path, "d_label", segment=labels)
    labels = labels.copy()
    labels[5] = -1
    _scene(tmp_path, "e_ignored", segment=labels, instance=np.full(20, -1))
    dataset = DefaultDataset(split="train", data_root=str(tmp_path))
    dataset[0], dataset[4]
    assert f"scene {bad}, key 'coord' (coord.npy) holds nan at row 6" in one_line(lambda: dataset[1])
    assert f"scene {bad_strength}, key 'strength'" in one_line(lambda: dataset[2])
    text = one_line(lambda: dataset[3])
    assert f"scene {bad_label}, key 'segment'" in text and "label -4 at row 5" in text
    ignore_255 = DefaultDataset(split="train", data_root=str(tmp_path), ignore_index=255)
    assert "label -4" in one_line(lambda: ignore_255[3])
    assert (ignore_255[4]["segment"] == -1).sum() == 1  # upstream's fill value stays allowed


# ---------------------------------------------------------------- collate


def test_fallback_collate_concatenates_point_events_and_stacks_the_rest():
    fallback = COLLATE_FNS.get("fallback_collate_fn")
    events = [dict(coord=np.zeros((n, 3), np.float32), segment=np.zeros(n, np.int64)) for n in (3, 5)]
    batch = fallback(events)
    assert batch["coord"].shape == (8, 3) and batch["offset"].tolist() == [3, 8]
    images = [dict(img=torch.zeros(2, 4, 4), label=torch.tensor(1)) for _ in range(3)]
    batch = fallback(images)
    assert batch["img"].shape == (3, 2, 4, 4) and batch["label"].tolist() == [1, 1, 1]
    assert len(fallback.split_batch(fallback(events), 2)) == 2


CONFIG = '''
_base_ = {base!r}
custom_imports = ["tests.support.upstream_examples.glue"]
save_path = {save_path!r}
epoch = 1
batch_size = 4
num_worker = 0
model = dict(type="MySegmentor", num_classes=3, backbone_out_channels=16,
             backbone=dict(type="TinyPointBackbone", in_channels=4, out_channels=16),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1, loss_weight=1.0)])
data = dict(train=dict(type="UpstreamDocDataset", data_root={data_root!r}, split="train",
                       transform=[dict(type="ToTensor"),
                                  dict(type="Collect", keys=("coord", "segment"), feat_keys=("coord", "energy"))]))
optimizer = dict(type="AdamW", lr=0.01)
hooks = [dict(type="CheckpointSaver", save_freq=None)]
'''


def _register_upstream_doc_dataset():
    """upstream's docs/source/extend/add_dataset.md ``MyDataset``, as written
    there, with the ``get_data`` its user writes (one ``.npz`` event)."""
    from pimm.datasets.builder import DATASETS as UPSTREAM_DATASETS
    from pimm.datasets.transform import Compose

    @UPSTREAM_DATASETS.register_module("UpstreamDocDataset", force=True)
    class MyDataset(torch.utils.data.Dataset):
        def __init__(self, data_root, split="train", transform=None):
            self.transform = Compose(transform)
            self.data_list = sorted((Path(data_root) / split).glob("*.npz"))

        def get_data(self, index):
            with np.load(self.data_list[index]) as event:
                return {key: event[key].copy() for key in ("coord", "energy", "segment")}

        def __getitem__(self, index):
            return self.transform(self.get_data(index))

        def __len__(self):
            return len(self.data_list)

    return MyDataset


def test_upstreams_plain_dataset_example_trains_with_no_collate_named(tmp_path):
    from pimm.engines.run.launch import build_trainer, load_config
    from tests.support.upstream_examples.glue import write_events

    _register_upstream_doc_dataset()
    write_events(tmp_path / "data", "train", 8, seed=0)  # 20..40 points each: torch cannot stack them
    assert "UpstreamDocDataset" in DATASETS
    cfg_path = tmp_path / "cfg.py"
    cfg_path.write_text(CONFIG.format(base=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                                      save_path=str(tmp_path / "run"), data_root=str(tmp_path / "data")))
    cfg, hooks = load_config(str(cfg_path), [], world_size=1)
    trainer = build_trainer(cfg, hooks=hooks)
    trainer.train()
    assert trainer.global_step == 2  # 8 events, batch 4, one epoch
    losses = [r["train/loss"] for r in _records(tmp_path / "run") if "train/loss" in r]
    assert losses and all(np.isfinite(losses))


def _records(save_path: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in open(save_path / "metrics.jsonl")]
