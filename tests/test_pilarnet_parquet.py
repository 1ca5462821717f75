"""PILArNet-M parquet files: written here, read back the same as the HDF5
files; the map-style reader's options; the streaming reader's blocks, shuffle
and exact mid-epoch resume across data-loader workers and processes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.datasets.pilarnet import write_pilarnet_h5
from pimm.datasets.pilarnet_parquet import PILArNetParquetIterableDataset, write_pilarnet_parquet
from pimm.engines.registries import DATASETS
from pimm.utils.errors import ConfigError, UserError
from tests.support import forkserver

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("coord", "energy", "segment", "instance", "interaction", "segment_motif", "segment_pid",
          "instance_particle", "instance_interaction", "segment_interaction")


@pytest.fixture(scope="module")
def generated():
    ds = LArTPCSynthDataset(num_events=12, seed=7, points_per_event=(150, 400))
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def root(tmp_path_factory, generated):
    """12 events in three parquet files under train/ (and the same as HDF5)."""
    base = tmp_path_factory.mktemp("parquet")
    (base / "train").mkdir()
    (base / "h5" / "train").mkdir(parents=True)
    for part, (lo, hi) in enumerate(((0, 5), (5, 9), (9, 12))):
        write_pilarnet_parquet(generated[lo:hi], base / "train" / f"p{part}.parquet", row_group_size=2)
    write_pilarnet_h5(generated, base / "h5" / "train" / "all.h5")
    return base


def build(**kw):
    return DATASETS.build(dict(type="PILArNetParquetDataset", **{"min_points": 0, **kw}))


def test_parquet_reads_back_what_the_h5_reader_reads(root, generated):
    ds = build(data_root=str(root), split="train")
    h5 = DATASETS.build(dict(type="PILArNetH5Dataset", data_root=str(root / "h5"), split="train", min_points=0))
    assert len(ds) == len(generated) == len(h5)
    for i in range(len(ds)):
        a, b = ds[i], h5[i]
        for key in LABELS:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            assert a[key].dtype == b[key].dtype, key
    assert ds[0]["name"] == "p0_0" and ds[5]["name"] == "p1_0"  # the event_id column
    assert ds[0]["revision"] == "v2" and ds[0]["split"] == "train"


def test_the_columns_are_upstreams_layout(root, generated):
    table = pq.read_table(root / "train" / "p0.parquet")
    assert set(table.column_names) == {"point", "cluster", "cluster_extra", "n_points", "event_id"}
    assert table.column("n_points").to_pylist() == [len(e["coord"]) for e in generated[:5]]
    first = table.slice(0, 1)
    assert len(first.column("point")[0]) == 8 * len(generated[0]["coord"])
    assert len(first.column("cluster")[0]) % 6 == 0 and len(first.column("cluster_extra")[0]) % 5 == 0


def test_min_points_max_len_and_loop(root, generated):
    counts = np.array([len(e["coord"]) for e in generated])
    cut = int(np.median(counts))
    ds = build(data_root=str(root), min_points=cut)
    assert len(ds) == int((counts >= cut).sum())
    assert all(len(ds[i]["coord"]) >= cut for i in range(len(ds)))
    assert len(build(data_root=str(root), max_len=4, loop=3)) == 12
    with pytest.raises(UserError, match="none of the 12 events"):
        build(data_root=str(root), min_points=10**6)


def test_files_without_n_points_count_from_the_point_lists(tmp_path, generated):
    (tmp_path / "validation").mkdir()
    write_pilarnet_parquet(generated[:4], tmp_path / "validation" / "a.parquet")
    table = pq.read_table(tmp_path / "validation" / "a.parquet").drop(["n_points", "event_id"])
    pq.write_table(table, tmp_path / "validation" / "a.parquet")
    small = min(len(e["coord"]) for e in generated[:4])
    ds = build(data_root=str(tmp_path), split="val", min_points=small + 1)  # "val" finds validation/
    assert len(ds) == sum(len(e["coord"]) > small for e in generated[:4])
    assert build(data_root=str(tmp_path), split="val")[0]["name"] == "val_0"


def test_v1_files_and_bad_input_are_one_line_errors(tmp_path, generated):
    (tmp_path / "train").mkdir()
    write_pilarnet_parquet(generated[:2], tmp_path / "train" / "old.parquet", revision="v1")
    np.testing.assert_array_equal(build(data_root=str(tmp_path), revision="v1")[1]["segment"],
                                  generated[1]["segment"])
    with pytest.raises(UserError, match="v1 file: use revision='v1'"):
        build(data_root=str(tmp_path))[0]
    with pytest.raises(UserError, match="does not exist"):
        build(data_root=str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="no parquet files for split 'test'"):
        build(data_root=str(tmp_path), split="test")
    (tmp_path / "train" / "junk.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="cannot read .*junk.parquet as parquet"):
        build(data_root=str(tmp_path))
    with pytest.raises(ConfigError, match="test_mode"):
        build(data_root=str(tmp_path), test_mode=True)


def test_no_data_root_never_downloads(monkeypatch, tmp_path):
    monkeypatch.delenv("PILARNET_PARQUET_ROOT_V2", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    with pytest.raises(UserError, match="not in the local Hugging Face cache.*huggingface-cli download"):
        build()
    monkeypatch.setenv("PILARNET_PARQUET_ROOT_V2", str(tmp_path / "env-root"))
    with pytest.raises(UserError, match="env-root"):  # the environment variable is the fallback
        build()


def stream(root, **kw):
    defaults = dict(type="PILArNetParquetIterableDataset", data_root=str(root), min_points=0,
                    shuffle_buffer_size=3, seed=5)
    return DATASETS.build({**defaults, **kw})


def names(batches):
    return [name for batch in batches for name in batch]


def loader(ds, workers, batch=2):
    return StatefulDataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=lambda b: [e["name"] for e in b],
                              persistent_workers=workers > 0)


def test_a_stream_epoch_is_every_event_once_in_a_seeded_order(root, generated):
    ds = stream(root)
    assert ds.num_samples() == 12
    first = [e["name"] for e in ds]
    second = [e["name"] for e in ds]  # the next pass is the next epoch
    assert sorted(first) == sorted(second) == sorted(f"p{p}_{i}" for p, n in enumerate((5, 4, 3)) for i in range(n))
    assert first != second
    assert [e["name"] for e in stream(root)] == first  # a function of the seed
    assert [e["name"] for e in stream(root, seed=6)] != first
    assert [e["name"] for e in stream(root, shuffle=False)] == [f"p{p}_{i}" for p, n in enumerate((5, 4, 3))
                                                                for i in range(n)]
    with pytest.raises(ConfigError, match="iters_per_epoch"):
        stream(root, loop=2)


def test_workers_and_processes_read_disjoint_blocks(root, monkeypatch):
    two_workers = names(loader(stream(root), workers=2))
    assert len(two_workers) == 12 and len(set(two_workers)) == 12
    seen = []
    for rank in range(2):  # two processes x two workers: four blocks of 3
        monkeypatch.setattr("pimm.utils.comm.get_world_size", lambda: 2)
        monkeypatch.setattr("pimm.utils.comm.get_rank", lambda rank=rank: rank)
        mine = names(loader(stream(root), workers=2))
        assert len(mine) == 6
        seen += mine
    assert len(set(seen)) == 12


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumes_mid_epoch_exactly(root, workers):
    """Stop after 3 batches of epoch 1, restore into a new loader: the rest of
    epoch 1 and all of epoch 2 are what an uninterrupted loader gives."""
    reference = loader(stream(root), workers)
    whole = [names(reference), names(reference)]
    interrupted = loader(stream(root), workers)
    epoch0 = names(interrupted)
    assert epoch0 == whole[0]
    it = iter(interrupted)
    head = [next(it) for _ in range(3)]
    state = interrupted.state_dict()
    del it, interrupted
    resumed = loader(stream(root), workers)
    resumed.load_state_dict(state)
    tail = names(resumed)
    assert names(head) + tail == whole[1]
    assert names(resumed) != whole[1]  # and the epoch after that is a new order


def test_augmentations_in_workers_are_a_function_of_the_stream_position(root):
    """Random transforms in a worker are seeded by (seed, epoch, block,
    position): a new loader replays them; the next epoch draws new ones."""
    transform = [dict(type="RandomRotate", angle=[-1, 1], axis="z", p=1.0)]

    def epochs(count):
        one = StatefulDataLoader(stream(root, transform=transform), batch_size=None, num_workers=2,
                                 persistent_workers=True)
        return [[np.asarray(e["coord"]) for e in one] for _ in range(count)]

    (a0, a1), (b0,) = epochs(2), epochs(1)
    assert len(a0) == len(b0) == 12
    for x, y in zip(a0, b0):
        np.testing.assert_array_equal(x, y)
    plain = {e["name"]: np.asarray(e["coord"]) for e in stream(root)}
    names0 = [e["name"] for e in stream(root)]
    assert any(not np.array_equal(x, plain[n]) for x, n in zip(a0, names0))  # really rotated
    assert len(a1) == 12 and not all(np.array_equal(x, y) for x, y in zip(a0, a1))


def test_export_tool_writes_parquet_without_touching_h5(tmp_path):
    out = tmp_path / "export"
    cmd = [sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(out), "--num-events", "5",
           "--seed", "3", "--events-per-file", "2"]
    assert forkserver.run(cmd, capture_output=True, text=True).returncode == 0
    done = forkserver.run(cmd + ["--format", "parquet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in (out / "train").iterdir())
    assert [f for f in files if f.endswith(".parquet")] == [f"lartpc_s3_000{i}.parquet" for i in range(3)]
    assert len([f for f in files if f.endswith(".h5")]) == 3  # the h5 export is left alone
    ds = build(data_root=str(out), split="train")
    h5 = DATASETS.build(dict(type="PILArNetH5Dataset", data_root=str(out), split="train", min_points=0))
    for i in range(5):
        np.testing.assert_array_equal(ds[i]["coord"], h5[i]["coord"])
    bad = forkserver.run(cmd + ["--format", "csv"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["error: --format 'csv' is not one of h5, parquet"]


def test_a_stream_item_collates_like_the_map_style_reader(root):
    ds = stream(root, transform=[dict(type="ToTensor"), dict(type="Collect", keys=("coord", "segment"),
                                                             feat_keys=("coord",))])
    batch = ds.collate_fn([next(iter(ds)) for _ in range(1)])
    assert torch.is_tensor(batch["coord"]) and "offset" in batch


STREAM_RUN = """
_base_ = {base!r}
custom_imports = ["tests.support.toy"]
save_path = {save!r}
seed = 3
epoch = 2
batch_size = 2
num_worker = 2
_transform = [dict(type="RandomFlip", p=0.5), dict(type="LogTransform", key="energy"), dict(type="ToTensor"),
              dict(type="Collect", keys=("coord", "segment"), feat_keys=("energy",))]
