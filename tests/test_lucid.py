"""LUCiD water-Cherenkov data: the shard generator, LUCiDDataset's output modes,
LUCiDEventSSLDataset's splits and aggregation, bad shards as one line, the
command-line generator, and exact mid-epoch resume of the shipped config."""

from __future__ import annotations

import sys

import h5py
import numpy as np
import pytest
import torch

from pimm.datasets.lucid import LUCiDDataset
from pimm.datasets.lucid_generator import generate_lucid, pmt_positions, _ring_for_lucid
from pimm.datasets.lucid_ssl import LUCiDEventSSLDataset
from pimm.engines.registries import DATASETS
from pimm.utils.errors import ConfigError, UserError
from tests.support import forkserver
from tests.support.run import ROOT, env, final_weights, run_tool, train_losses


@pytest.fixture(scope="module")
def production(tmp_path_factory):
    """Two species of 30 events each, in shards of 12 (3 shards per family)."""
    root = tmp_path_factory.mktemp("lucid")
    for species in ("electron", "muon"):
        assert generate_lucid(root / species, 30, species, events_per_file=12) == 30
    return root


def _hits(path, event):
    with h5py.File(path) as f:
        lo, hi = f["event_hit_offsets"][event:event + 2]
        return f["event_hit_sensor_idx"][lo:hi], f["event_hit_PE"][lo:hi], f["event_hit_T"][lo:hi]


def test_generator_writes_co_indexed_sensor_and_segment_shards(production):
    sensors = sorted((production / "muon" / "sensor").glob("wc_sensor_*.h5"))
    segs = sorted((production / "muon" / "seg").glob("wc_seg_*.h5"))
    assert [p.name for p in sensors] == [f"wc_sensor_{i:04d}.h5" for i in range(3)]
    assert [p.name for p in segs] == [f"wc_seg_{i:04d}.h5" for i in range(3)]
    with h5py.File(sensors[2]) as f, h5py.File(segs[2]) as g:
        assert f.attrs["n_events"] == g.attrs["n_events"] == 6  # 30 = 12 + 12 + 6
        assert f.attrs["n_sensors"] == 32 * 64 and f["config/pmt_positions"].shape == (2048, 3)
        assert set(g["pdg"][:]) == {13}
        assert np.all(f["particle_category"][:] == 1)
    # PMT positions lie on the barrel wall of the ring simulator's tank.
    positions = pmt_positions(_ring_for_lucid())
    assert np.allclose(np.hypot(positions[:, 0], positions[:, 1]), 400.0, atol=1e-3)
    # The same (seed, species, index) gives the same event: productions are reproducible.
    again = production / "again"
    generate_lucid(again, 30, "muon", events_per_file=12)
    for a, b in zip(_hits(sensors[1], 4), _hits(again / "sensor" / "wc_sensor_0001.h5", 4)):
        assert np.array_equal(a, b)


def test_response_mode_is_one_entry_per_pmt_with_summed_pe_and_first_time(production):
    ds = DATASETS.build(dict(type="LUCiDDataset", data_root=str(production / "electron")))
    assert len(ds) == 30
    item = ds[13]  # shard 1, event 1
    assert item["name"] == "wc_sensor_0001.h5_evt001" and item["split"] == ""
    assert item["coord"].shape == (2048, 3) and item["energy"].shape == (2048, 1) and item["time"].shape == (2048, 1)
    sensor, pe, t = _hits(production / "electron" / "sensor" / "wc_sensor_0001.h5", 1)
    assert len(sensor) > 20
    assert np.isclose(item["energy"].sum(), pe.sum(), rtol=1e-5)
    assert np.allclose(item["energy"][sensor, 0], pe) and np.allclose(item["time"][sensor, 0], t)
    unhit = np.setdiff1d(np.arange(2048), sensor)
    assert np.all(item["energy"][unhit] == 0) and np.all(item["time"][unhit] == -1)


def test_labels_separate_and_segment_modes(production):
    root = str(production / "muon")
    labels = LUCiDDataset(root, output_mode="labels")[3]
    assert set(labels) == {"coord", "energy", "segment", "instance", "time", "name", "split"}
    assert np.all(labels["segment"] == 1) and np.all(labels["instance"] == 0)  # one muon owns every hit
    thresholded = LUCiDDataset(root, output_mode="labels", pe_threshold=2.0)[3]
    assert 0 < len(thresholded["energy"]) < len(labels["energy"]) and thresholded["energy"].min() > 2.0
    seg = LUCiDDataset(root, modalities=("seg",))[3]
    assert seg["coord"].shape[1] == 3 and len(seg["coord"]) == len(seg["energy"]) == len(seg["pdg"]) > 1
    assert np.all(seg["pdg"] == 13) and np.all(seg["track_ids"] == 1) and np.all(seg["parent_ids"] == 0)
    both = LUCiDDataset(root, modalities=("seg", "sensor"), output_mode="separate")[3]
    assert {"seg3d.coord", "seg3d.pdg", "pmt_pe", "pmt_t", "pmt_coord", "pp_sensor_idx", "pp_category"} <= set(both)
    assert np.array_equal(both["seg3d.coord"], seg["coord"])
    kept = LUCiDDataset(root, modalities=("seg", "sensor"), min_segments=20)
    counts = [len(LUCiDDataset(root, modalities=("seg",))[i]["coord"]) for i in range(30)]
    assert len(kept) == sum(c >= 20 for c in counts) < 30
    assert LUCiDDataset(root, max_len=7, loop=3).__len__() == 21


