"""Rank-aware samplers whose position can be saved and restored.

:class:`StatefulRandomSampler` draws one global permutation per epoch from
``(seed, epoch)`` alone and deals it out to ranks, so the global data order
does not depend on the world size, and a resume can skip exactly the
samples an interrupted epoch already consumed. It yields
:class:`SampleKey` tuples: the data-set index plus a per-sample seed that
the data pipeline uses to make random augmentations replay identically in
any worker, on any rank, after any resume.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from torch.utils.data import Sampler

from pimm.utils.rng import derive_seed

__all__ = ["SampleKey", "StatefulRandomSampler", "ShardedEvalSampler"]


class SampleKey(NamedTuple):
    index: int
    seed: int


class _PositionIterator:
    """Iterator over this rank's share of one epoch; its state is its position."""

    def __init__(self, sampler: "StatefulRandomSampler"):
        self.sampler = sampler
        self.indices = sampler.epoch_indices()
        self.yielded = 0

    def __iter__(self):
        return self

    def __next__(self) -> SampleKey:
        if self.yielded >= len(self.indices):
            raise StopIteration
        index = self.indices[self.yielded]
        self.yielded += 1
        return SampleKey(index, self.sampler.sample_seed(index))

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state["yielded"])


class StatefulRandomSampler(Sampler[SampleKey]):
    """Shuffled (or sequential) sampling over ``num_samples`` items for one rank.

    Epoch ``e`` uses the permutation seeded by ``(seed, e)``; the first
    ``start`` positions of it are skipped (set when a run resumes with a
    different layout), and the rest is dealt round-robin to the ranks, each
    rank getting the same number of samples (the uneven tail is dropped).
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"StatefulRandomSampler needs a non-empty data set, got {num_samples} samples")
        self.num_samples = int(num_samples)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = int(epoch)
        self.start = int(start)

    def sample_seed(self, index: int) -> int:
        return derive_seed(self.seed, self.epoch, index)

    def epoch_indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(derive_seed(self.seed, self.epoch))
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        share = (self.num_samples - self.start) // self.world_size
        return order[self.start + self.rank:: self.world_size][:share]

    def __iter__(self) -> Iterator[SampleKey]:
        return _PositionIterator(self)

    def __len__(self) -> int:
        return (self.num_samples - self.start) // self.world_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed,
                "num_samples": self.num_samples, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state["num_samples"] != self.num_samples or state["world_size"] != self.world_size:
            raise ValueError("sampler state was saved for another data set size or world size")
        self.epoch = int(state["epoch"])
        self.start = int(state["start"])
        self.seed = int(state["seed"])


class ShardedEvalSampler(Sampler[SampleKey]):
    """Every sample exactly once across ranks (rank ``r`` takes ``r, r+W, ...``),
    no padding, so metrics summed over ranks count each sample once."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.num_samples, self.rank, self.world_size, self.seed = num_samples, rank, world_size, seed

    def __iter__(self) -> Iterator[SampleKey]:
        for i in range(self.rank, self.num_samples, self.world_size):
            yield SampleKey(i, derive_seed(self.seed, -1, i))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))
