"""Point-cloud transforms with upstream pimm's signatures, checked against
outputs worked out by hand, plus alignment of per-point keys and determinism."""

import numpy as np
import pytest
import torch

from pimm.datasets.transforms import (Collect, Compose, Copy, GridSample, LogTransform, NormalizeCoord,
                                      RandomFlip, RandomJitter, RandomRotate, RandomScale, ShufflePoint,
                                      ToTensor, Update)
from pimm.datasets.voxelize import fnv_hash, ravel_hash
from pimm.engines.registries import TRANSFORMS
from pimm.utils.errors import RegistryError, UserError


def make_event(n=400, seed=0):
    rng = np.random.default_rng(seed)
    return dict(
        coord=rng.uniform(0, 20, size=(n, 3)).astype(np.float32),
        energy=rng.uniform(0.1, 5, size=(n, 1)).astype(np.float32),
        segment=rng.integers(0, 5, size=n),
        instance=rng.integers(-1, 10, size=n),
        interaction=rng.integers(0, 3, size=n),
        pid=np.arange(n),  # original row of each point, to check alignment
        name="event",
    )


def assert_aligned(out, ref):
    """Every per-point key of ``out`` is the row ``out['pid']`` of ``ref``."""
    for k in ("coord", "energy", "segment", "instance", "interaction"):
        np.testing.assert_array_equal(out[k], ref[k][out["pid"]], err_msg=k)
    assert out["name"] == ref["name"]


# Four points, grid_size 1: cells (0,0,0) (0,0,0) (1,0,0) (-1,0,0). The grid
# is anchored at the origin, so grid_coord = cell - (-1,0,0).
TINY = dict(coord=np.array([[0.1, 0.1, 0.1], [0.2, 0.3, 0.4], [1.5, 0.2, 0.1], [-0.5, 0.0, 0.0]], np.float32),
            energy=np.array([[1.0], [2.0], [4.0], [8.0]], np.float32),
            segment=np.array([3, 1, 2, 0]))


def test_gridsample_ravel_order_grid_coord_inverse_by_hand():
    out = GridSample(grid_size=1.0, hash_type="ravel", reduce="first", return_grid_coord=True,
                     return_inverse=True, return_min_coord=True)(TINY)
    # Raster keys 1, 1, 2, 0 -> cells in order: point 3, points {0, 1} (first: 0), point 2.
    np.testing.assert_array_equal(out["segment"], [0, 3, 2])
    np.testing.assert_array_equal(out["coord"], TINY["coord"][[3, 0, 2]])
    np.testing.assert_array_equal(out["grid_coord"], [[0, 0, 0], [1, 0, 0], [2, 0, 0]])
    assert out["grid_coord"].dtype == np.int64
    np.testing.assert_array_equal(out["inverse"], [1, 1, 2, 0])  # output row of each input point's cell
    np.testing.assert_array_equal(out["min_coord"], [[-1.0, 0.0, 0.0]])
    assert len(TINY["coord"]) == 4  # input untouched


def test_gridsample_grid_is_anchored_at_the_origin():
    ev = dict(coord=np.array([[0.9, 0, 0], [1.1, 0, 0], [2.05, 0, 0]], np.float32))
    out = GridSample(grid_size=1.0, reduce="first", hash_type="ravel", return_grid_coord=True)(ev)
    # floor(x): 0, 1, 2 -> three cells (a min-anchored grid would merge 0.9 and 1.1).
    np.testing.assert_array_equal(out["grid_coord"][:, 0], [0, 1, 2])


def test_fnv_hash_matches_a_reference_and_orders_output():
    def reference(row):  # 64-bit FNV: multiply by the prime, then xor, per column
        h = 14695981039346656037
        for c in row:
            h = ((h * 1099511628211) % 2**64) ^ int(c)
        return h

    cells = np.array([[0, 0, 0], [1, 0, 0], [2, 0, 0], [0, 5, 7], [300, 2, 1]])
    assert fnv_hash(cells).tolist() == [reference(r) for r in cells]
    assert ravel_hash(cells).tolist() == [(a * 6 + b) * 8 + c for a, b, c in cells]  # extents 301, 6, 8
    out = GridSample(grid_size=1.0, reduce="first", return_grid_coord=True)(TINY)  # hash_type="fnv" default
    expected = sorted([[0, 0, 0], [1, 0, 0], [2, 0, 0]], key=reference)
    np.testing.assert_array_equal(out["grid_coord"], expected)


