"""``mix_prob`` (upstream's Mix3D-style event mixing) with instance segmentation and
the automatic choice of the mixing point collate; ``train/avg_pts`` (points per
sample) logged by the point-cloud trainers."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

import pimm.datasets  # noqa: F401  (registers)
import pimm.evaluation  # noqa: F401
import pimm.models  # noqa: F401
from pimm.datasets.collate import collate_fn, inseg_collate_fn, point_collate_fn
from pimm.engines.run.launch import build_trainer
from pimm.engines.run.runtime import apply_runtime_defaults, validate_runtime
from pimm.utils.config import Config
from tests.test_lartpc_trainers import BASE


def _event(instances: list[int]) -> dict:
    n = len(instances)
    return {"coord": torch.randn(n, 3), "feat": torch.ones(n, 1), "instance": torch.tensor(instances)}


def _ids(batch, event):
    offset = batch["offset"].tolist()
    start = offset[event - 1] if event else 0
    ids = batch["instance"][start:offset[event]]
    return set(ids[ids >= 0].tolist())


def test_inseg_collate_mixes_events_and_keeps_their_instances_apart():
    # every event numbers its instances from 0: mixing without care would merge particles
    batch = [_event([0, 0, 1, -1]), _event([0, 1, 1, 2]), _event([-1, 0]), _event([1, 0, 0]), _event([0, 0])]
    plain = inseg_collate_fn(batch)
    mixed = inseg_collate_fn(batch, mix_prob=1.0)
    assert plain["offset"].tolist() == [4, 8, 10, 13, 15]
    assert mixed["offset"].tolist() == [8, 13, 15]  # 0+1, 2+3, and the odd last one alone
    assert torch.equal(mixed["instance"], plain["instance"])  # ids are batch-unique before mixing
    assert _ids(mixed, 0) == _ids(plain, 0) | _ids(plain, 1) and not _ids(plain, 0) & _ids(plain, 1)
    assert len(_ids(mixed, 0)) == 2 + 3 and len(_ids(mixed, 1)) == 1 + 2
    assert mixed["num_instances"].tolist() == [5, 3, 1]  # summed per merged event
    assert (mixed["instance"] == -1).sum() == 2  # ignored points stay ignored
    np.random.seed(0)
    draws = [len(inseg_collate_fn(batch, mix_prob=0.5)["offset"]) for _ in range(40)]
    assert set(draws) == {3, 5}  # mixed or not, with the global numpy RNG


def _trainer(tmp_path, text: str, **overrides):
    path = tmp_path / "cfg.py"
    path.write_text(BASE + text + f"\nsave_path = {str(tmp_path / 'run')!r}\n")
    cfg = Config.fromfile(path)
    apply_runtime_defaults(cfg)
    cfg.hooks = []
    cfg.update(overrides)
    validate_runtime(cfg, 1)
    return build_trainer(cfg)


INSEG = """
train = dict(type="InsegTrainer")
model = dict(type="PointGroupLite", num_classes=5, backbone=_backbone)
batch_size = 4
"""


def test_inseg_trainer_trains_with_mixed_events_and_validates_unmixed(tmp_path):
    trainer = _trainer(tmp_path, INSEG, mix_prob=1.0, epoch=1)
    try:
        collate = trainer.train_loader.collate_fn
        assert isinstance(collate, functools.partial) and collate.func is inseg_collate_fn
        assert collate.keywords == {"mix_prob": 1.0}
        assert trainer.val_loader.collate_fn is inseg_collate_fn  # validation never mixes
        trainer.train()
        batch = trainer.comm_info["input_dict"]
        assert len(batch["offset"]) == 2 and batch["num_instances"].shape == (2,)  # 4 events -> 2
        for event in range(2):
            assert len(_ids(batch, event)) == int(batch["num_instances"][event])
    finally:
        trainer.close()
    logged = [r for r in _jsonl(tmp_path / "run") if "train/loss" in r]
    assert len(logged) == 1 and np.isfinite(logged[0]["train/loss"])
    # points per (mixed) sample, from the batch the step trained on
    assert logged[0]["train/avg_pts"] == pytest.approx(float(batch["offset"][-1]) / 2)


def _jsonl(save):
    return [json.loads(line) for line in open(save / "metrics.jsonl")]


SEMSEG = """
model = dict(type="DefaultSegmentor", num_classes=5, backbone=_backbone)
"""


def test_mix_prob_picks_the_point_collate_for_point_data_and_avg_pts_is_logged(tmp_path):
    trainer = _trainer(tmp_path, SEMSEG, mix_prob=0.5, epoch=1, grad_accum_steps=2, batch_size=1)
    try:
        assert trainer.train_loader.dataset.collate_fn is collate_fn  # the data set's own: no mixing
        collate = trainer.train_loader.collate_fn
        assert isinstance(collate, functools.partial) and collate.func is point_collate_fn
        assert collate.keywords == {"mix_prob": 0.5}
        sizes = []
        real = trainer.next_batch

        def recording():
            batch = real()
            sizes.append((int(batch["offset"][-1]), len(batch["offset"])))
            return batch

        trainer.next_batch = recording
        trainer.train()
    finally:
        trainer.close()
    logged = [r["train/avg_pts"] for r in _jsonl(tmp_path / "run") if "train/loss" in r]
    # 6 events of one per batch, 2 batches per step: avg_pts is over both micro-batches
    expected = [(sizes[i][0] + sizes[i + 1][0]) / (sizes[i][1] + sizes[i + 1][1]) for i in range(0, 6, 2)]
    assert logged == pytest.approx(expected)
