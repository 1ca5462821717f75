"""OOM back-off (``train.oom_backoff``): a step that runs out of memory is redone
with its batches split, and the update equals the unsplit one.

The out-of-memory errors are injected on CPU by ``OOMToyMLP``
(tests/support/toy.py), which raises ``torch.OutOfMemoryError`` for batches
above a size, in the forward or in the middle of the backward (after the last
layer's gradients were accumulated, so a retry that kept them would differ).
Trainers run in-process on 64 samples, batch 16, 2 epochs (8 steps).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import register_all  # noqa: E402
from pimm.datasets.collate import collate_fn, point_collate_fn, split_point_batch  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.optim.oom_backoff import OOMBackoff, find_splitter, split_by_leading_dim  # noqa: E402
from pimm.utils.errors import ConfigError, UserError  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402

register_all()  # models, data sets, evaluators

STEPS = 8
SMALL = """
epoch = 2
model = dict(type="OOMToyMLP", dropout=0.0)
data = dict(
    train=dict(type="ToyDataset", num_samples=64, noise_aug=0.1),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
)
optimizer = dict(type="SGD", lr=0.1, momentum=0.9)  # unlike Adam's, its update scales with the gradient
hooks = [dict(type="InformationWriter", log_frequency=1)]
"""


def make_trainer(directory: Path, model: str = "", train: str = "", extra: str = ""):
    directory.mkdir(parents=True, exist_ok=True)
    text = SMALL + (f"model = dict(type='OOMToyMLP', dropout=0.0, {model})\n" if model else "")
    text += f"train = dict(type='DefaultTrainer', {train})\n" + extra
    cfg_path = write_toy_config(directory, directory / "run", text)
    cfg, hooks = load_config(str(cfg_path), [], world_size=1)
    return build_trainer(cfg, hooks=hooks)


def trained(directory: Path, **kwargs):
    trainer = make_trainer(directory, **kwargs)
    trainer.train()
    return trainer


def records(trainer) -> list[dict]:
    return [json.loads(line) for line in open(trainer.save_path / "metrics.jsonl")]


def assert_close_weights(a, b):
    for (name, x), y in zip(a.model_without_ddp.state_dict().items(), b.model_without_ddp.state_dict().values()):
        assert torch.allclose(x, y, rtol=1e-5, atol=1e-6), f"{name} differs: max {(x - y).abs().max().item():.3g}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same training with batches that fit, per grad_accum_steps."""
    made = {}

    def get(accum: int = 1):
        if accum not in made:
            made[accum] = trained(tmp_path_factory.mktemp(f"ref{accum}"), extra=f"grad_accum_steps = {accum}\n")
        return made[accum]

    return get


@pytest.mark.parametrize("fail_in", ["forward", "backward"])
def test_a_step_that_runs_out_of_memory_is_redone_in_halves_with_the_same_update(tmp_path, reference, fail_in):
    ref = reference()
    run = trained(tmp_path, model=f"max_samples=8, fail_in={fail_in!r}", train="oom_backoff=dict(max_splits=1)")
    model = run.model_without_ddp
    assert model.sizes == [16, 8, 8] * STEPS  # every step: the failed attempt, then two halves
    assert_close_weights(run, ref)
    assert model.leaks == 0, "an activation of the failed attempt was still alive when the retry began"
    losses = {r["step"]: r["train/loss"] for r in records(run) if "train/loss" in r}
    ref_losses = {r["step"]: r["train/loss"] for r in records(ref) if "train/loss" in r}
    assert losses.keys() == ref_losses.keys() == set(range(1, STEPS + 1))
    assert all(losses[s] == pytest.approx(ref_losses[s], rel=1e-5) for s in losses)
    assert [r["train/oom_retries"] for r in records(run) if "train/oom_retries" in r] == list(range(1, STEPS + 1))


def test_batches_are_halved_again_up_to_max_splits(tmp_path, reference):
    run = trained(tmp_path, model="max_samples=4", train="oom_backoff=dict(max_splits=2)")
    assert run.model_without_ddp.sizes[:7] == [16, 8, 4, 4, 4, 4, 16]  # 16 fails, halves fail, quarters fit
    assert_close_weights(run, reference())


def test_with_gradient_accumulation_the_whole_step_is_redone(tmp_path, reference):
    # The second micro-batch of the first step fails after the first one's gradients were
    # accumulated: both are redone in halves, from zeroed gradients, and no batch is skipped.
    run = trained(tmp_path, model="max_samples=8, from_call=1", train="oom_backoff=dict(max_splits=1)",
                  extra="grad_accum_steps = 2\nbatch_size = 8\n")
    ref = trained(tmp_path / "ref", extra="grad_accum_steps = 2\nbatch_size = 8\n")
    assert run.model_without_ddp.sizes == ref.model_without_ddp.sizes  # batches of 8 fit: nothing happened
    run = trained(tmp_path / "big", model="max_samples=8, from_call=1", train="oom_backoff=dict(max_splits=1)",
                  extra="grad_accum_steps = 2\n")
    assert run.model_without_ddp.sizes[:7] == [16, 16, 8, 8, 8, 8, 16]
    assert_close_weights(run, reference(2))


