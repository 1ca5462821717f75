"""PILArNet-M HDF5 reader/writer: round trip, upstream's layouts (v1/v2/v3)
and options, label keys worked out by hand, errors, and the export tool."""

import importlib.util
import pickle
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch.utils.data import DataLoader

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.datasets.pilarnet import PILArNetH5Dataset, write_pilarnet_h5
from pimm.engines.registries import DATASETS
from pimm.utils.errors import ConfigError, UserError
from tests.support import forkserver

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("coord", "energy", "segment", "instance", "interaction")


def assert_same_event(a, b):
    for k in KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert a[k].dtype == b[k].dtype, k


@pytest.fixture(scope="module")
def generated():
    ds = LArTPCSynthDataset(num_events=5, seed=4, points_per_event=(300, 600))
    return [ds[i] for i in range(len(ds))]


@pytest.fixture
def split_dir(tmp_path, generated):
    (tmp_path / "train").mkdir()
    write_pilarnet_h5(generated[:3], tmp_path / "train" / "a.h5")
    write_pilarnet_h5(generated[3:], tmp_path / "train" / "b.h5")
    return tmp_path


def test_round_trip_is_exact(split_dir, generated):
    ds = DATASETS.build(dict(type="PILArNetH5Dataset", data_root=str(split_dir), split="train", min_points=0))
    assert len(ds) == len(generated)
    for i, event in enumerate(generated):
        assert_same_event(ds[i], event)
    assert ds[0]["name"] == "a.h5_0" and ds[4]["name"] == "b.h5_1"  # upstream's naming
    assert ds[0]["split"] == "train" and ds[0]["revision"] == "v2"
    np.testing.assert_array_equal(ds[1]["segment_motif"], generated[1]["segment"])
    counts = np.load(split_dir / "train" / "a_points.npy")
    assert counts.tolist() == [len(e["coord"]) for e in generated[:3]]


def read_like_upstream(path, revision):
    """Read a file the way upstream pimm's PILArNetH5Dataset does (per its
    code): open with libver="latest" and swmr=True, take point counts from
    <file>_points.npy (checked against point.size // 8), reshape point rows to
    8 columns, cluster rows to 5 (v1) or 6 columns, and cluster_extra rows to
    one per cluster with at least 5 (v2) or 6/9/11 (v3) values."""
    counts = np.load(str(path).replace(".h5", "_points.npy"))
    events = []
    with h5py.File(path, "r", libver="latest", swmr=True) as f:
        for i in range(f["point"].shape[0]):
            assert f["point"][i].size // 8 == counts[i]
            point = np.asarray(f["point"][i]).reshape(-1, 8)
            cluster = np.asarray(f["cluster"][i]).reshape(-1, 5 if revision == "v1" else 6)
            assert cluster[:, 0].astype(np.int64).sum() == len(point)
            if revision != "v1":
                extra = np.asarray(f["cluster_extra"][i]).reshape(len(cluster), -1)
                assert extra.shape[1] == (5 if revision == "v2" else 9)  # v3: packed, with px, py, pz
            semantic = np.repeat(cluster[:, 4], cluster[:, 0].astype(np.int64))
            events.append((point[:, :3], point[:, 3], semantic))
    return events


@pytest.mark.parametrize("revision", ["v1", "v2", "v3"])
def test_written_files_have_upstream_layout(tmp_path, generated, revision):
    path = tmp_path / "train" / "x.h5"
    path.parent.mkdir()
    assert write_pilarnet_h5(generated, path, revision=revision) == len(generated)
    expected = {"v1": {"point", "cluster"}, "v2": {"point", "cluster", "cluster_extra"},
                "v3": {"point", "cluster", "cluster_extra"}}[revision]
    with h5py.File(path, "r") as f:
        assert set(f) == expected and dict(f.attrs) == {}
        dtypes = {name: h5py.check_vlen_dtype(f[name].dtype) for name in f}
        assert all(f[name].ndim == 1 for name in f)
    assert dtypes["point"] == np.float32 and dtypes["cluster"] == np.int64
    if revision != "v1":
        assert dtypes["cluster_extra"] == np.float32
    assert sorted(p.name for p in path.parent.iterdir()) == ["x.h5", "x_points.npy"]  # no other side files
    for (coord, energy, semantic), ev in zip(read_like_upstream(path, revision), generated):
        np.testing.assert_array_equal(coord, ev["coord"])
        np.testing.assert_array_equal(energy, ev["energy"][:, 0])
        np.testing.assert_array_equal(semantic, ev["segment"])
    ours = PILArNetH5Dataset(path, min_points=0, revision=revision)
    assert_same_event(ours[2], generated[2])
    assert ("is_primary" in ours[0]) == (revision == "v3")


