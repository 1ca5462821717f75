"""The engine's own per-step and per-flush work, as deterministic budgets
(Python calls, files written, manifests read), never as wall-clock times:
what ``bench/overhead.py`` and ``bench/peers.py`` measure in time on a 1 ms
step, pinned here so a change that adds work to every step, every logged
record or every checkpoint is seen in review."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from pimm.engines.loop.trainer_base import TrainerBase
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.observe.writers import MetricsWriter
from pimm.engines.state import manager as manager_module
from pimm.engines.state.manager import CheckpointManager, Retention
from tests.support.inprocess import make_trainer
from tests.support.participants import Counter

ENGINE = str(Path(manager_module.__file__).resolve().parents[1])  # pimm/engines


def pimm_calls(fn) -> int:
    """Python function calls made in the engine's code (pimm/engines) while ``fn()`` runs."""
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_filename.startswith(ENGINE):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_a_flush_makes_no_python_call_of_its_own_per_record(tmp_path):
    """Reducing, writing (metrics.jsonl, TensorBoard) and checking a flush's
    dense records costs a fixed number of pimm calls, whatever their number
    (it was about ten per record: a helper per value and per tag)."""
    writer = MetricsWriter(tmp_path, enable_tensorboard=True)
    channel = MetricChannel(sink=writer.write)
    step = 0

    def flush_of(records: int) -> int:
        nonlocal step
        for _ in range(records):
            step += 1
            channel.step = step
            channel.publish({"train/loss": torch.tensor(0.5 + step), "train/lr": 1e-3 / step}, dense=True)
        return pimm_calls(channel.flush)

    flush_of(5)  # opens the sinks
    assert flush_of(30) == flush_of(10)
    channel.publish({"train/loss": torch.tensor(float("nan")), "train/lr": 1.0}, dense=True, step=step + 1)
    channel.watch_finite.clear()  # the NaN is written, not raised
    channel.flush()
    writer.close()
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines] == list(range(1, step + 2))
    assert lines[0] == {"step": 1, "epoch": 0, "train/loss": 1.5, "train/lr": 1e-3}
    assert lines[-1]["train/loss"] is None  # a non-finite value is null: every line stays JSON


def test_a_training_step_stays_within_its_budget_of_pimm_calls(tmp_path):
    """A step with every default hook (no flush, no checkpoint in it) makes at
    most 34 calls into the engine's code: the loop, run_step and its parts, the
    hooks, the loader's fetch, the schedule (the data set and collate are not
    counted). 53 before the hot path skipped CommInfo's per-key check for the
    trainer's own keys. The hooks read ``trainer.iter`` / ``global_step``
    (properties: a call each), the contract upstream's hooks and trainers
    share. Raise the budget only for work every step must do."""
    trainer = make_trainer(tmp_path, "[]", extra="data['train']['num_samples'] = 640\n", epoch=1)
    trainer.restore()
    trainer.call_hooks("before_train")
    trainer.open_outputs()
    trainer.start_epoch_data()
    trainer.run_step()  # the first forward pass is checked once; not a steady-state step
    trainer.train_state.global_step = trainer.train_state.iter_in_epoch = 1
    trainer.iters_per_epoch = 19  # steps 2..19: no log flush (every 20), no epoch end
    calls = pimm_calls(lambda: TrainerBase.run_epoch(trainer))
    assert trainer.train_state.global_step == 19
    assert calls / 18 <= 34, f"{calls / 18:.1f} engine calls per step"
    trainer.close()


def test_a_single_process_checkpoint_writes_no_done_marker(tmp_path, monkeypatch):
    """Rank 0 reads the other ranks' done-markers before it commits; its own
    entries it already holds, so a single process writes only its files and
    the manifest (a marker is one more file, fsync and rename per save)."""
    written = []
    original = manager_module._write_json_synced

    def record(obj, path):
        written.append(Path(path).name)
        return original(obj, path)

    monkeypatch.setattr(manager_module, "_write_json_synced", record)
    counter = Counter()
    manager = CheckpointManager(tmp_path)
    manager.register("counter", counter)
    counter.value = 3
    manager.save(7, 1)
    assert written == ["COMMITTED"]
    manifest = json.loads((tmp_path / "step000000007-epoch0001" / "COMMITTED").read_text())
    assert sorted(manifest["files"]) == ["common.pth", "rank00000.pth"]
    assert manager.verify(tmp_path / "step000000007-epoch0001") == "ok"
    counter.value = 0
    assert manager.load_latest().common["counter"]["value"] == 3


def test_retention_reads_no_manifest_while_every_checkpoint_is_kept(tmp_path, monkeypatch):
    """Up to ``keep_last`` committed checkpoints nothing can be deleted, so a
    save reads no manifest (every save of a short run); past it, the policy
    reads them and deletes as before."""
    reads = []
    original = CheckpointManager._read_manifest
    monkeypatch.setattr(CheckpointManager, "_read_manifest",
                        staticmethod(lambda path: reads.append(Path(path).name) or original(path)))
    manager = CheckpointManager(tmp_path, retention=Retention(keep_last=2, keep_best=True))
    manager.register("counter", Counter())
    manager.save(1, 1)
    manager.save(2, 1)
    assert reads == []
    manager.save(3, 1)
    assert len(reads) == 3
    assert [p.name for p in manager.committed()] == ["step000000002-epoch0001", "step000000003-epoch0001"]