def test_when_even_the_smallest_parts_do_not_fit_the_run_fails_clearly(tmp_path):
    trainer = make_trainer(tmp_path, model="max_samples=4", train="oom_backoff=dict(max_splits=1)")
    with pytest.raises(torch.OutOfMemoryError, match=r"out of memory at step 1 even with each batch split into up "
                                                     r"to 2 parts \(train.oom_backoff.max_splits=1\): lower batch_size"):
        trainer.train()
    assert trainer.outcome == "failed"


def test_without_the_option_an_out_of_memory_error_fails_the_run_as_is(tmp_path):
    trainer = make_trainer(tmp_path, model="max_samples=8")
    assert trainer.oom_backoff is None
    # Not reported as a model/data mismatch of the first forward pass either.
    with pytest.raises(torch.OutOfMemoryError, match="injected in forward"):
        trainer.train()


@pytest.mark.parametrize("option, message", [
    ("oom_backoff=dict(max_splits=0)", r"max_splits=0 is invalid"),
    ("oom_backoff=dict(splits=2)", r"unknown option\(s\) \['splits'\]"),
    ("oom_backoff='yes'", r"oom_backoff='yes' is invalid"),
])
def test_bad_options_are_config_errors(tmp_path, option, message):
    with pytest.raises(ConfigError, match=message):
        make_trainer(tmp_path, train=option)


# ----------------------------------------------------------------------------- splitters


def test_default_splitter_splits_dict_batches_along_the_shared_leading_dimension():
    batch = {"x": torch.arange(10).reshape(5, 2), "label": torch.arange(5), "names": list("abcde"),
             "scale": torch.tensor(2.0), "tag": "train"}
    parts = split_by_leading_dim(batch, 2)
    assert [w for _, w in parts] == [2, 3] or [w for _, w in parts] == [3, 2]
    assert torch.equal(torch.cat([p["x"] for p, _ in parts]), batch["x"])
    assert sum((p["names"] for p, _ in parts), []) == batch["names"]
    assert all(p["tag"] == "train" and p["scale"] is batch["scale"] for p, _ in parts)
    assert len(split_by_leading_dim(batch, 8)) == 5  # never an empty part
    with pytest.raises(ValueError, match="do not share a leading dimension"):
        split_by_leading_dim({"x": torch.zeros(4, 2), "offset": torch.tensor([3, 4])}, 2)


def _events(sizes):
    return [{"coord": torch.randn(n, 3), "segment": torch.arange(n) % 3, "energy": torch.rand(n, 1),
             "origin_coord": torch.randn(n + 1, 3), "origin_offset": torch.tensor([n + 1]), "name": f"ev{i}"}
            for i, n in enumerate(sizes)]


def test_point_splitter_keeps_whole_events_and_rebases_offsets():
    batch = collate_fn(_events([5, 3, 8, 2]))
    parts = split_point_batch(batch, 2)
    assert [p["name"] for p, _ in parts] == [["ev0", "ev1"], ["ev2", "ev3"]]  # balanced by points: 8 | 10
    assert [w for _, w in parts] == [8, 10]  # weights are point counts
    assert [p["offset"].tolist() for p, _ in parts] == [[5, 8], [8, 10]]
    assert [p["origin_offset"].tolist() for p, _ in parts] == [[6, 10], [9, 12]]
    for key in ("coord", "segment", "energy", "origin_coord"):
        assert torch.equal(torch.cat([p[key] for p, _ in parts]), batch[key]), key
    # Each part is what collating its events directly gives.
    direct = collate_fn(_events([5, 3, 8, 2])[2:])
    assert direct["offset"].tolist() == parts[1][0]["offset"].tolist()
    assert [len(p["offset"]) for p, _ in split_point_batch(batch, 8)] == [1, 1, 1, 1]
    assert len(split_point_batch(collate_fn(_events([4])), 2)) == 1
    bad = dict(batch, weights=torch.ones(7))
    with pytest.raises(ValueError, match="'weights' has 7 rows"):
        split_point_batch(bad, 2)


def test_the_splitter_comes_from_the_collate_function_or_the_data_set():
    class Loader:
        def __init__(self, collate, dataset=None):
            self.collate_fn, self.dataset = collate, dataset

    assert find_splitter(Loader(collate_fn)) is split_point_batch
    assert find_splitter(Loader(functools.partial(point_collate_fn, mix_prob=0.5))) is split_point_batch
    assert find_splitter(Loader(default_collate)) is split_by_leading_dim

    class OwnSplit:
        def split_batch(self, batch, parts):
            return [(batch, 1)]

    dataset = OwnSplit()
    assert find_splitter(Loader(default_collate, dataset)) == dataset.split_batch


def test_a_batch_the_splitter_cannot_split_is_a_user_error_naming_the_fix():
    backoff = OOMBackoff(split_by_leading_dim)
    with pytest.raises(UserError, match=r"cannot split this batch .*give the collate function or the data set a "
                                        r"split_batch"):
        backoff._split({"coord": torch.zeros(5, 3), "offset": torch.tensor([2, 5])}, 2)