def vlen_dataset(f, name, rows, dtype):
    data = np.empty(len(rows), dtype=object)
    data[:] = [np.asarray(r, dtype=dtype).ravel() for r in rows]
    f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(dtype))


POINTS = np.zeros((6, 8), dtype=np.float32)
POINTS[:, :3] = np.arange(18).reshape(6, 3)
POINTS[:, 3] = [0.1, 0.2, 1.0, 1.1, 2.0, 2.1]
# Low-energy cluster first (2 points, no group), then group 7 (a track of
# interaction 0, pid 2 = muon) and group 12 (a shower of interaction 3, pid -1).
CLUSTER_V2 = np.array([[2, -1, -1, -1, 4, -1], [3, 7, 7, 0, 1, 2], [1, 12, 12, 3, 0, -1]])


def write_file(path, cluster, extra_width=None):
    with h5py.File(path, "w") as f:
        vlen_dataset(f, "point", [POINTS], np.float32)
        vlen_dataset(f, "cluster", [cluster], np.int32)
        if extra_width:
            extra = np.full((len(cluster), extra_width), -1.0)
            if extra_width >= 6:
                extra[:, 5] = [0, 1, 0]  # is_primary
            vlen_dataset(f, "cluster_extra", [extra], np.float32)
    return path


def test_v2_labels_by_hand(tmp_path):
    ev = PILArNetH5Dataset(write_file(tmp_path / "v2.h5", CLUSTER_V2, 5), min_points=0, revision="v2")[0]
    assert ev["segment"].tolist() == ev["segment_motif"].tolist() == [4, 4, 1, 1, 1, 0]
    assert ev["segment_pid"].tolist() == [5, 5, 2, 2, 2, 5]  # -1 (none) becomes 5
    assert ev["instance_particle"].tolist() == [-1, -1, 0, 0, 0, 1]
    assert ev["instance"].tolist() == [-1, -1, 0, 0, 0, 1]
    assert ev["instance_interaction"].tolist() == [-1, -1, 0, 0, 0, 1]
    assert ev["segment_interaction"].tolist() == [0, 0, 1, 1, 1, 1]
    assert ev["interaction"].tolist() == [-1, -1, 0, 0, 0, 3]
    assert all(ev[k].dtype == np.int64 and ev[k].shape == (6,) for k in ("segment_pid", "instance_particle"))
    np.testing.assert_array_equal(ev["energy"][:, 0], POINTS[:, 3])
    assert ev["energy"].shape == (6, 1)
    old = PILArNetH5Dataset(tmp_path / "v2.h5", min_points=0, old_pid_mapping=True)[0]
    assert old["segment_pid"].tolist() == [6, 6, 2, 2, 2, 6]
    no_led = PILArNetH5Dataset(tmp_path / "v2.h5", min_points=0, remove_low_energy_scatters=True)[0]
    assert no_led["segment"].tolist() == [1, 1, 1, 0]
    np.testing.assert_array_equal(no_led["coord"], POINTS[2:, :3])
    cut = PILArNetH5Dataset(tmp_path / "v2.h5", min_points=0, energy_threshold=1.0)[0]
    assert cut["energy"][:, 0].tolist() == pytest.approx([1.1, 2.0, 2.1])  # strictly above, as upstream
    assert cut["segment_pid"].tolist() == [2, 2, 5]


