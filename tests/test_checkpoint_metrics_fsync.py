"""At a checkpoint, metrics.jsonl's fsync runs on the checkpoint's writer, not
the training thread, and still before the commit that records the file's length
(issue 35: per-step work only when something consumes it)."""

from __future__ import annotations

import threading

import torch

from pimm.engines.observe import writers as writers_module
from pimm.engines.observe.writers import METRICS_FILE, MetricsWriter
from pimm.engines.state.manager import CheckpointManager


def _writer(tmp_path):
    writer = MetricsWriter(tmp_path, enable_tensorboard=False)
    writer.write([{"step": 1, "epoch": 1, "train/loss": 0.5}], [(True, "mean")])
    return writer


def _recording_fsync(monkeypatch):
    calls = []
    real = writers_module.os.fsync

    def fsync(fd):
        calls.append(threading.current_thread().name)
        real(fd)

    monkeypatch.setattr(writers_module.os, "fsync", fsync)
    return calls


def test_by_default_state_dict_fsyncs_itself(tmp_path, monkeypatch):
    calls = _recording_fsync(monkeypatch)
    writer = _writer(tmp_path)
    state = writer.state_dict()
    assert calls.count(threading.current_thread().name) == 1
    assert state["jsonl_bytes"] == (tmp_path / METRICS_FILE).stat().st_size > 0
    writer.close()


def test_deferred_fsync_runs_on_the_checkpoint_writer_before_the_commit(tmp_path, monkeypatch):
    calls = _recording_fsync(monkeypatch)
    writer = _writer(tmp_path / "run")
    writer.defer_fsync = True
    manager = CheckpointManager(tmp_path / "run" / "checkpoints", async_write=True)
    manager.register("writer", writer)
    manager.register("weights", _Holder())
    committed_when_synced = []

    def sync_then_look():
        writer.sync_pending()
        committed_when_synced.append(sorted(p.name for p in manager.directory.glob("*/COMMITTED")))

    manager.before_commit.append(sync_then_look)
    manager.save(global_step=1, epoch=0)
    main = threading.current_thread().name
    assert main not in calls  # nothing waited for the disk on the training thread
    manager.wait()
    # Every fsync (the checkpoint's files and metrics.jsonl) ran on the background writer.
    assert calls and main not in calls and set(calls) == {"checkpoint-writer"}
    assert committed_when_synced == [[]]  # ... before the manifest committed the checkpoint
    assert manager.committed() and writer._unsynced == []
    writer.close()


def test_close_syncs_what_no_commit_took(tmp_path, monkeypatch):
    calls = _recording_fsync(monkeypatch)  # (os.fsync of the whole process: count this thread's)
    main = threading.current_thread().name
    writer = _writer(tmp_path)
    writer.defer_fsync = True
    writer.state_dict()
    assert main not in calls and len(writer._unsynced) == 1
    writer.close()
    assert calls.count(main) == 1 and writer._unsynced == []


class _Holder:
    def __init__(self):
        self.w = torch.zeros(3)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, state):
        self.w = state["w"]
