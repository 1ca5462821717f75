"""Checkpoint retention modes (``CheckpointSaver(keep_last, keep_best,
keep_every, keep_all)``): best only, last N, all, every K-th forever; never
a deletion before the new checkpoint is committed; on resume, leftovers of
another mode follow the current one, without ever deleting the checkpoint
the run resumed from.

Manager-level tests save tiny checkpoints directly; the trainer-level ones
run the toy task in-process (4 steps per epoch) with ``ScriptedEvaluator``
so the best step is known.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.engines.state.manager as manager_module  # noqa: E402
from pimm.engines.hooks.base import build_hooks  # noqa: E402
from pimm.engines.state.manager import CheckpointManager, Retention  # noqa: E402
from pimm.utils.errors import RegistryError  # noqa: E402
from tests.support import inprocess  # noqa: E402
from tests.support.participants import Counter  # noqa: E402


def manager_with(directory: Path, **retention) -> tuple[CheckpointManager, Counter]:
    manager = CheckpointManager(directory, retention=Retention(**retention), logger=logging.getLogger("test"))
    counter = Counter()
    manager.register("counter", counter)
    return manager, counter


def save(manager, counter, steps, best=()):
    for step in steps:
        counter.value = step
        manager.save(step, step // 10, extra_manifest={"is_best": step in best})


def steps_of(manager) -> list[int]:
    return [int(p.name[4:13]) for p in manager.committed()]


# -- the modes ----------------------------------------------------------------------------------
def test_best_only_keeps_the_newest_and_the_best(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=True)
    save(manager, counter, [10, 20, 30], best={20})
    assert steps_of(manager) == [20, 30]
    save(manager, counter, [40], best={40})  # the newest is the best: one checkpoint
    assert steps_of(manager) == [40]
    save(manager, counter, [50])
    assert steps_of(manager) == [40, 50]


def test_last_n(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=3, keep_best=False)
    save(manager, counter, [10, 20, 30, 40, 50], best={10})
    assert steps_of(manager) == [30, 40, 50]


def test_all(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False, keep_all=True)
    save(manager, counter, [10, 20, 30, 40])
    assert steps_of(manager) == [10, 20, 30, 40]


def test_every_kth_is_kept_forever_beside_the_newest(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False, keep_every=20)
    save(manager, counter, [10, 20, 30, 40, 50, 55])
    assert steps_of(manager) == [20, 40, 55]
    save(manager, counter, [60, 65])
    assert steps_of(manager) == [20, 40, 60, 65]


def test_every_kth_uses_the_step_in_the_folder_name_even_without_a_readable_manifest(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False, keep_every=20)
    save(manager, counter, [20])
    (manager.committed()[0] / "COMMITTED").write_text("{not json")
    save(manager, counter, [30, 50])
    assert steps_of(manager) == [20, 50]


def test_modes_combine(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=2, keep_best=True, keep_every=25)
    save(manager, counter, [10, 20, 25, 30, 40, 50, 60], best={20})
    assert steps_of(manager) == [20, 25, 50, 60]


def test_no_deletion_happens_before_the_new_checkpoint_is_committed(tmp_path, monkeypatch):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False)
    save(manager, counter, [10])
    original = manager_module._save_synced

    def crash(obj, path):
        raise OSError("disk full")

    monkeypatch.setattr(manager_module, "_save_synced", crash)
    with pytest.raises(OSError):
        save(manager, counter, [20])
    monkeypatch.setattr(manager_module, "_save_synced", original)
    assert steps_of(manager) == [10]  # the failed save deleted nothing
    assert manager.load_latest().common["counter"]["value"] == 10


def test_a_deletion_killed_halfway_never_looks_committed(tmp_path, monkeypatch):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False)
    save(manager, counter, [10])
    real_rmtree = manager_module.shutil.rmtree

    def killed_halfway(path, ignore_errors=False):
        if Path(path).name.startswith(".deleting-"):
            (Path(path) / "common.pth").unlink()  # part of the folder is gone, then the process dies
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(manager_module.shutil, "rmtree", killed_halfway)
    with pytest.raises(KeyboardInterrupt):
        save(manager, counter, [20])
    monkeypatch.setattr(manager_module.shutil, "rmtree", real_rmtree)
    assert steps_of(manager) == [20] and (tmp_path / ".deleting-step000000010-epoch0001").is_dir()
    fresh, _ = manager_with(tmp_path, keep_last=1, keep_best=False)
    assert fresh.load_latest().common["counter"]["value"] == 20 and fresh.rejected == []
    fresh.apply_retention()  # the leftover goes at the next chance
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000020-epoch0002"]


def test_keep_last_must_be_at_least_one():
    with pytest.raises(RegistryError, match=r"keep_last must be at least 1, got 0 \(resume needs the newest "
                                            r"checkpoint; 'best only' is keep_last=1, keep_best=True\)"):
        build_hooks([dict(type="CheckpointSaver", keep_last=0)])


# -- resume: leftovers follow the current mode --------------------------------------------------
def test_on_resume_leftovers_of_another_mode_follow_the_new_one(tmp_path):
    old, counter = manager_with(tmp_path, keep_all=True)
    save(old, counter, [10, 20, 30, 40, 50], best={20})
    assert steps_of(old) == [10, 20, 30, 40, 50]
    new, _ = manager_with(tmp_path, keep_last=1, keep_best=True)
    new.load_latest()
    new.apply_retention()  # what the trainer does at start-up of a resumed run
    assert steps_of(new) == [20, 50]


def test_on_resume_a_damaged_newest_checkpoint_never_costs_the_one_resumed_from(tmp_path):
    manager, counter = manager_with(tmp_path, keep_last=1, keep_best=False)
    save(manager, counter, [10])
    manager.retention = Retention(keep_all=True)
    save(manager, counter, [20])
    damaged = manager.committed()[-1]
    (damaged / "common.pth").write_bytes(b"garbage")
    resumed, resumed_counter = manager_with(tmp_path, keep_last=1, keep_best=False)
    loaded = resumed.load_latest()
    assert loaded.path.name.startswith("step000000010") and [p for p, _ in resumed.rejected] == [damaged]
    resumed.apply_retention()
    assert steps_of(resumed) == [10, 20]  # 10 resumed from: kept; 20 unusable: left for inspection
    save(resumed, resumed_counter, [20])  # the resumed run re-saves step 20: the damaged one is moved aside
    assert steps_of(resumed) == [20]
    assert resumed.load_latest().common["counter"]["value"] == 20
    assert [p.name for p in tmp_path.glob(".damaged-*")] == ["." + "damaged-" + damaged.name + "-1"]


def make_trainer(directory: Path, saver: str, options=()):
    hooks = f'[dict(type="ScriptedEvaluator", values=[0.1, 0.9, 0.5, 0.4, 0.3, 0.2], every_n_steps=2), {saver}]'
    return inprocess.make_trainer(directory, hooks, options=options, epoch=3)


def test_trainer_retention_with_the_best_and_a_resume_under_another_mode(tmp_path):
    # Checkpoints every 2 steps (2, 4, ..., 12); the best score (0.9) is at step 4.
    first = make_trainer(tmp_path, 'dict(type="CheckpointSaver", save_freq=2, keep_all=True)')
    first.train()
    assert steps_of(first.checkpointer) == [2, 4, 6, 8, 10, 12]
    # The same run resumed under "best only" with nothing left to train: the
    # start-up alone prunes the leftovers.
    resumed = make_trainer(tmp_path, 'dict(type="CheckpointSaver", save_freq=2, keep_last=1, keep_best=True)',
                           options=["resume=True"])
    resumed.train()
    assert resumed.global_step == 12
    assert steps_of(resumed.checkpointer) == [4, 12]
    # Extended by an epoch under "every 6th forever + last 2".
    extended = make_trainer(tmp_path, 'dict(type="CheckpointSaver", save_freq=2, keep_last=2, keep_best=False, '
                                      'keep_every=6)', options=["resume=True", "epoch=4"])
    extended.train()
    assert steps_of(extended.checkpointer) == [12, 14, 16]  # 4 is neither among the last 2 nor a multiple of 6