data = dict(train=dict(type="PILArNetParquetIterableDataset", data_root={root!r}, min_points=0,
                       shuffle_buffer_size=4, transform=_transform))
model = dict(type="DefaultSegmentor", num_classes=5,
             backbone=dict(type="SparseUNet", in_channels=1, grid_size=1.0, channels=(4, 8), enc_blocks=(1, 1),
                           dec_blocks=(1,)),
             criteria=[dict(type="CrossEntropyLoss", ignore_index=-1)])
optimizer = dict(type="AdamW", lr=1e-2)
scheduler = dict(type="Constant")
default_hooks = dict(checkpoint=dict(save_freq=2, async_write=False), progress_bar=None, live_control=None,
                     on_demand_validation=None)
hooks = [dict(type="KillAtStep", step=-1)]
"""


@pytest.mark.slow
def test_training_on_a_stream_with_workers_resumes_mid_epoch_bit_identically(tmp_path, root):
    """tools/train.py over the parquet stream (2 workers, augmentation), killed
    mid-epoch 2, resumed: the same weights and losses as an uninterrupted run."""
    from tests.support.run import final_weights, run_tool, train_losses

    base = str(ROOT / "configs" / "_base_" / "default_runtime.py")

    def config(name):
        path = tmp_path / f"{name}.py"
        path.write_text(STREAM_RUN.format(base=base, save=str(tmp_path / name), root=str(root)))
        return path

    reference = run_tool("train", config("ref"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    assert [s for s, _ in train_losses(tmp_path / "ref")][-1] == 12  # 12 events // batch 2 = 6 steps an epoch
    run = config("run")
    killed = run_tool("train", run, "hooks.KillAtStep.step=9")
    assert killed.returncode != 0
    resumed = run_tool("train", run, "resume=True")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step000000008" in (tmp_path / "run" / "train.log").read_text()  # epoch 2, step 2 of 6
    ref, got = final_weights(tmp_path / "ref")["state_dict"], final_weights(tmp_path / "run")["state_dict"]
    assert [k for k in ref if not torch.equal(ref[k], got[k])] == []
    assert train_losses(tmp_path / "run") == train_losses(tmp_path / "ref")


def test_event_overlay_on_parquet_is_the_h5_readers(root):
    """The same overlay options give the same composite events from either
    format (the draws come from python's random, seeded alike)."""
    import random

    options = dict(min_points=0, overlay_n_events=3, overlay_prob=1.0)
    parquet = build(data_root=str(root), **options)
    h5 = DATASETS.build(dict(type="PILArNetH5Dataset", data_root=str(root / "h5"), split="train", **options))
    for i in (0, 7):
        random.seed(i)
        a = parquet[i]
        random.seed(i)
        b = h5[i]
        assert len(a["coord"]) > len(build(data_root=str(root))[i]["coord"])
        for key in LABELS:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