def test_gridsample_reducers_and_displacement_by_hand():
    ev = dict(TINY, normal=np.tile(np.array([[0.0, 0.0, 1.0]], np.float32), (4, 1)))
    out = GridSample(grid_size=1.0, hash_type="ravel", reduce="mean", sum_keys=("energy",))(ev)
    np.testing.assert_allclose(out["energy"][:, 0], [8.0, 3.0, 4.0])  # summed: cell {0,1} -> 1+2
    np.testing.assert_allclose(out["coord"][1], [0.15, 0.2, 0.25], rtol=1e-6)  # mean of points 0 and 1
    assert out["segment"].tolist() == [0, 3, 2]  # integer labels from the first point
    low = GridSample(grid_size=1.0, hash_type="ravel", reduce="first", min_keys=("energy",))(ev)
    np.testing.assert_allclose(low["energy"][:, 0], [8.0, 1.0, 4.0])
    disp = GridSample(grid_size=1.0, hash_type="ravel", reduce="first", return_displacement=True)(ev)
    # point 0 at (0.1, 0.1, 0.1) in cell 0: (0.1 - 0) - 0.5 on each axis
    np.testing.assert_allclose(disp["displacement"][1], [-0.4, -0.4, -0.4], atol=1e-6)
    proj = GridSample(grid_size=1.0, hash_type="ravel", reduce="first", return_displacement=True,
                      project_displacement=True)(ev)
    np.testing.assert_allclose(proj["displacement"][:, 0], [-0.5, -0.4, -0.4], atol=1e-6)


def test_gridsample_test_mode_fragments_cover_every_point():
    parts = GridSample(grid_size=1.0, hash_type="ravel", mode="test", return_grid_coord=True)(TINY)
    assert isinstance(parts, list) and len(parts) == 2  # the fullest cell has two points
    np.testing.assert_array_equal(parts[0]["index"], [3, 0, 2])
    np.testing.assert_array_equal(parts[1]["index"], [3, 1, 2])  # cells with one point repeat it
    for part in parts:
        np.testing.assert_array_equal(part["coord"], TINY["coord"][part["index"]])
        np.testing.assert_array_equal(part["grid_coord"], [[0, 0, 0], [1, 0, 0], [2, 0, 0]])
    assert sorted(set(np.concatenate([p["index"] for p in parts]).tolist())) == [0, 1, 2, 3]