def test_ssl_dataset_labels_by_config_and_holds_out_a_fixed_disjoint_set(production):
    common = dict(type="LUCiDEventSSLDataset", data_root=str(production), configs=["electron", "muon"],
                  holdout_events_per_config=5)
    train, val = DATASETS.build(dict(common, split="train")), DATASETS.build(dict(common, split="val"))
    assert (len(train), len(val)) == (50, 10) and train.class_names == ("electron", "muon")
    names_train = {train.get_data_name(i) for i in range(len(train))}
    names_val = {val.get_data_name(i) for i in range(len(val))}
    assert not names_train & names_val and len(names_train | names_val) == 60
    item = val[7]
    assert item["event_label"].tolist() == [1] and item["config_id"].tolist() == [1]
    assert item["name"].startswith("muon/wc_sensor_")
    # One point per hit PMT, at its position; energy is its PE.
    assert len(np.unique(item["sensor_idx"])) == len(item["coord"])
    positions = pmt_positions(_ring_for_lucid())
    assert np.allclose(item["coord"], positions[item["sensor_idx"]])
    del train  # alive, it would share events with a tail holdout (refused: tests/test_hardening_r6_data.py)
    tail = DATASETS.build(dict(common, split="test", holdout_strategy="tail"))
    assert [tail.get_data_name(i).split("/")[1] for i in range(5)] == [
        f"wc_sensor_0002.h5_evt{e:03d}" for e in range(1, 6)]
    capped = DATASETS.build(dict(common, split="all", max_events_per_config=4, min_points=10))
    assert len(capped) == 8


def test_hit_aggregation_sums_pe_and_takes_the_earliest_time(tmp_path):
    root = tmp_path / "one"
    generate_lucid(root, 2, "muon")
    path = root / "sensor" / "wc_sensor_0000.h5"
    with h5py.File(path, "a") as f:  # give event 0 a second hit on its first PMT
        sensor, pe, t = (f[k][:] for k in ("event_hit_sensor_idx", "event_hit_PE", "event_hit_T"))
        offsets = f["event_hit_offsets"][:]
        for key, value in (("event_hit_sensor_idx", sensor[0]), ("event_hit_PE", 7.0), ("event_hit_T", t[0] - 3)):
            data = np.insert(f[key][:], offsets[1], value)
            del f[key]
            f[key] = data
        offsets[1:] += 1
        f["event_hit_offsets"][...] = offsets
    agg = LUCiDEventSSLDataset(tmp_path, ["one"], split="all")[0]
    raw = LUCiDEventSSLDataset(tmp_path, ["one"], split="all", aggregate_sensor_hits=False)[0]
    assert len(raw["coord"]) == len(agg["coord"]) + 1
    first = agg["sensor_idx"] == sensor[0]
    assert np.isclose(agg["energy"][first, 0], pe[0] + 7.0) and np.isclose(agg["time"][first, 0], t[0] - 3)
    mean = LUCiDEventSSLDataset(tmp_path, ["one"], split="all", time_aggregation="mean")[0]
    assert np.isclose(mean["time"][mean["sensor_idx"] == sensor[0], 0], t[0] - 1.5)


def test_bad_shards_and_options_are_one_line_naming_the_file(production, tmp_path):
    def message(call):
        with pytest.raises(UserError) as info:
            call()
        text = str(info.value)
        assert "\n" not in text
        return text

    broken = tmp_path / "broken"
    generate_lucid(broken, 20, "electron", events_per_file=10)
    (broken / "seg" / "wc_seg_0001.h5").unlink()
    text = message(lambda: LUCiDDataset(broken, modalities=("sensor", "seg")))
    assert "not co-indexed" in text and "2 sensor shard(s)" in text and "1 segment shard(s)" in text
    generate_lucid(tmp_path / "short", 8, "electron")
    (broken / "seg" / "wc_seg_0001.h5").write_bytes((tmp_path / "short" / "seg" / "wc_seg_0000.h5").read_bytes())
    text = message(lambda: LUCiDDataset(broken, modalities=("sensor", "seg")))
    assert "wc_sensor_0001.h5 has 10 events but" in text and "wc_seg_0001.h5 has 8" in text
    assert "no LUCiD seg shards in" in message(lambda: LUCiDDataset(production / "muon" / "sensor",
                                                                    modalities=("seg",)))
    junk = tmp_path / "junk" / "sensor"
    junk.mkdir(parents=True)
    with h5py.File(junk / "wc_sensor_0000.h5", "w") as f:
        f["something"] = np.zeros(3)
    text = message(lambda: LUCiDDataset(junk.parent))
    assert "wc_sensor_0000.h5 is not a LUCiD sensor shard: it lacks event_hit_offsets" in text
    (junk / "wc_sensor_0000.h5").write_bytes(b"not hdf5")
    assert "cannot open" in message(lambda: LUCiDDataset(junk.parent))
    assert "is not a folder" in message(lambda: LUCiDDataset(tmp_path / "nowhere"))
    for bad in (dict(test_mode=True), dict(output_mode="labels", include_labels=False), dict(modalities=("pmt",))):
        with pytest.raises(ConfigError):
            LUCiDDataset(production / "muon", **bad)
    with pytest.raises(ConfigError, match="test_mode=True is not supported"):
        LUCiDEventSSLDataset(production, ["muon"], test_mode=True)
    assert "keeps no event" in message(lambda: LUCiDEventSSLDataset(production, ["muon"], split="val"))
    assert "config 'tau' reads" in message(lambda: LUCiDEventSSLDataset(production, ["muon", "tau"]))


