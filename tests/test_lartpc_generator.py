"""Synthetic LArTPC generator: determinism, equality with the original
(pre-optimisation) generator, label sanity, geometry, speed smoke."""

import importlib.util
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from pimm.datasets import lartpc
from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.engines.registries import DATASETS
from pimm.utils.errors import UserError

KEYS = ("coord", "energy", "segment", "instance", "interaction")


def assert_same_event(a, b):
    for k in KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        assert a[k].dtype == b[k].dtype


def _load_reference():
    """The frozen original generator, ``bench/lartpc_generator_reference.py``
    (loaded by path: bench/ is scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "lartpc_generator_reference.py"
    spec = importlib.util.spec_from_file_location("lartpc_generator_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load_reference()


def assert_bit_identical(ours, theirs, where):
    for k in KEYS:
        assert ours[k].dtype == theirs[k].dtype and ours[k].shape == theirs[k].shape, (where, k)
        assert ours[k].tobytes() == theirs[k].tobytes(), f"{where}: {k} differs from the original generator"


@pytest.mark.parametrize("options, seeds, indices", [
    (dict(), (0, 3), range(4)),  # the defaults: 24 events over three splits
    (dict(points_per_event=(300, 400)), (1,), range(2)),
    (dict(points_per_event=6000), (2,), range(1)),
    (dict(voxel_size=4.0), (4,), range(2)),
    (dict(voxel_size=8.0), (9,), range(1)),
    (dict(voxel_size=0.5, points_per_event=800), (5,), range(1)),
    (dict(energy_threshold=0.5, muon_prob=1.0, michel_prob=1.0, delta_rate=0.05), (6,), range(2)),
    (dict(muon_prob=0.0, protons=(0, 0), showers=(1, 3), photon_fraction=1.0), (7,), range(2)),
    (dict(max_interactions=1, background_blips=(30, 30)), (8,), range(2)),
])
def test_same_events_as_the_original_generator(options, seeds, indices):
    """The optimised generator reproduces the original one bit for bit: same
    seed, same event, every field."""
    for seed in seeds:
        for split in ("train", "val", "test"):
            ds = LArTPCSynthDataset(num_events=max(indices) + 1, seed=seed, split=split, **options)
            for i in indices:
                theirs = reference.generate_event(np.random.default_rng([seed, ds.split_code, i]), **ds.options)
                assert_bit_identical(ds[i], theirs, f"{options} seed={seed} split={split} index={i}")


def test_event_does_not_depend_on_what_was_generated_before():
    """No state leaks between events (step-offset caches, source tables): an
    event is the same fresh, after other events, and after other options."""
    fresh = lartpc.generate_event(np.random.default_rng([3, 1, 5]))
    for options in (dict(voxel_size=4.0), dict(voxel_size=0.25, points_per_event=300), dict(points_per_event=6000)):
        lartpc.generate_event(np.random.default_rng([0, 0, 0]), **options)
    assert_bit_identical(lartpc.generate_event(np.random.default_rng([3, 1, 5])), fresh, "after other events")
    cached = LArTPCSynthDataset(num_events=6, seed=3, split="val", in_memory=True)
    assert_bit_identical(cached[5], fresh, "in_memory cache")
    assert_bit_identical(cached[5], reference.generate_event(np.random.default_rng([3, 1, 5])), "original")


def test_generator_draws_only_from_its_own_stream():
    """Same generator state in, same event and same state out, whatever
    happened to the global RNGs in between."""
    a, b = np.random.default_rng([1, 2, 3]), np.random.default_rng([1, 2, 3])
    first = lartpc.generate_event(a)
    np.random.seed(99)
    torch.manual_seed(99)
    second = lartpc.generate_event(b)
    assert_bit_identical(first, second, "same stream")
    assert a.bit_generator.state == b.bit_generator.state


def test_dominant_source_sort_matches_lexsort():
    rng = np.random.default_rng(0)
    for _ in range(50):
        vox = np.sort(rng.integers(0, 30, size=rng.integers(1, 60)))
        energy = rng.integers(1, 4, size=len(vox)) * 0.5  # many ties
        np.testing.assert_array_equal(lartpc._strongest_first(vox, energy), np.lexsort((-energy, vox)))


def test_unique_and_compact_helpers_match_numpy():
    rng = np.random.default_rng(1)
    for size in (1, 2, 17, 500):
        values = rng.integers(0, 40, size=size)
        pairs, inverse = lartpc._unique_with_inverse(values)
        expected = np.unique(values, return_inverse=True)
        np.testing.assert_array_equal(pairs, expected[0])
        np.testing.assert_array_equal(inverse, expected[1])
        instance = rng.integers(-1, 12, size=size)
        compact = np.full_like(instance, -1)
        compact[instance >= 0] = np.unique(instance[instance >= 0], return_inverse=True)[1]
        np.testing.assert_array_equal(lartpc._compact(instance), compact)


def test_registered_and_layout():
    ds = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=3, seed=1))
    e = ds[0]
    n = len(e["coord"])
    assert e["coord"].shape == (n, 3) and e["coord"].dtype == np.float32
    assert e["energy"].shape == (n, 1) and e["energy"].dtype == np.float32
    for k in ("segment", "instance", "interaction"):
        assert e[k].shape == (n,) and e[k].dtype == np.int64
    assert isinstance(e["name"], str) and e["name"] != ds[1]["name"]
    assert len(ds) == 3
    with pytest.raises(IndexError):
        ds[3]
    assert_same_event(ds[-1], ds[2])


def test_deterministic_per_index_and_independent_of_global_rng():
    a = LArTPCSynthDataset(num_events=5, seed=7)
    b = LArTPCSynthDataset(num_events=5, seed=7)
    np.random.seed(0)
    state = np.random.get_state()[1].copy()
    first = a[3]
    # The generator never touches the global RNG ...
    np.testing.assert_array_equal(np.random.get_state()[1], state)
    np.random.seed(12345)
    # ... and order of access does not matter.
    b[1], b[4]
    assert_same_event(first, b[3])
    assert_same_event(first, pickle.loads(pickle.dumps(a))[3])


def test_seed_split_and_index_change_the_event():
    base = LArTPCSynthDataset(num_events=2, seed=0, split="train")[0]
    for other in (LArTPCSynthDataset(num_events=2, seed=1)[0],
                  LArTPCSynthDataset(num_events=2, seed=0, split="val")[0],
                  LArTPCSynthDataset(num_events=2, seed=0, split="test")[0],
                  LArTPCSynthDataset(num_events=2, seed=0)[1]):
        assert len(other["coord"]) != len(base["coord"]) or not np.array_equal(other["coord"], base["coord"])


def test_worker_processes_see_the_same_events():
    ds = LArTPCSynthDataset(num_events=4, seed=2)
    loader = DataLoader(ds, batch_size=None, num_workers=2, collate_fn=lambda e: e)
    for i, event in enumerate(loader):
        assert_same_event(event, ds[i])


@pytest.fixture(scope="module")
def events():
    ds = LArTPCSynthDataset(num_events=8, seed=11)
    return [ds[i] for i in range(len(ds))]


def test_all_classes_appear_and_fractions_are_sane(events):
    seg = np.concatenate([e["segment"] for e in events])
    frac = np.bincount(seg, minlength=5) / len(seg)
    assert seg.min() >= 0 and seg.max() <= 4
    assert np.all(frac > 0.005), frac
    assert frac[0] > 0.15 and frac[1] > 0.15, frac  # showers and tracks dominate


def test_geometry_inside_cube_and_one_point_per_voxel(events):
    for e in events:
        c = e["coord"]
        assert np.all(c >= 0) and np.all(c < 768)
        np.testing.assert_array_equal(c, np.round(c))  # voxel_size=1: integer voxel indices
        assert len(np.unique(c, axis=0)) == len(c)
        assert np.all(e["energy"] > 0)
    coarse = LArTPCSynthDataset(num_events=1, seed=11, voxel_size=4.0)[0]["coord"]
    np.testing.assert_array_equal(coarse % 4, 0)
    assert len(np.unique(coarse, axis=0)) == len(coarse)


def test_instance_labels_are_consistent(events):
    for e in events:
        seg, inst, inter = e["segment"], e["instance"], e["interaction"]
        np.testing.assert_array_equal(inst == -1, seg == 4)  # low-energy <=> no instance
        ids = np.unique(inst[inst >= 0])
        np.testing.assert_array_equal(ids, np.arange(len(ids)))  # contiguous 0..K-1
        for i in ids:
            m = inst == i
            assert len(np.unique(seg[m])) == 1 and len(np.unique(inter[m])) == 1
        assert inter[inst >= 0].min() >= 0


def _nearest(points, targets):
    d = np.linalg.norm(points[:, None, :] - targets[None, :, :], axis=2)
    return d.min(1), d.argmin(1)


def test_michel_starts_at_a_track_end_and_deltas_touch_tracks(events):
    n_michel = 0
    for e in events:
        c, seg, inst, inter = e["coord"], e["segment"], e["instance"], e["interaction"]
        for i in np.unique(inst[seg == 2]):
            m = inst == i
            tracks = (seg == 1) & (inter == inter[m][0])
            dist, idx = _nearest(c[m], c[tracks])
            assert dist.min() <= 3.0, "a Michel electron must start where a track ends"
            contact = c[tracks][idx[dist.argmin()]]
            track = c[inst == inst[tracks][idx[dist.argmin()]]]
            span = np.linalg.norm(track[:, None] - track[None], axis=2).max()
            # The contact point is an end of its track: the farthest track point
            # from it is (nearly) as far as the track's full extent.
            assert np.linalg.norm(track - contact, axis=1).max() >= 0.8 * span
            assert np.linalg.norm(c[m] - contact, axis=1).max() < 80  # short: tens of MeV
            n_michel += 1
        for i in np.unique(inst[seg == 3]):
            m = inst == i
            tracks = (seg == 1) & (inter == inter[m][0])
            assert _nearest(c[m], c[tracks])[0].min() <= 3.0, "delta rays branch off tracks"
    assert n_michel >= 3


def test_point_target_and_options():
    small = LArTPCSynthDataset(num_events=3, seed=5, points_per_event=(300, 400))
    large = LArTPCSynthDataset(num_events=3, seed=5, points_per_event=6000)
    for i in range(3):
        assert 300 <= len(small[i]["coord"]) < len(large[i]["coord"])
        assert len(large[i]["coord"]) >= 6000
    only_showers = LArTPCSynthDataset(num_events=2, seed=5, muon_prob=0.0, protons=(0, 0), showers=(1, 2))
    for i in range(2):
        assert set(np.unique(only_showers[i]["segment"])) <= {0, 4}


def test_bad_arguments_raise_user_error():
    with pytest.raises(UserError, match="split"):
        LArTPCSynthDataset(num_events=1, split="training")
    with pytest.raises(UserError, match="muon_probability"):
        LArTPCSynthDataset(num_events=1, muon_probability=0.5)
    with pytest.raises(UserError):
        LArTPCSynthDataset(num_events=1, seed=-1)
    with pytest.raises(UserError, match="points_per_event"):
        LArTPCSynthDataset(num_events=1, points_per_event=(500, 100))


def test_transform_pipeline_is_applied():
    ds = LArTPCSynthDataset(num_events=1, transform=[
        dict(type="LogTransform"), dict(type="ToTensor"),
        dict(type="Collect", keys=("coord", "segment"), feat_keys=("coord", "energy"))])
    out = ds[0]
    assert set(out) == {"coord", "segment", "feat", "offset"}  # Collect adds the point count, as upstream
    assert out["offset"].tolist() == [len(out["coord"])]
    assert isinstance(out["feat"], torch.Tensor) and out["feat"].shape[1] == 4


def test_generation_speed_smoke():
    ds = LArTPCSynthDataset(num_events=20, seed=3)
    t0 = time.perf_counter()
    sizes = [len(ds[i]["coord"]) for i in range(len(ds))]
    per_event = (time.perf_counter() - t0) / len(ds)
    print(f"{per_event * 1e3:.1f} ms/event, {np.mean(sizes):.0f} points/event")
    assert min(sizes) > 0
