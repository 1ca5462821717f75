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

from typing import Iterator

import torch
from torch.utils.data import Sampler

from pimm.utils.rng import derive_seed

__all__ = ["SampleKey", "StatefulRandomSampler", "RatioSampler", "StatefulBatchSampler", "ShardedEvalSampler"]


class SampleKey(tuple):
    """``(index, seed)``. A plain tuple subclass without fields: the sampler
    makes one per sample, so construction cost matters."""

    __slots__ = ()

    @property
    def index(self) -> int:
        return self[0]

    @property
    def seed(self) -> int:
        return self[1]


class _PositionIterator:
    """Iterator over this rank's share of one epoch; its state is its position.

    The share is materialised once per epoch so ``__next__`` stays a list
    lookup: the loader calls it once per sample."""

    def __init__(self, sampler: "StatefulRandomSampler"):
        self.items = sampler.rank_items()
        self.yielded = 0

    def __iter__(self):
        return self

    def __next__(self):
        try:
            item = self.items[self.yielded]
        except IndexError:
            raise StopIteration from None
        self.yielded += 1
        return item

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state["yielded"])


class StatefulRandomSampler(Sampler[SampleKey]):
    """Shuffled (or sequential) sampling over ``num_samples`` items for one rank.

    Epoch ``e`` uses the order seeded by ``(seed, e)``; the first ``start``
    positions of it are skipped (set when a run resumes with a different
    layout), and the rest is dealt round-robin to the ranks, each rank getting
    the same number of samples (the uneven tail is dropped). A sample's seed
    derives from its position in the global order, so it is the same for any
    world size.
    """

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, with_seeds: bool = True):
        if num_samples <= 0:
            raise ValueError(f"{type(self).__name__} needs a non-empty data set, got {num_samples} samples")
        self.num_samples = int(num_samples)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        # Seeds are only needed where samples load in worker processes; a
        # single-process loader shares (and checkpoints) the main RNG streams.
        self.with_seeds = with_seeds
        self.epoch = 0
        self.start = 0
        self._seed_epoch = None
        self._epoch_seed = 0

    @property
    def epoch_length(self) -> int:
        """Positions in one epoch's global order (all ranks together)."""
        return self.num_samples

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = int(epoch)
        self.start = int(start)

    def sample_seed(self, position: int) -> int:
        # One hash per epoch, then an offset: a per-sample hash would cost
        # more than the rest of the sampler on small, fast data sets.
        if self._seed_epoch != (self.seed, self.epoch):
            self._seed_epoch = (self.seed, self.epoch)
            self._epoch_seed = derive_seed(self.seed, self.epoch, -7)
        return (self._epoch_seed + position) & ((1 << 63) - 1)

    def epoch_generator(self) -> torch.Generator:
        generator = torch.Generator()
        generator.manual_seed(derive_seed(self.seed, self.epoch))
        return generator

    def global_order(self) -> list[int]:
        """Data-set indices of this epoch, position by position (same on every rank)."""
        if self.shuffle:
            return torch.randperm(self.num_samples, generator=self.epoch_generator()).tolist()
        return list(range(self.num_samples))

    def rank_positions(self) -> range:
        share = len(self)
        return range(self.start + self.rank, self.start + share * self.world_size, self.world_size)

    def rank_items(self) -> list:
        """This rank's samples for the epoch: indices, or :class:`SampleKey` when seeds are needed."""
        order = self.global_order()
        positions = self.rank_positions()
        # A range is a slice of the order: copied in C, not index by index (an epoch's start
        # is on the training thread).
        indices = order[positions.start:positions.stop:positions.step]
        if not self.with_seeds:
            return indices
        base = self.sample_seed(0)
        mask = (1 << 63) - 1
        return [SampleKey((index, (base + p) & mask)) for index, p in zip(indices, positions)]

    def __iter__(self) -> Iterator[SampleKey]:
        return _PositionIterator(self)

    def __len__(self) -> int:
        return max(0, self.epoch_length - self.start) // self.world_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "start": self.start, "seed": self.seed,
                "epoch_length": self.epoch_length, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if state["epoch_length"] != self.epoch_length or state["world_size"] != self.world_size:
            raise ValueError("sampler state was saved for another epoch length or world size")
        self.epoch = int(state["epoch"])
        self.start = int(state["start"])
        self.seed = int(state["seed"])


