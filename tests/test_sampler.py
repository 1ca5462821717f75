"""Samplers and the training loader: the data order exact resume relies on.

``StatefulRandomSampler`` must deal one world-size-independent permutation
per epoch to the ranks, skip an exact prefix, and carry per-sample seeds that
do not depend on the rank layout; the ``StatefulDataLoader`` built by
``pimm.engines.data.build_train_loader`` must continue a half-consumed epoch
with exactly the remaining batches, random augmentations included.
"""

from __future__ import annotations

import pytest
import torch

from pimm.distributed.sampler import SampleKey, ShardedEvalSampler, StatefulRandomSampler
from pimm.engines.run.data import build_train_loader, shutdown_loader, train_sampler
from pimm.utils.rng import capture_rng_state, derive_seed, restore_rng_state, seed_all
from tests.support.toy import ToyDataset

N = 23  # not a multiple of any tested world size > 1


def rank_keys(num_samples: int, world_size: int, epoch: int = 0, start: int = 0, seed: int = 7) -> list[list]:
    out = []
    for rank in range(world_size):
        sampler = StatefulRandomSampler(num_samples, rank=rank, world_size=world_size, seed=seed)
        sampler.set_epoch(epoch, start)
        out.append(list(sampler))
    return out


def interleave(shares: list[list]) -> list:
    """Position p of the global order went to rank p % world_size."""
    return [shares[i % len(shares)][i // len(shares)] for i in range(sum(len(s) for s in shares))]


# -- StatefulRandomSampler ---------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_ranks_deal_out_one_global_permutation(world_size):
    global_order = rank_keys(N, 1)[0]
    assert sorted(k.index for k in global_order) == list(range(N))  # a permutation
    shares = rank_keys(N, world_size)
    share = N // world_size
    assert [len(s) for s in shares] == [share] * world_size  # equal-sized, uneven tail dropped
    indices = [{k.index for k in s} for s in shares]
    assert sum(len(s) for s in indices) == len(set().union(*indices)) == share * world_size  # disjoint
    # Same order (and same per-sample seeds) as a single process, whatever the world size.
    assert interleave(shares) == global_order[: share * world_size]
    assert all(isinstance(k, SampleKey) for s in shares for k in s)


def test_epochs_differ_and_repeat_deterministically():
    epoch0, epoch1 = rank_keys(N, 1, epoch=0)[0], rank_keys(N, 1, epoch=1)[0]
    assert [k.index for k in epoch0] != [k.index for k in epoch1]
    assert {k.seed for k in epoch0}.isdisjoint(k.seed for k in epoch1)
    assert rank_keys(N, 1, epoch=1)[0] == epoch1
    assert [k.index for k in rank_keys(N, 1, seed=8)[0]] != [k.index for k in epoch0]


def test_sample_seeds_are_unique_and_depend_on_seed_epoch_position_only():
    keys = rank_keys(N, 1, epoch=3)[0]
    assert len({k.seed for k in keys}) == N
    # Position p of any rank layout carries the seed of position p of the single-process order.
    for world_size in (2, 3):
        assert [k.seed for k in interleave(rank_keys(N, world_size, epoch=3))] == \
            [k.seed for k in keys[: (N // world_size) * world_size]]
    assert {k.seed for k in rank_keys(N, 1, epoch=3, seed=8)[0]}.isdisjoint(k.seed for k in keys)
    assert all(0 <= k.seed < 2**63 for k in keys)


@pytest.mark.parametrize("world_size,start", [(1, 5), (2, 5), (3, 10), (4, 1)])
def test_start_skips_exactly_a_global_prefix(world_size, start):
    global_order = rank_keys(N, 1, epoch=2)[0]
    shares = rank_keys(N, world_size, epoch=2, start=start)
    share = (N - start) // world_size
    assert [len(s) for s in shares] == [share] * world_size
    assert interleave(shares) == global_order[start: start + share * world_size]


def test_iterator_state_round_trip():
    sampler = StatefulRandomSampler(N, rank=1, world_size=2, seed=3)
    sampler.set_epoch(4)
    full = list(sampler)
    iterator = iter(sampler)
    head = [next(iterator) for _ in range(4)]
    state = iterator.state_dict()
    fresh = iter(sampler)
    fresh.load_state_dict(state)
    assert head + list(fresh) == full
    assert list(iterator) == full[4:]


def test_sampler_state_round_trip_and_layout_check():
    sampler = StatefulRandomSampler(N, rank=0, world_size=2, seed=3)
    sampler.set_epoch(5, start=6)
    other = StatefulRandomSampler(N, rank=0, world_size=2, seed=0)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == list(sampler)
    with pytest.raises(ValueError, match="world size"):
        StatefulRandomSampler(N, rank=0, world_size=3).load_state_dict(sampler.state_dict())
    with pytest.raises(ValueError):
        StatefulRandomSampler(N + 1, rank=0, world_size=2).load_state_dict(sampler.state_dict())


def test_unshuffled_sampler_is_sequential_and_empty_data_is_an_error():
    sampler = StatefulRandomSampler(N, rank=1, world_size=2, shuffle=False)
    assert [k.index for k in sampler] == list(range(1, 2 * (N // 2), 2))
    with pytest.raises(ValueError, match="non-empty"):
        StatefulRandomSampler(0)


# -- ShardedEvalSampler -----------------------------------------------------------------
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 30])
def test_eval_sampler_covers_every_index_exactly_once(world_size):
    shares = [list(ShardedEvalSampler(N, rank=r, world_size=world_size, seed=1)) for r in range(world_size)]
    assert [len(ShardedEvalSampler(N, rank=r, world_size=world_size)) for r in range(world_size)] == \
        [len(s) for s in shares]
    indices = sorted(k.index for s in shares for k in s)
    assert indices == list(range(N))
    # The per-sample seed does not depend on the layout either.
    single = {k.index: k.seed for k in ShardedEvalSampler(N, seed=1)}
    assert all(single[k.index] == k.seed for s in shares for k in s)


# -- the training loader ------------------------------------------------------------------
def make_loader(num_workers: int, rank: int = 0, world_size: int = 1, batch_size: int = 4):
    # noise_aug: every sample draws from the global torch and numpy generators.
    dataset = ToyDataset(num_samples=40, noise_aug=0.1)
    return build_train_loader(dataset, batch_size=batch_size, num_workers=num_workers, seed=11, rank=rank,
                              world_size=world_size)


def start_epoch(loader, epoch: int, rank: int = 0, start: int = 0):
    """What DefaultTrainer.start_epoch_data does at the start of every epoch
    (``start``: global samples to skip, set when the epoch is resumed)."""
    train_sampler(loader).set_epoch(epoch, start)
    loader.generator.manual_seed(derive_seed(11, rank, epoch, 2))
    return iter(loader)


def assert_same_batches(got: list, want: list) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a["label"], b["label"]), f"batch {i}: other samples"
        assert torch.equal(a["x"], b["x"]), f"batch {i}: same samples, other augmentation"


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("consumed", [1, 3, 7])
def test_loader_resumes_mid_epoch_with_exactly_the_remaining_batches(num_workers, consumed):
    seed_all(5)
    loader = make_loader(num_workers)
    list(start_epoch(loader, 0))  # a full epoch first: its state must not leak into the next
    iterator = start_epoch(loader, 1)
    head = [next(iterator) for _ in range(consumed)]
    # The trainer checkpoints the loader and every RNG at a step boundary.
    loader_state, rng_state = loader.state_dict(), capture_rng_state()
    tail = list(iterator)
    assert len(head) + len(tail) == 10

    resumed = make_loader(num_workers)
    resumed.load_state_dict(loader_state)  # restored before the epoch's iterator starts, as on resume
    if num_workers:
        seed_all(999)  # workers seed every sample from its SampleKey: the main-process RNG must not matter
    else:
        restore_rng_state(rng_state)  # in the main process augmentation shares the (checkpointed) training stream
    assert_same_batches(list(start_epoch(resumed, 1)), tail)
    # The restored position applies to one iterator only; the next epoch starts from its beginning.
    assert len(list(start_epoch(resumed, 2))) == 10
    shutdown_loader(loader)
    shutdown_loader(resumed)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_resumes_from_a_sample_count(num_workers):
    """The trainer resumes map-style data by position: a fresh loader whose epoch
    starts ``consumed`` samples in yields exactly the remaining batches."""
    seed_all(5)
    loader = make_loader(num_workers)
    iterator = start_epoch(loader, 1)
    head = [next(iterator) for _ in range(3)]
    rng_state = capture_rng_state()
    tail = list(iterator)
    assert len(head) + len(tail) == 10

    resumed = make_loader(num_workers)
    if num_workers:
        seed_all(999)
    else:
        restore_rng_state(rng_state)
    assert_same_batches(list(start_epoch(resumed, 1, start=3 * 4)), tail)
    shutdown_loader(loader)
    shutdown_loader(resumed)


def test_worker_augmentation_is_independent_of_rank_layout():
    """With workers, a sample's augmentation depends on (seed, epoch, position) only:
    one process with 2 workers and two ranks with 1 worker each see identical samples."""
    single = make_loader(2, batch_size=2)
    flat_single = torch.cat([b["x"] for b in start_epoch(single, 3)])
    ranks = [make_loader(1, rank=r, world_size=2, batch_size=1) for r in range(2)]
    per_rank = [torch.cat([b["x"] for b in start_epoch(loader, 3, rank=r)]) for r, loader in enumerate(ranks)]
    interleaved = torch.stack([per_rank[i % 2][i // 2] for i in range(2 * len(per_rank[0]))])
    assert torch.equal(interleaved, flat_single)
    for loader in (single, *ranks):
        shutdown_loader(loader)
