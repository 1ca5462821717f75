"""CheckpointManager and atomic_torch_save, in process (single rank).

A checkpoint is either complete or ignored: these tests interrupt a save at
every point where a process could die (each file, the manifest, the
rename), damage committed checkpoints in the ways a disk or a killed copy
can, and check that ``load_latest`` only ever returns a complete one.
An exception raised from inside ``save`` leaves the same files on disk as a
kill at that point: ``save`` has no clean-up path.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path

import pytest
import torch

import pimm.engines.state.manager as ckpt
from pimm.engines.state.manager import CheckpointManager, atomic_torch_save
from tests.support.participants import Counter


class Crash(Exception):
    """Stands for the process dying at the point where it is raised."""


@pytest.fixture
def logger():
    return logging.getLogger("test_checkpoint_manager")


def make_manager(directory: Path, logger, keep_last: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()  # non-empty optimizer state
    counter, position = Counter(), Counter()
    manager = CheckpointManager(directory, retention=ckpt.Retention(keep_last=keep_last), logger=logger)
    manager.register("model", model)
    manager.register("optimizer", optimizer)
    manager.register("counter", counter)
    manager.register("position", position, scope="rank")
    return manager, model, counter, position


def save_steps(manager, counter, steps, best=()):
    for step in steps:
        counter.value = step
        manager.save(step, step // 10, extra_manifest={"is_best": step in best})


def steps_of(manager) -> list[int]:
    return [int(p.name[4:13]) for p in manager.committed()]


# -- saving and restoring ----------------------------------------------------------
def test_save_and_restore_round_trip(tmp_path, logger):
    manager, model, counter, position = make_manager(tmp_path, logger)
    counter.value, position.value = 7, 70
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    optim_state = manager._shared["optimizer"].state_dict()
    path = manager.save(12, 3, extra_manifest={"is_best": True, "note": "x"})
    assert path == tmp_path / "step000000012-epoch0003"

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    counter.value = position.value = 0
    loaded = manager.load_latest()
    assert loaded.path == path
    manager.restore(loaded)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in weights.items())
    assert counter.value == 7 and position.value == 70
    restored_optim = manager._shared["optimizer"].state_dict()
    assert torch.equal(restored_optim["state"][0]["exp_avg"], optim_state["state"][0]["exp_avg"])

    # skip_rank_states (another world size) leaves per-rank participants alone.
    counter.value = position.value = -1
    manager.restore(loaded, skip_rank_states=True)
    assert counter.value == 7 and position.value == -1


def test_manifest_records_step_layout_and_file_sizes_and_checksums(tmp_path, logger):
    manager, *_ = make_manager(tmp_path, logger)
    path = manager.save(5, 1, extra_manifest={"is_best": False})
    manifest = json.loads((path / "COMMITTED").read_text())
    assert manifest["global_step"] == 5 and manifest["epoch"] == 1 and manifest["world_size"] == 1
    assert manifest["is_best"] is False
    assert set(manifest["files"]) == {"common.pth", "rank00000.pth"}
    for name, entry in manifest["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}
    # Rank files hold only the per-rank participants, common.pth the replicated ones.
    assert set(torch.load(path / "rank00000.pth", weights_only=True)) == {"position"}
    assert set(torch.load(path / "common.pth", weights_only=True)) == {"model", "optimizer", "counter"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # no temporary left


def test_saving_the_same_step_twice_keeps_the_first(tmp_path, logger):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [4])
    counter.value = 99
    manager.save(4, 0)
    assert manager.load_latest().common["counter"]["value"] == 4


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path, logger):
    manager, *_ = make_manager(tmp_path / "absent", logger)
    assert manager.committed() == [] and not manager.has_checkpoints()
    assert manager.load_latest() is None


# -- retention ---------------------------------------------------------------------
def test_retention_keeps_newest_and_newest_best(tmp_path, logger):
    manager, _, counter, _ = make_manager(tmp_path, logger, keep_last=2)
    save_steps(manager, counter, [10, 20, 30, 40, 50], best={20})
    assert steps_of(manager) == [20, 40, 50]
    save_steps(manager, counter, [60], best={60})  # a newer best replaces the old one
    assert steps_of(manager) == [50, 60]
    save_steps(manager, counter, [70, 80])
    assert steps_of(manager) == [60, 70, 80]


def test_retention_keep_last_one(tmp_path, logger):
    manager, _, counter, _ = make_manager(tmp_path, logger, keep_last=1)
    save_steps(manager, counter, [1, 2, 3])
    assert steps_of(manager) == [3]


# -- interrupted saves ---------------------------------------------------------------
def _fail_on(monkeypatch, name: str):
    original = ckpt._save_synced

    def save(obj, path):
        if Path(path).name == name:
            with open(path, "wb") as fh:  # half a file, as a kill mid-write leaves it
                fh.write(b"PK\x03\x04partial")
            raise Crash(name)
        return original(obj, path)

    monkeypatch.setattr(ckpt, "_save_synced", save)


def _fail_manifest(monkeypatch):
    def dump(*args, **kwargs):
        raise Crash("manifest")

    monkeypatch.setattr(ckpt.json, "dump", dump)


def _fail_rename(monkeypatch):
    original = ckpt.os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".tmp-"):
            raise Crash("rename")
        return original(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", replace)


@pytest.mark.parametrize("interrupt", [
    lambda mp: _fail_on(mp, "rank00000.pth"),
    lambda mp: _fail_on(mp, "common.pth"),
    _fail_manifest,
    _fail_rename,
], ids=["rank-file", "common-file", "manifest", "rename"])
def test_interrupted_save_is_never_resumed_from_and_is_cleaned_up(tmp_path, logger, monkeypatch, interrupt):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5])
    with monkeypatch.context() as mp:
        interrupt(mp)
        counter.value = 10
        with pytest.raises(Crash):
            manager.save(10, 1)
    assert [p.name for p in tmp_path.glob(".tmp-*")] == [".tmp-step000000010-epoch0001"]
    assert steps_of(manager) == [5]
    # A fresh manager (the resumed process) sees only the complete checkpoint.
    fresh, *_ = make_manager(tmp_path, logger)
    assert fresh.load_latest().common["counter"]["value"] == 5
    # The next save (of the same or another step) removes the leftover.
    save_steps(fresh, counter, [10])
    assert steps_of(fresh) == [5, 10]
    assert list(tmp_path.glob(".tmp-*")) == []


def test_complete_tmp_folder_is_not_a_checkpoint(tmp_path, logger):
    """Even with every file and a manifest, a folder that was never renamed into place is ignored."""
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5, 9])
    (tmp_path / "step000000009-epoch0000").rename(tmp_path / ".tmp-step000000009-epoch0000")
    assert steps_of(manager) == [5]
    assert manager.load_latest().path.name == "step000000005-epoch0000"
    save_steps(manager, counter, [12])
    assert list(tmp_path.glob(".tmp-*")) == []


# -- damaged checkpoints ----------------------------------------------------------------
def _truncate(path: Path):
    path.write_bytes(path.read_bytes()[:-10])


def _garble_header(path: Path):
    data = bytearray(path.read_bytes())
    data[:32] = bytes(32)
    path.write_bytes(bytes(data))


def _remove(path: Path):
    path.unlink()


@pytest.mark.parametrize("damage,file", [
    (_truncate, "common.pth"),
    (_truncate, "rank00000.pth"),
    (_garble_header, "common.pth"),
    (_garble_header, "rank00000.pth"),
    (_remove, "rank00000.pth"),
    (lambda p: p.write_text("{not json"), "COMMITTED"),
    (lambda p: p.write_text(json.dumps({"global_step": 9})), "COMMITTED"),
], ids=["truncated-common", "truncated-rank", "garbled-common", "garbled-rank", "missing-rank", "bad-manifest",
        "manifest-without-files"])
def test_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, logger, caplog, damage, file):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5, 9])
    damage(tmp_path / "step000000009-epoch0000" / file)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        loaded = manager.load_latest()
    assert loaded.path.name == "step000000005-epoch0000"
    assert loaded.common["counter"]["value"] == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "step000000009-epoch0000 cannot be resumed from" in warnings[0]
    assert [p.name for p, _ in manager.rejected] == ["step000000009-epoch0000"]


def test_folder_without_manifest_is_never_resumed_from_and_is_reported(tmp_path, logger, caplog):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5, 9])
    (tmp_path / "step000000009-epoch0000" / "COMMITTED").unlink()
    with caplog.at_level(logging.WARNING, logger=logger.name):
        assert manager.load_latest().path.name == "step000000005-epoch0000"
    assert steps_of(manager) == [5]
    assert [(p.name, "no COMMITTED manifest" in why) for p, why in manager.rejected] == \
        [("step000000009-epoch0000", True)]


def test_all_checkpoints_damaged_means_none_and_lists_why(tmp_path, logger):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5, 9])
    for path in manager.committed():
        _truncate(path / "common.pth")
    assert manager.load_latest() is None
    assert [p.name for p, _ in manager.rejected] == ["step000000009-epoch0000", "step000000005-epoch0000"]
    assert all("common.pth has" in why for _, why in manager.rejected)


@pytest.mark.parametrize("damage", ["truncate", "no-manifest"])
def test_saving_a_damaged_step_again_heals_it_and_keeps_the_damaged_copy_aside(tmp_path, logger, damage):
    manager, _, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5, 9])
    folder = tmp_path / "step000000009-epoch0000"
    if damage == "truncate":
        _truncate(folder / "common.pth")
    else:
        (folder / "COMMITTED").unlink()
    counter.value = 99
    manager.save(9, 0)  # before the fix: skipped (damaged copy kept forever) or crashed on the rename
    loaded = manager.load_latest()
    assert loaded.path == folder and loaded.common["counter"]["value"] == 99
    assert manager.rejected == []
    aside = [p.name for p in tmp_path.iterdir() if p.name.startswith(".damaged-")]
    assert aside == [".damaged-step000000009-epoch0000-1"]  # kept for inspection, never resumed from
    assert steps_of(manager) == [5, 9]


def test_garbled_tensor_bytes_are_detected(tmp_path, logger):
    """Same size, valid zip structure, wrong tensor bytes: only a checksum catches it."""
    manager, model, counter, _ = make_manager(tmp_path, logger)
    save_steps(manager, counter, [5])
    with torch.no_grad():
        model.weight.add_(1.0)
    save_steps(manager, counter, [9])
    common = tmp_path / "step000000009-epoch0000" / "common.pth"
    data = bytearray(common.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 8] = b"\xff" * 8  # lands in the serialized tensors, not in the zip directory
    common.write_bytes(bytes(data))
    assert manager.load_latest().path.name == "step000000005-epoch0000"


# -- atomic_torch_save --------------------------------------------------------------------
def test_atomic_torch_save_replaces_whole_files(tmp_path):
    target = tmp_path / "model" / "model_last.pth"
    atomic_torch_save({"v": torch.arange(3)}, target)
    atomic_torch_save({"v": torch.arange(5)}, target)
    assert torch.equal(torch.load(target, weights_only=True)["v"], torch.arange(5))
    assert [p.name for p in target.parent.iterdir()] == ["model_last.pth"]


def test_atomic_torch_save_interrupted_keeps_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "model_last.pth"
    atomic_torch_save({"v": torch.arange(3)}, target)
    before = target.read_bytes()
    original = ckpt._save_synced

    def half_written(obj, path):
        original(obj, path)
        Path(path).write_bytes(Path(path).read_bytes()[:20])
        raise Crash("killed while writing")

    monkeypatch.setattr(ckpt, "_save_synced", half_written)
    with pytest.raises(Crash):
        atomic_torch_save({"v": torch.arange(1000)}, target)
    assert target.read_bytes() == before
    assert torch.equal(torch.load(target, weights_only=True)["v"], torch.arange(3))