class RatioSampler(StatefulRandomSampler):
    """Mixes several data sets (concatenated, ``sizes`` in order) with sampling
    ``ratios`` into epochs of a fixed ``samples_per_epoch``.

    Each position draws its data set from the ratios; inside a data set,
    samples come from a per-epoch permutation, reshuffled when exhausted, so
    every sample of a small data set is used before any repeats."""

    def __init__(self, sizes: list[int], ratios: list[float], samples_per_epoch: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, with_seeds: bool = True):
        if len(sizes) != len(ratios) or not sizes:
            raise ValueError(f"got {len(sizes)} data sets but {len(ratios)} ratios")
        if any(r < 0 for r in ratios) or sum(ratios) <= 0:
            raise ValueError(f"ratios must be non-negative with a positive sum, got {list(ratios)}")
        if any(n <= 0 for n in sizes):
            raise ValueError(f"every data set must be non-empty, got sizes {list(sizes)}")
        super().__init__(sum(sizes), rank=rank, world_size=world_size, seed=seed, with_seeds=with_seeds)
        self.sizes = list(sizes)
        self.ratios = [r / sum(ratios) for r in ratios]
        self.samples_per_epoch = int(samples_per_epoch)

    @property
    def epoch_length(self) -> int:
        return self.samples_per_epoch

    def global_order(self) -> list[int]:
        generator = self.epoch_generator()
        choice = torch.multinomial(torch.tensor(self.ratios, dtype=torch.float64), self.samples_per_epoch,
                                   replacement=True, generator=generator)
        offsets = [0]
        for size in self.sizes[:-1]:
            offsets.append(offsets[-1] + size)
        order = torch.empty(self.samples_per_epoch, dtype=torch.int64)
        for d, size in enumerate(self.sizes):
            slots = (choice == d).nonzero().flatten()
            if len(slots) == 0:
                continue
            rounds = -(-len(slots) // size)
            perms = torch.cat([torch.randperm(size, generator=generator) for _ in range(rounds)])
            order[slots] = perms[: len(slots)] + offsets[d]
        return order.tolist()


class _BatchIterator:
    """Cuts this rank's epoch share into batches by slicing: one call per batch
    instead of one per sample. Its state is the number of batches yielded."""

    def __init__(self, batch_sampler: "StatefulBatchSampler"):
        self.items = batch_sampler.sampler.rank_items()
        self.batch_size = batch_sampler.batch_size
        self.yielded = 0

    def __iter__(self):
        return self

    def __next__(self) -> list:
        start = self.yielded * self.batch_size
        batch = self.items[start:start + self.batch_size]
        if len(batch) < self.batch_size:  # drop_last: every step has a full batch
            raise StopIteration
        self.yielded += 1
        return batch

    def state_dict(self) -> dict:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict) -> None:
        self.yielded = int(state["yielded"])


class StatefulBatchSampler(Sampler[list]):
    """Full batches of a :class:`StatefulRandomSampler`'s epoch share."""

    def __init__(self, sampler: StatefulRandomSampler, batch_size: int):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler = sampler
        self.batch_size = int(batch_size)

    def __iter__(self):
        return _BatchIterator(self)

    def __len__(self) -> int:
        return len(self.sampler) // self.batch_size

    def state_dict(self) -> dict:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state)


class ShardedEvalSampler(Sampler[SampleKey]):
    """Every sample exactly once across ranks (rank ``r`` takes ``r, r+W, ...``),
    no padding, so metrics summed over ranks count each sample once."""

    def __init__(self, num_samples: int, rank: int = 0, world_size: int = 1, seed: int = 0):
        self.num_samples, self.rank, self.world_size, self.seed = num_samples, rank, world_size, seed

    def __iter__(self) -> Iterator[SampleKey]:
        for i in range(self.rank, self.num_samples, self.world_size):
            yield SampleKey((i, derive_seed(self.seed, -1, i)))

    def __len__(self) -> int:
        return len(range(self.rank, self.num_samples, self.world_size))