def test_make_lucid_command_writes_shards_and_refuses_to_overwrite(tmp_path):
    cmd = [sys.executable, str(ROOT / "tools" / "make_lucid.py"), "--out", str(tmp_path / "d"), "--num-events", "5",
           "--species", "muon", "--image-size", "8", "16"]
    done = forkserver.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert LUCiDDataset(tmp_path / "d" / "muon")[0]["coord"].shape == (8 * 16, 3)
    again = forkserver.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT)
    assert again.returncode == 2 and again.stderr.strip().count("\n") == 0
    assert "already exists; choose another --out or pass --overwrite" in again.stderr
    bad = forkserver.run(cmd[:-3] + ["--species", "tau"], capture_output=True, text=True, env=env(), cwd=ROOT)
    assert bad.returncode == 2 and "--species 'tau' is not one of electron, muon" in bad.stderr


def _config(tmp_path, production, save, extra="", workers=0):
    path = tmp_path / f"cfg_{save.name}.py"
    root = str(production)
    path.write_text(f"_base_ = {str(ROOT / 'configs' / 'lucid' / 'cls-pmt-grid.py')!r}\n"
                    f"save_path = {str(save)!r}\nepoch = 2\nbatch_size = 8\nbatch_size_val = 16\nnum_worker = {workers}\n"
                    f"_small = dict(data_root={root!r}, holdout_events_per_config=5)\n"
                    "data = dict(train=_small, val=_small, test=_small)\n"
                    "model = dict(width=4, depth=2)\n"
                    "default_hooks = dict(checkpoint=dict(save_freq=3))\n"
                    "hooks = [dict(type='ClsEvaluator', num_classes=2, target_key='event_label')]\n" + extra)
    return path


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_shipped_config_resumes_mid_epoch_bit_identically(tmp_path, production, workers):
    """50 training events in batches of 8: 6 full steps per epoch; killed at step 5
    (mid-epoch, after the step-3 checkpoint), resumed, compared with a clean run."""
    reference = tmp_path / "ref"
    done = run_tool("train", _config(tmp_path, production, reference, workers=workers))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [s for s, _ in train_losses(reference)] == list(range(1, 13))
    crashed = tmp_path / "crashed"
    cfg = _config(tmp_path, production, crashed, 'custom_imports = ["tests.support.toy"]\n'
                  'hooks = hooks + [dict(type="KillAtStep", step=5, wait_for_commit=True)]\n', workers=workers)
    assert run_tool("train", cfg).returncode == -9
    resumed = run_tool("train", cfg, "resume=True", "hooks.KillAtStep.step=-1")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "Resumed from step000000003" in (crashed / "train.log").read_text()
    want, got = final_weights(reference), final_weights(crashed)
    assert all(torch.equal(want["state_dict"][k], got["state_dict"][k]) for k in want["state_dict"])
    assert train_losses(reference) == train_losses(crashed)


def test_pmt_grid_classifier_puts_each_hit_on_its_pmt_of_its_event():
    from pimm.models.pmt_grid import PMTGridClassifier

    model = PMTGridClassifier(grid=(4, 8), width=4, depth=1)
    batch = dict(sensor_idx=torch.tensor([0, 9, 31, 5]), energy=torch.tensor([[1.0], [3.0], [7.0], [2.0]]),
                 time=torch.tensor([[20.0], [40.0], [0.0], [-20.0]]), offset=torch.tensor([3, 4]),
                 event_label=torch.tensor([0, 1]))
    img = model.image(batch)
    assert img.shape == (2, 2, 4, 8)
    assert img[0, 0, 1, 1] == torch.log1p(torch.tensor(3.0)) and img[0, 1, 1, 1] == 2.0  # sensor 9 = row 1, col 1
    assert img[0, 0, 3, 7] == torch.log1p(torch.tensor(7.0)) and img[1, 1, 0, 5] == -1.0
    assert int((img[:, 0] != 0).sum()) == 4
    out = model(batch)
    assert out["cls_logits"].shape == (2, 2) and out["loss"].requires_grad
    with pytest.raises(UserError, match="set model.grid"):
        model.image(dict(batch, sensor_idx=torch.tensor([0, 9, 32, 5])))