def test_v1_and_v3_layouts(tmp_path):
    """v1: 5 cluster columns, no cluster_extra, pid stays -1; v3: is_primary."""
    v1 = PILArNetH5Dataset(write_file(tmp_path / "v1.h5", CLUSTER_V2[:, :5]), min_points=0)[0]
    assert v1["revision"] == "v1" and v1["segment"].tolist() == [4, 4, 1, 1, 1, 0]
    assert v1["segment_pid"].tolist() == [-1] * 6 and "is_primary" not in v1
    write_file(tmp_path / "v3.h5", CLUSTER_V2, 6)
    v3 = PILArNetH5Dataset(tmp_path / "v3.h5", min_points=0, revision="v3")[0]
    assert v3["is_primary"].tolist() == [0, 0, 1, 1, 1, 0]
    as_v2 = PILArNetH5Dataset(tmp_path / "v3.h5", min_points=0, revision="v2")[0]  # allowed, as upstream
    assert "is_primary" not in as_v2 and as_v2["segment_pid"].tolist() == v3["segment_pid"].tolist()


def test_revision_mismatch_and_bad_layouts_are_errors(tmp_path):
    write_file(tmp_path / "v1.h5", CLUSTER_V2[:, :5])
    write_file(tmp_path / "v2.h5", CLUSTER_V2, 5)
    with pytest.raises(UserError, match=r"v1\.h5 is a PILArNet v1 file but revision='v2'"):
        PILArNetH5Dataset(tmp_path / "v1.h5", min_points=0, revision="v2")
    for wanted in ("v1", "v3"):
        with pytest.raises(UserError, match=f"v2 file but revision='{wanted}'"):
            PILArNetH5Dataset(tmp_path / "v2.h5", min_points=0, revision=wanted)
    with pytest.raises(ConfigError, match="revision='v4'"):
        PILArNetH5Dataset(tmp_path / "v2.h5", revision="v4")
    write_file(tmp_path / "odd.h5", CLUSTER_V2, 7)
    with pytest.raises(UserError, match="odd.h5: 'cluster_extra' has 7 values per cluster"):
        PILArNetH5Dataset(tmp_path / "odd.h5", min_points=0)


def test_options_min_points_max_len_loop_and_splits(split_dir, generated):
    sizes = np.array([len(e["coord"]) for e in generated])
    threshold = int(np.median(sizes))
    filtered = PILArNetH5Dataset(split_dir, min_points=threshold)
    assert len(filtered) == int((sizes >= threshold).sum())
    assert all(len(filtered[i]["coord"]) >= threshold for i in range(len(filtered)))
    (split_dir / "train" / "a_points.npy").unlink()  # then counts come from the cluster sizes
    assert len(PILArNetH5Dataset(split_dir, min_points=threshold)) == len(filtered)
    with pytest.raises(UserError, match="min_points=1024"):  # upstream's default drops these small events
        PILArNetH5Dataset(split_dir)
    capped = PILArNetH5Dataset(split_dir, min_points=0, max_len=4, loop=2)
    assert len(capped) == 8
    assert_same_event(capped[5], generated[1])  # loop repeats the first max_len events
    for no_cap in (-1, 0, None):
        assert len(PILArNetH5Dataset(split_dir, min_points=0, max_len=no_cap)) == 5
    (split_dir / "val").mkdir()
    write_pilarnet_h5(generated[:2], split_dir / "val" / "c.h5")
    both = PILArNetH5Dataset(split_dir, split=["train", "val"], min_points=0)
    assert len(both) == 7 and both[0]["split"] == "custom"
    assert len(PILArNetH5Dataset(split_dir, split="val", min_points=0)) == 2
    single = PILArNetH5Dataset(split_dir / "train" / "b.h5", min_points=0)
    assert len(single) == 2
    assert_same_event(single[1], generated[4])
    assert len(PILArNetH5Dataset(str(split_dir / "train" / "*.h5"), min_points=0, max_len=4)) == 4


def test_data_root_from_environment_and_unsupported_options(split_dir, monkeypatch):
    monkeypatch.setenv("PILARNET_DATA_ROOT_V2", str(split_dir))
    assert len(PILArNetH5Dataset(data_root=None, revision="v2", min_points=0)) == 5
    monkeypatch.delenv("PILARNET_DATA_ROOT_V2")
    monkeypatch.setenv("HOME", str(split_dir))  # no ~/.cache/pimm/pilarnet/v2 there
    with pytest.raises(ConfigError, match="PILARNET_DATA_ROOT_V2"):
        PILArNetH5Dataset(data_root=None, revision="v2")
    with pytest.raises(ConfigError, match="give data_root, or a revision"):
        PILArNetH5Dataset(data_root=None)
    for option in (dict(test_mode=True), dict(overlay_n_events=0), dict(loop=0), dict(min_points=-1),
                   dict(split=["train", "dev"])):
        with pytest.raises(UserError):
            PILArNetH5Dataset(split_dir, **option)


