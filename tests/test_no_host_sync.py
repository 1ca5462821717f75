"""No host-device synchronisation in the training step.

Whole trainings run on the CPU under :class:`tests.support.sync_watch.SyncWatch`,
which follows which tensors would live on a GPU (model parameters, the batch
the trainer moved to its device, everything computed from them) and records
every read of their values on the host (``.item()``, ``bool()``, ``.tolist()``,
``.cpu()``, boolean-mask indexing, ``torch.cuda.synchronize()``, ...). Reads
are allowed only inside the moments the engine marks
(:mod:`pimm.engines.sync_points`): a metric flush, an evaluation, a
checkpoint, a GRPO rollout. Each trainer runs 100 steps with the default hooks
plus an evaluator and periodic checkpoints, so every kind of moment happens.

The shipped sparse models (SparseUNet, PointGroupLite) build their kernel maps
and clusters on the host from the batch's coordinates: those syncs belong to
the model, not to the trainer (spconv and MinkowskiEngine do the same), and
the InsegTrainer case checks that they are the only ones.
"""

from __future__ import annotations

import pytest
import torch

from pimm.engines import sync_points
from pimm.engines.hooks import HookBase
from tests.support.sync_runs import SPARSE, default_hooks, grpo_trainer, inseg_trainer, toy_trainer
from tests.support.sync_watch import SyncWatch, mark


def watched_train(trainer, monkeypatch) -> SyncWatch:
    """Train ``trainer`` under a :class:`SyncWatch`; its model and every batch it moves
    to its device are the device tensors."""
    model = trainer.model_without_ddp
    mark(list(model.parameters()) + list(model.buffers()))
    to_device = trainer.to_device

    def to_device_marked(batch):
        batch = to_device(batch)
        mark(batch)
        return batch

    monkeypatch.setattr(trainer, "to_device", to_device_marked)
    watch = SyncWatch()
    monkeypatch.setattr(torch.cuda, "synchronize", watch.cuda_synchronize)
    with watch:
        trainer.train()
    assert not sync_points.open_moments(), "a host_sync moment was left open"
    return watch


def _report(watch: SyncWatch) -> str:
    seen: dict[str, int] = {}
    for violation in watch.violations:
        seen[str(violation)] = seen.get(str(violation), 0) + 1
    return "\n".join(f"{n}x {text}" for text, n in sorted(seen.items(), key=lambda kv: -kv[1])[:15])


def test_default_trainer_steps_make_no_host_sync(tmp_path, monkeypatch):
    trainer = toy_trainer(tmp_path)
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 100
    assert not watch.violations, "host syncs outside a flush/evaluation/checkpoint:\n" + _report(watch)
    # The moments did happen (and read device values): the watch sees real syncs.
    assert {"metric flush", "evaluation", "checkpoint"} <= set(watch.allowed)


class _ReadsLoss(HookBase):
    """A hook that reads the loss on the host every step, and does host bookkeeping."""

    def after_step(self):
        sizes = torch.tensor([3, 5, 2])  # host data (like a collate's offsets): reading it is free
        assert torch.cumsum(sizes, 0).tolist() == [3, 8, 10] and int(sizes.sum()) == 10
        if self.trainer.global_step % 2 == 0:
            float(self.trainer.comm_info["loss"])  # a device value: one sync per call
        else:
            torch.zeros(2, device=self.trainer.device).sum().item()  # made on the trainer's device


def test_the_watch_flags_a_read_of_a_device_value_and_not_host_bookkeeping(tmp_path, monkeypatch):
    trainer = toy_trainer(tmp_path, "data.train.num_samples=96", "epoch=1", hooks=default_hooks(save_freq=None))
    trainer.register_hooks([_ReadsLoss()])
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 6
    assert [v.what for v in watch.violations] == ["item()", "__float__()"] * 3  # steps 1, 2, ... 6
    assert all(v.where[0].endswith("after_step") and "test_no_host_sync.py" in v.where[0] for v in watch.violations)


def test_marked_moments_nest_unwind_on_errors_and_tell_observers_the_outermost_edges():
    edges = []
    with sync_points.on_moments(edges.append):
        with sync_points.host_sync("checkpoint"):
            with sync_points.host_sync("metric flush"):
                assert sync_points.open_moments() == ("checkpoint", "metric flush")
        with pytest.raises(ValueError), sync_points.host_sync("evaluation"):
            raise ValueError
    with sync_points.host_sync("evaluation"):  # the observer is gone
        pass
    assert edges == [True, False, True, False]
    assert not sync_points.sync_allowed() and sync_points.open_moments() == ()


# -- InsegTrainer ------------------------------------------------------------
@pytest.mark.slow
def test_inseg_trainer_steps_make_no_host_sync(tmp_path, monkeypatch):
    trainer = inseg_trainer(tmp_path)
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 100
    assert not watch.violations, "host syncs outside a flush/evaluation/checkpoint:\n" + _report(watch)
    assert {"metric flush", "evaluation", "checkpoint"} <= set(watch.allowed)


def test_step_tracing_counts_points_without_a_sync(tmp_path, monkeypatch):
    """structured_logging's per-step batch counter takes the points from a shape."""
    trainer = inseg_trainer(tmp_path, "epoch=1", "data.train.num_events=16", "structured_logging.enabled=True")
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 8
    assert not watch.violations, _report(watch)


@pytest.mark.slow
def test_inseg_trainer_adds_no_sync_to_a_sparse_model_that_makes_its_own(tmp_path, monkeypatch):
    trainer = inseg_trainer(tmp_path, "epoch=1", "data.train.num_events=12", model=SPARSE)
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 6 and watch.violations  # kernel maps, clustering: the model's own
    outside = [v for v in watch.violations if not v.where[0].startswith("models/")]
    assert not outside, "\n".join(map(str, outside[:10]))


# -- GRPOTrainer ---------------------------------------------------------------
@pytest.mark.slow
def test_grpo_trainer_updates_make_no_host_sync(tmp_path, monkeypatch):
    trainer = grpo_trainer(tmp_path)
    watch = watched_train(trainer, monkeypatch)
    assert trainer.global_step == 100
    assert not watch.violations, "host syncs outside a rollout/flush/checkpoint:\n" + _report(watch)
    assert {"rollout", "metric flush", "checkpoint"} <= set(watch.allowed)
