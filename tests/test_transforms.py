"""Point-cloud transforms: alignment of per-point keys, determinism, geometry."""

import numpy as np
import pytest
import torch

from pimm.datasets.transforms import (Collect, Compose, GridSample, LogTransform, NormalizeCoord,
                                      RandomFlip, RandomJitter, RandomRotate, RandomScale,
                                      ShufflePoint, ToTensor)
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


def test_gridsample_train_one_point_per_voxel_and_aligned():
    ev = make_event()
    np.random.seed(0)
    out = GridSample(grid_size=4.0, mode="train", return_grid_coord=True)(ev)
    assert_aligned(out, ev)
    gc = out["grid_coord"]
    assert gc.dtype == np.int64 and gc.shape == (len(out["coord"]), 3)
    assert len(np.unique(gc, axis=0)) == len(gc)  # one point per voxel
    expected = np.floor((ev["coord"][out["pid"]] - ev["coord"].min(0)) / 4.0)
    np.testing.assert_array_equal(gc, expected)
    # Every occupied voxel of the input is represented.
    all_cells = np.unique(np.floor((ev["coord"] - ev["coord"].min(0)) / 4.0), axis=0)
    assert len(all_cells) == len(gc) < len(ev["coord"])


def test_gridsample_random_choice_follows_global_seed():
    ev = make_event()
    np.random.seed(3)
    a = GridSample(grid_size=4.0)(ev)["pid"]
    np.random.seed(3)
    b = GridSample(grid_size=4.0)(ev)["pid"]
    np.random.seed(4)
    c = GridSample(grid_size=4.0)(ev)["pid"]
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_gridsample_test_mode_first_and_mean():
    ev = make_event()
    cells = np.floor((ev["coord"] - ev["coord"].min(0)) / 5.0).astype(int)
    _, inverse = np.unique(cells, axis=0, return_inverse=True)
    first = GridSample(grid_size=5.0, mode="test")(ev)
    # The kept point is the first of its voxel in input order.
    firsts = {int(np.flatnonzero(inverse.ravel() == k)[0]) for k in np.unique(inverse)}
    assert set(first["pid"].tolist()) == firsts
    mean = GridSample(grid_size=5.0, mode="test", reduce="mean")(ev)
    for row, p in enumerate(mean["pid"][:20]):
        members = inverse.ravel() == inverse.ravel()[p]
        np.testing.assert_allclose(mean["coord"][row], ev["coord"][members].mean(0), rtol=1e-5)
        np.testing.assert_allclose(mean["energy"][row], ev["energy"][members].mean(0), rtol=1e-5)
        assert mean["segment"][row] == ev["segment"][p]  # labels from the first point


def test_shuffle_is_a_permutation_keeping_alignment():
    ev = make_event()
    np.random.seed(1)
    out = ShufflePoint()(ev)
    assert sorted(out["pid"].tolist()) == list(range(len(ev["coord"])))
    assert not np.array_equal(out["pid"], ev["pid"])
    assert_aligned(out, ev)


def test_rotate_preserves_distances_and_axis():
    ev = make_event()
    np.random.seed(2)
    out = RandomRotate(angle=(-1, 1), axis="z", center=True)(ev)
    c0, c1 = ev["coord"].astype(np.float64), out["coord"].astype(np.float64)
    np.testing.assert_allclose(c1[:, 2], c0[:, 2], atol=1e-4)
    center = (c0.min(0) + c0.max(0)) / 2
    np.testing.assert_allclose(np.linalg.norm(c1 - center, axis=1), np.linalg.norm(c0 - center, axis=1), atol=1e-3)
    assert not np.allclose(c1, c0)
    np.testing.assert_array_equal(out["segment"], ev["segment"])
    assert RandomRotate(p=0.0)(ev)["coord"] is ev["coord"]
    about_origin = RandomRotate(angle=(0.5, 0.5), axis="x", center=False)(ev)["coord"]  # 90 degrees
    np.testing.assert_allclose(about_origin[:, 1], -ev["coord"][:, 2], atol=1e-4)
    np.testing.assert_allclose(about_origin[:, 2], ev["coord"][:, 1], atol=1e-4)


def test_flip_jitter_scale():
    ev = make_event()
    c = ev["coord"]
    flipped = RandomFlip(p=1.0, axes=("x", "z"))(ev)["coord"]
    np.testing.assert_allclose(flipped[:, 0], c[:, 0].max() + c[:, 0].min() - c[:, 0], atol=1e-5)
    np.testing.assert_array_equal(flipped[:, 1], c[:, 1])
    np.testing.assert_allclose(flipped.min(0), c.min(0), atol=1e-5)
    np.random.seed(5)
    jit = RandomJitter(sigma=0.5, clip=0.2)(ev)["coord"]
    delta = jit - c
    assert np.abs(delta).max() <= 0.2 + 1e-6 and np.abs(delta).max() > 0.1
    np.random.seed(5)
    np.testing.assert_array_equal(RandomJitter(sigma=0.5, clip=0.2)(ev)["coord"], jit)
    ratio = RandomScale(scale=(0.5, 2.0))(ev)["coord"] / c
    np.testing.assert_allclose(ratio, ratio[0, 0], rtol=1e-5)
    aniso = RandomScale(scale=(0.5, 2.0), anisotropic=True)(ev)["coord"] / c
    np.testing.assert_allclose(aniso, np.broadcast_to(aniso[0], aniso.shape), rtol=1e-5)


def test_normalize_coord():
    ev = make_event()
    sphere = NormalizeCoord()(ev)["coord"]
    np.testing.assert_allclose(sphere.mean(0), 0, atol=1e-5)
    assert np.isclose(np.linalg.norm(sphere, axis=1).max(), 1.0, atol=1e-5)
    box = NormalizeCoord(center="box", mode="box")(ev)["coord"]
    assert np.isclose(np.abs(box).max(), 1.0, atol=1e-5)
    np.testing.assert_allclose((box.min(0) + box.max(0)) / 2, 0, atol=1e-5)
    fixed = NormalizeCoord(center=(10, 10, 10), scale=10.0)(ev)["coord"]
    np.testing.assert_allclose(fixed, (ev["coord"] - 10) / 10, atol=1e-6)
    with pytest.raises(UserError):
        NormalizeCoord(mode="cube")


def test_log_transform_tensor_and_collect():
    ev = make_event()
    logged = LogTransform(key="energy", scale=2.0, out_key="log_energy")(ev)
    np.testing.assert_allclose(logged["log_energy"], np.log1p(ev["energy"] / 2.0), rtol=1e-6)
    np.testing.assert_array_equal(logged["energy"], ev["energy"])
    t = ToTensor()(logged)
    assert t["coord"].dtype == torch.float32 and t["segment"].dtype == torch.int64
    assert t["name"] == "event"
    out = Collect(keys=("coord", "segment", "instance"), feat_keys=("coord", "log_energy"))(t)
    assert set(out) == {"coord", "segment", "instance", "feat"}
    assert out["feat"].shape == (len(ev["coord"]), 4) and out["feat"].dtype == torch.float32
    np.testing.assert_allclose(out["feat"][:, 3].numpy(), logged["log_energy"][:, 0])
    np_out = Collect(keys="coord", feat_keys=("energy", "segment"))(ev)
    assert np_out["feat"].shape == (len(ev["coord"]), 2)
    with pytest.raises(UserError, match="grid_coord"):
        Collect(keys=("grid_coord",))(ev)


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