def test_handles_are_not_pickled_and_workers_read(split_dir, generated):
    ds = PILArNetH5Dataset(split_dir, min_points=0)
    ds[0]  # opens a handle in this process
    clone = pickle.loads(pickle.dumps(ds))
    assert_same_event(clone[2], generated[2])
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda e: e)
    for i, event in enumerate(loader):
        assert_same_event(event, generated[i])


def test_reader_errors_name_the_path(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(UserError, match="nowhere"):
        PILArNetH5Dataset(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="no \\*.h5 files"):
        PILArNetH5Dataset(tmp_path / "empty")
    with pytest.raises(UserError, match="matches no files"):
        PILArNetH5Dataset(str(tmp_path / "empty" / "*.h5"))
    with h5py.File(tmp_path / "wrong.h5", "w") as f:
        f.create_dataset("data", data=np.zeros((4, 3)))
    with pytest.raises(UserError, match=r"wrong\.h5.*'point' and 'cluster'"):
        PILArNetH5Dataset(tmp_path / "wrong.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(UserError, match="text.h5"):
        PILArNetH5Dataset(tmp_path / "text.h5")
    with h5py.File(tmp_path / "bad_sizes.h5", "w") as f:
        vlen_dataset(f, "point", [np.zeros(16)], np.float32)
        vlen_dataset(f, "cluster", [[5, 0, 0, 0, 1]], np.int64)
    with pytest.raises(UserError, match="bad_sizes.h5, event 0"):
        PILArNetH5Dataset(tmp_path / "bad_sizes.h5", min_points=0)[0]


def run_tool(*args):
    return forkserver.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), *args],
                          capture_output=True, text=True, timeout=120)


def load_tool():
    spec = importlib.util.spec_from_file_location("export_pilarnet", ROOT / "tools" / "export_pilarnet.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_export_tool_writes_and_refuses_to_overwrite(tmp_path):
    args = ["--out", str(tmp_path), "--num-events", "5", "--seed", "2", "--split", "val",
            "--events-per-file", "2"]
    res = run_tool(*args)
    assert res.returncode == 0, res.stderr
    files = sorted(p.name for p in (tmp_path / "val").glob("*.h5"))
    assert files == ["lartpc_s2_0000.h5", "lartpc_s2_0001.h5", "lartpc_s2_0002.h5"]
    read = PILArNetH5Dataset(tmp_path, split="val", min_points=0, revision="v2")
    gen = LArTPCSynthDataset(num_events=5, seed=2, split="val")
    assert len(read) == 5
    assert_same_event(read[4], gen[4])  # keeps lartpc_s2_0002.h5 open while it is replaced below

    again = run_tool(*args)
    assert again.returncode == 2
    assert again.stderr.startswith("error: ") and again.stderr.count("\n") == 1
    assert "already exists" in again.stderr and "--overwrite" in again.stderr
    assert not list((tmp_path / "val").glob(".*"))  # no temporary files left behind

    tool = load_tool()
    assert tool.main(args + ["--overwrite", "--num-events", "4", "--revision", "v1"]) == 0
    rewritten = PILArNetH5Dataset(tmp_path, split="val", min_points=0)
    assert len(rewritten) == 4  # the third part of the earlier export is gone
    assert rewritten[3]["revision"] == "v1"
    assert_same_event(rewritten[3], gen[3])


@pytest.mark.parametrize("bad, message", [
    (["--num-events", "0"], "--num-events"),
    (["--num-events", "1", "--split", "dev"], "--split"),
    (["--num-events", "1", "--events-per-file", "0"], "--events-per-file"),
    (["--num-events", "1", "--revision", "v4"], "--revision"),
    (["--num-events", "many"], "invalid int"),
])
def test_export_tool_bad_arguments(tmp_path, capsys, bad, message):
    assert load_tool().main(["--out", str(tmp_path)] + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