def test_gridsample_train_one_random_point_per_cell_follows_global_seed():
    ev = make_event()
    np.random.seed(0)
    out = GridSample(grid_size=4.0, return_grid_coord=True)(ev)
    assert_aligned(out, ev)
    gc = out["grid_coord"]
    assert len(np.unique(gc, axis=0)) == len(gc) < len(ev["coord"])
    cells = np.floor(ev["coord"].astype(np.float64) / 4.0)
    np.testing.assert_array_equal(gc, cells[out["pid"]] - cells.min(0))
    assert len(gc) == len(np.unique(cells, axis=0))  # every occupied cell is represented
    np.random.seed(3)
    a = GridSample(grid_size=4.0)(ev)["pid"]
    np.random.seed(3)
    b = GridSample(grid_size=4.0)(ev)["pid"]
    np.random.seed(4)
    c = GridSample(grid_size=4.0)(ev)["pid"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_per_point_keys_origin_copies_and_index_valid_keys():
    ev = Copy()(dict(TINY))  # keeps coord/segment as origin_coord/origin_segment
    out = GridSample(grid_size=1.0, reduce="first")(ev)
    assert len(out["coord"]) == 3 and len(out["origin_coord"]) == 4 and len(out["origin_segment"]) == 4
    # Upstream's explicit list: only the listed keys are sampled, grid_coord joins it.
    listed = Update(keys_dict={"index_valid_keys": ["coord", "segment"]})(dict(TINY))
    out = GridSample(grid_size=1.0, hash_type="ravel", reduce="first", return_grid_coord=True)(listed)
    assert len(out["segment"]) == 3 and len(out["energy"]) == 4
    assert out["index_valid_keys"] == ["coord", "segment", "grid_coord"]
    assert listed["index_valid_keys"] == ["coord", "segment"]
    shuffled = ShufflePoint()(out)
    assert sorted(map(tuple, shuffled["grid_coord"])) == sorted(map(tuple, out["grid_coord"]))


def test_gridsample_rejects_bad_arguments():
    for bad in (dict(mode="val"), dict(hash_type="md5"), dict(reduce="max"), dict(grid_size=0),
                dict(grid_size=(1, 2))):
        with pytest.raises(UserError):
            GridSample(**bad)
    empty = GridSample(grid_size=1.0, return_grid_coord=True)(dict(coord=np.zeros((0, 3), np.float32)))
    assert empty["coord"].shape == (0, 3) and empty["grid_coord"].shape == (0, 3)


def test_copy_and_update():
    ev = make_event(5)
    out = Copy(keys_dict={"segment": "segment_copy", "name": "title"})(ev)
    np.testing.assert_array_equal(out["segment_copy"], ev["segment"])
    out["segment_copy"][0] = 99
    assert ev["segment"][0] != 99 and out["title"] == "event"
    default = Copy()(ev)
    assert default["origin_coord"] is not ev["coord"]
    np.testing.assert_array_equal(default["origin_segment"], ev["segment"])
    tensor = Copy(keys_dict={"t": "u"})(dict(t=torch.ones(2)))
    assert torch.equal(tensor["u"], torch.ones(2)) and tensor["u"] is not tensor["t"]
    with pytest.raises(UserError, match="segment_motif"):
        Copy(keys_dict={"segment_motif": "segment"})(ev)
    assert Update(keys_dict={"flag": [1]})(ev)["flag"] == [1]


def test_normalize_coord_by_hand():
    ev = dict(coord=np.array([[0, 0, 0], [1000, 0, 0]], np.float32))
    np.testing.assert_allclose(NormalizeCoord(center=[500, 0, 0], scale=500)(ev)["coord"], [[-1, 0, 0], [1, 0, 0]])
    # center None: centroid (500, 0, 0); scale None: the largest distance to it (500).
    np.testing.assert_allclose(NormalizeCoord()(ev)["coord"], [[-1, 0, 0], [1, 0, 0]])
    tilted = dict(coord=np.array([[0, 0, 0], [2, 4, 0], [4, 0, 0]], np.float32))
    box = NormalizeCoord(center="box", mode="box")(tilted)["coord"]  # centre (2, 2, 0), half-side 2
    np.testing.assert_allclose(box, [[-1, -1, 0], [0, 1, 0], [1, -1, 0]])
    for bad in (dict(mode="cube"), dict(center="median"), dict(scale=0)):
        with pytest.raises(UserError):
            NormalizeCoord(**bad)


def test_log_transform_by_hand():
    # min_val=1, max_val=99: log10(1) = 0, log10(100) = 2, so y = log10(x + 1) - 1.
    ev = dict(energy=np.array([[0.0], [9.0], [99.0], [999.0]], np.float32))
    out = LogTransform(min_val=1.0, max_val=99.0)(ev)
    np.testing.assert_allclose(out["energy"][:, 0], [-1.0, 0.0, 1.0, 2.0], atol=1e-6)
    clipped = LogTransform(min_val=1.0, max_val=99.0, clip=True)(ev)
    np.testing.assert_allclose(clipped["energy"][:, 0], [-1.0, 0.0, 1.0, 1.0], atol=1e-6)
    linear = LogTransform(min_val=1.0, max_val=5.0, log=False, keys="energy")(dict(energy=np.array([1.0, 3.0, 5.0])))
    np.testing.assert_allclose(linear["energy"], [-1.0, 0.0, 1.0])
    default = LogTransform()(dict(energy=np.array([0.0, 20.0])))  # upstream defaults 0.01 .. 20
    np.testing.assert_allclose(default["energy"], [-1.0, 1.0], atol=1e-6)
    with pytest.raises(UserError, match="'energy'.*min_val"):
        LogTransform(min_val=1.0)(dict(energy=np.array([-2.0])))
    with pytest.raises(UserError, match="charge"):
        LogTransform(keys=("charge",))(ev)
    legacy = LogTransform(key="energy", scale=2.0, out_key="log_energy")(ev)  # pimm's earlier form
    np.testing.assert_allclose(legacy["log_energy"], np.log1p(ev["energy"] / 2.0), rtol=1e-6)
    np.testing.assert_array_equal(legacy["energy"], ev["energy"])
    with pytest.raises(UserError, match="not both"):
        LogTransform(key="energy", min_val=0.1)


def test_rotate_flip_jitter_scale_by_hand():
    ev = dict(coord=np.array([[1.0, 0, 0], [0, 1.0, 0]], np.float32), normal=np.array([[1.0, 0, 0]] * 2, np.float32))
    quarter = RandomRotate(angle=[0.5, 0.5], axis="z", center=[0, 0, 0], always_apply=True)(ev)
    np.testing.assert_allclose(quarter["coord"], [[0, 1, 0], [-1, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(quarter["normal"], [[0, 1, 0]] * 2, atol=1e-6)
    about_box = RandomRotate(angle=[1, 1], axis="z", always_apply=True)(ev)["coord"]  # 180 deg about (0.5, 0.5, 0)
    np.testing.assert_allclose(about_box, [[0, 1, 0], [1, 0, 0]], atol=1e-6)
    assert RandomRotate(p=0.0)(ev) is ev
    np.random.seed(0)
    applied = [RandomRotate()(ev) is not ev for _ in range(400)]
    assert 0.4 < np.mean(applied) < 0.6  # upstream's default p = 0.5
    flipped = RandomFlip(p=1.0)(dict(coord=np.array([[1.0, 2.0, 3.0]], np.float32)))["coord"]
    np.testing.assert_array_equal(flipped, [[-1.0, -2.0, 3.0]])  # default axes x and y, through the origin
    assert RandomFlip(p=1.0, axes="z")(ev)["coord"][0].tolist() == [1.0, 0.0, -0.0]
    assert ev["coord"][0].tolist() == [1.0, 0.0, 0.0]  # input untouched
    doubled = RandomScale(scale=[2.0, 2.0])(dict(coord=np.array([[1.0, 2.0, 3.0]], np.float32)))["coord"]
    np.testing.assert_array_equal(doubled, [[2.0, 4.0, 6.0]])
    np.random.seed(5)
    big = make_event()
    jit = RandomJitter(sigma=0.5, clip=0.2, keys=("coord", "energy"))(big)
    for k in ("coord", "energy"):
        delta = jit[k] - big[k]
        assert 0.1 < np.abs(delta).max() <= 0.2 + 1e-6
    assert RandomJitter(p=0.0)(big) is big
    with pytest.raises(UserError, match="charge"):
        RandomJitter(keys="charge")(big)


def test_shuffle_is_a_permutation_keeping_alignment():
    ev = make_event()
    np.random.seed(1)
    out = ShufflePoint()(ev)
    assert sorted(out["pid"].tolist()) == list(range(len(ev["coord"])))
    assert not np.array_equal(out["pid"], ev["pid"])
    assert_aligned(out, ev)


def test_to_tensor_follows_upstream_dtype_rules():
    out = ToTensor()(dict(
        i32=np.array([1, 2], np.int32), u8=np.array([1], np.uint8), f64=np.zeros(2), f16=np.zeros(2, np.float16),
        b=np.array([True, False]), n=3, x=0.5, s="name", nested={"a": np.arange(2)}, seq=[np.zeros(1), "t"],
        nothing=None))
    assert out["i32"].dtype == out["u8"].dtype == torch.int64
    assert out["f64"].dtype == out["f16"].dtype == torch.float32
    assert out["b"].dtype == torch.bool
    assert out["n"].tolist() == [3] and out["n"].dtype == torch.int64
    assert out["x"].tolist() == [0.5] and out["x"].dtype == torch.float32
    assert out["s"] == "name" and out["nothing"] is None
    assert out["nested"]["a"].dtype == torch.int64 and out["seq"][1] == "t"


def test_collect_groups_offsets_and_errors():
    ev = ToTensor()(make_event(6))
    out = Collect(keys=("coord", "segment"), feat_keys=("coord", "energy"), extra_keys=("instance",))(ev)
    assert set(out) == {"coord", "segment", "feat", "extra", "offset"}  # offset by default, as upstream
    assert out["offset"].tolist() == [6]
    assert "offset" not in Collect(keys="coord", offset_keys_dict={})(ev)  # a given dict replaces the default
    assert out["feat"].shape == (6, 4) and out["feat"].dtype == torch.float32
    torch.testing.assert_close(out["feat"][:, 3], ev["energy"][:, 0])
    assert out["extra"].shape == (6, 1)
    counted = Collect(keys="coord", offset_keys_dict={"offset": "coord", "n_seg": "segment"})(ev)
    assert counted["offset"].tolist() == [6] and counted["n_seg"].tolist() == [6]
    np_out = Collect(keys="coord", feat_keys=("energy", "segment"))(make_event(6))
    assert np_out["feat"].shape == (6, 2) and np_out["feat"].dtype == np.float32
    with pytest.raises(UserError, match="grid_coord"):
        Collect(keys=("grid_coord",))(ev)
    with pytest.raises(UserError, match="feat_key"):
        Collect(keys="coord", feat_key=("energy",))


def test_compose_from_configs_is_deterministic_under_seed():
    cfg = [dict(type="RandomRotate"), dict(type="RandomFlip"), dict(type="RandomScale"),
           dict(type="RandomJitter", sigma=0.1, clip=0.3), dict(type="GridSample", grid_size=2.0),
           dict(type="ShufflePoint")]
    ev = make_event()
    np.random.seed(9)
    a = Compose(cfg)(ev)
    np.random.seed(9)
    b = TRANSFORMS.build(dict(type="Compose", transforms=cfg))(ev)
    for k in ("coord", "pid", "segment"):
        np.testing.assert_array_equal(a[k], b[k])
    assert_aligned({**a, "coord": ev["coord"][a["pid"]]}, ev)
    assert Compose(None)(ev) is ev
    single = Compose(dict(type="LogTransform", out_key="log_energy"))(ev)
    np.testing.assert_allclose(single["log_energy"], np.log1p(ev["energy"]), rtol=1e-6)
    with pytest.raises(RegistryError, match="GridSample"):
        Compose([dict(type="GridSampel")])
