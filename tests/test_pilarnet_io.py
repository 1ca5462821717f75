"""PILArNet-M HDF5 reader/writer round trip, layouts, errors, and the export tool."""

import importlib.util
import pickle
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from torch.utils.data import DataLoader

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.datasets.pilarnet import PILArNetH5Dataset, write_pilarnet_h5
from pimm.engines.registries import DATASETS
from pimm.utils.errors import UserError

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
    ds = DATASETS.build(dict(type="PILArNetH5Dataset", data_root=str(split_dir), split="train"))
    assert len(ds) == len(generated)
    for i, event in enumerate(generated):
        assert_same_event(ds[i], event)
    assert ds[0]["name"] == "a_0" and ds[4]["name"] == "b_1"
    counts = np.load(split_dir / "train" / "a_points.npy")
    assert counts.tolist() == [len(e["coord"]) for e in generated[:3]]


def test_file_layout_follows_pilarnet(split_dir, generated):
    with h5py.File(split_dir / "train" / "a.h5", "r") as f:
        assert {"point", "cluster", "cluster_extra"} <= set(f)
        point = f["point"][1].reshape(-1, 8)
        cluster = f["cluster"][1].reshape(-1, 6)
        assert f["cluster_extra"][1].size == 5 * len(cluster)
    ev = generated[1]
    np.testing.assert_array_equal(point[:, :3], ev["coord"])
    np.testing.assert_array_equal(point[:, 3], ev["energy"][:, 0])
    assert cluster[:, 0].sum() == len(ev["coord"])
    assert cluster[0, 4] == 4 and cluster[0, 2] == -1  # low-energy cluster first, no group
    particles = cluster[cluster[:, 2] >= 0]
    assert particles[:, 2].tolist() == sorted(set(ev["instance"][ev["instance"] >= 0].tolist()))


def test_single_file_glob_min_points_max_events(split_dir, generated):
    single = PILArNetH5Dataset(split_dir / "train" / "b.h5")
    assert len(single) == 2
    assert_same_event(single[1], generated[4])
    glob_ds = PILArNetH5Dataset(str(split_dir / "train" / "*.h5"), max_events=4)
    assert len(glob_ds) == 4
    sizes = np.array([len(e["coord"]) for e in generated])
    threshold = int(np.median(sizes))
    filtered = PILArNetH5Dataset(split_dir, min_points=threshold)
    assert len(filtered) == int((sizes >= threshold).sum())
    assert all(len(filtered[i]["coord"]) >= threshold for i in range(len(filtered)))
    # Without the index file the counts come from the cluster sizes.
    (split_dir / "train" / "a_points.npy").unlink()
    assert len(PILArNetH5Dataset(split_dir, min_points=threshold)) == len(filtered)
    cut = PILArNetH5Dataset(split_dir, energy_threshold=0.5)[0]
    assert cut["energy"].min() >= 0.5 and len(cut["coord"]) < len(generated[0]["coord"])


def test_handles_are_not_pickled_and_workers_read(split_dir, generated):
    ds = PILArNetH5Dataset(split_dir)
    ds[0]  # opens a handle in this process
    clone = pickle.loads(pickle.dumps(ds))
    assert_same_event(clone[2], generated[2])
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda e: e)
    for i, event in enumerate(loader):
        assert_same_event(event, generated[i])


def vlen_dataset(f, name, rows, dtype):
    data = np.empty(len(rows), dtype=object)
    data[:] = [np.asarray(r, dtype=dtype).ravel() for r in rows]
    f.create_dataset(name, data=data, dtype=h5py.vlen_dtype(dtype))


def test_reads_v1_layout_and_renumbers_groups(tmp_path):
    """A hand-made 5-column (v1) file: LE cluster, and sparse group ids."""
    points = np.zeros((6, 8), dtype=np.float32)
    points[:, :3] = np.arange(18).reshape(6, 3)
    points[:, 3] = [0.1, 0.2, 1.0, 1.1, 2.0, 2.1]
    cluster = np.array([[2, -1, -1, -1, 4], [3, 7, 7, 0, 1], [1, 12, 12, 0, 0]], dtype=np.int32)
    with h5py.File(tmp_path / "v1.h5", "w") as f:
        vlen_dataset(f, "point", [points], np.float32)
        vlen_dataset(f, "cluster", [cluster], np.int32)
    ev = PILArNetH5Dataset(tmp_path / "v1.h5")[0]
    assert ev["segment"].tolist() == [4, 4, 1, 1, 1, 0]
    assert ev["instance"].tolist() == [-1, -1, 0, 0, 0, 1]
    assert ev["interaction"].tolist() == [-1, -1, 0, 0, 0, 0]
    np.testing.assert_array_equal(ev["energy"][:, 0], points[:, 3])


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
        PILArNetH5Dataset(tmp_path / "bad_sizes.h5")[0]


def run_tool(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), *args],
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
    read = PILArNetH5Dataset(tmp_path, split="val")
    gen = LArTPCSynthDataset(num_events=5, seed=2, split="val")
    assert len(read) == 5
    assert_same_event(read[4], gen[4])  # keeps lartpc_s2_0002.h5 open while it is replaced below

    again = run_tool(*args)
    assert again.returncode == 2
    assert again.stderr.startswith("error: ") and again.stderr.count("\n") == 1
    assert "already exists" in again.stderr and "--overwrite" in again.stderr
    assert not list((tmp_path / "val").glob(".*"))  # no temporary files left behind

    tool = load_tool()
    assert tool.main(args + ["--overwrite", "--num-events", "4"]) == 0
    rewritten = PILArNetH5Dataset(tmp_path, split="val")
    assert len(rewritten) == 4  # the third part of the earlier export is gone
    assert_same_event(rewritten[3], gen[3])


@pytest.mark.parametrize("bad, message", [
    (["--num-events", "0"], "--num-events"),
    (["--num-events", "1", "--split", "dev"], "--split"),
    (["--num-events", "1", "--events-per-file", "0"], "--events-per-file"),
    (["--num-events", "many"], "invalid int"),
])
def test_export_tool_bad_arguments(tmp_path, capsys, bad, message):
    assert load_tool().main(["--out", str(tmp_path)] + bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
