"""Building the data loaders the trainers iterate over.

Training uses torchdata's ``StatefulDataLoader`` over a
:class:`~pimm.distributed.sampler.StatefulRandomSampler`, so the position
inside an epoch is part of the checkpoint. Randomness in data loading is
made replayable without snapshotting worker RNGs: in a worker process, the
global python/numpy/torch generators are re-seeded from each sample's
:class:`SampleKey` before the sample is loaded (augmentations are then a
function of ``(seed, epoch, index)`` only); in the main process
(``num_workers=0``) loading shares the training RNG stream, which the
checkpoint captures at every step boundary.
"""

from __future__ import annotations

import atexit
import signal
import warnings
import weakref
from typing import Callable

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from pimm.distributed.sampler import SampleKey, ShardedEvalSampler, StatefulBatchSampler, StatefulRandomSampler
from pimm.utils.errors import ConfigError, DataSampleError
from pimm.utils.rng import derive_seed, seed_cpu_streams

__all__ = ["SeededDataset", "build_train_loader", "build_eval_loader", "worker_init_fn", "shutdown_loader",
           "train_sampler", "stream_batches_per_rank", "point_batch_size", "points_per_sample", "batch_stats"]

# torchdata calls a deprecated torch API on every loader construction; the
# warning is torchdata's to fix and says nothing to a pimm user.
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)

# Signals the main process turns into a checkpoint-and-exit; data workers must
# survive them (a SLURM pre-emption signals the whole process group) so the
# main process can still finish its last step and save.
_PREEMPTION_SIGNALS = ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGINT")


class SeededDataset(Dataset):
    """Map-style wrapper that takes :class:`SampleKey` indices (see module doc)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        if type(key) is SampleKey:
            if get_worker_info() is not None:
                seed_cpu_streams(key[1])
            key = key[0]
        try:
            return self.dataset[key]
        except Exception as err:
            raise _sample_error(self.dataset, key, err) from err

    def __getitems__(self, keys: list) -> list:
        # One call per batch (torch prefers it to per-sample __getitem__).
        dataset = self.dataset
        if get_worker_info() is None:
            try:
                return [dataset[k[0] if type(k) is SampleKey else k] for k in keys]
            except Exception:
                pass  # find the failing sample below, to name it
        return [self[key] for key in keys]

    def __getattr__(self, name):
        # Forward attributes such as ``class_names`` to the wrapped data set;
        # guard "dataset" itself so unpickling does not recurse.
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def _sample_error(dataset, index, err: Exception) -> DataSampleError:
    if isinstance(err, DataSampleError):
        return err
    detail = str(err).splitlines()[0] if str(err) else ""
    return DataSampleError(f"data set {type(dataset).__name__}: loading sample {index} failed "
                           f"({type(err).__name__}{': ' + detail if detail else ''}); run with PIMM_DEBUG=1 for the "
                           "traceback")


def worker_init_fn(worker_id: int) -> None:
    """In a data-loading worker: ignore the pre-emption signals (the main process handles them)."""
    for name in _PREEMPTION_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)
    # Workers parallelise over processes; intra-op threads would oversubscribe.
    torch.set_num_threads(1)


_LOADERS: "weakref.WeakSet" = weakref.WeakSet()


def train_sampler(loader) -> StatefulRandomSampler | None:
    """The position-keeping sampler behind a training loader (None for iterable data)."""
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    return sampler if isinstance(sampler, StatefulRandomSampler) else None


def shutdown_loader(loader) -> None:
    """Stop a loader's worker processes now (they ignore SIGTERM, see above)."""
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


@atexit.register
def _kill_leftover_workers() -> None:
    # Registered after multiprocessing's own exit handler, so it runs first:
    # that handler SIGTERMs and joins daemonic children, and our workers
    # ignore SIGTERM, so any still alive are killed here instead of waited for.
    for loader in list(_LOADERS):
        for worker in getattr(getattr(loader, "_iterator", None), "_workers", ()):
            if worker.is_alive():
                worker.kill()


def _loader_generator(seed: int, rank: int, purpose: int) -> torch.Generator:
    # A private generator keeps the loader's own draws (worker base seeds) off
    # the global torch stream that the training step uses.
    generator = torch.Generator()
    generator.manual_seed(derive_seed(seed, rank, purpose))
    return generator


def build_train_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    num_workers: int,
    seed: int,
    rank: int,
    world_size: int,
    collate_fn: Callable | None = None,
    shuffle: bool = True,
    snapshot_every_n_steps: int | None = None,
    pin_memory: bool = False,
    sampler: StatefulRandomSampler | None = None,
    prefetch_factor: int | None = None,
) -> StatefulDataLoader:
    """A resumable training loader for this rank. ``batch_size`` is per rank;
    ``sampler`` replaces the default shuffled :class:`StatefulRandomSampler`."""
    common = dict(
        num_workers=num_workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        worker_init_fn=worker_init_fn if num_workers > 0 else None,
        persistent_workers=num_workers > 0,
        generator=_loader_generator(seed, rank, 0),
        snapshot_every_n_steps=snapshot_every_n_steps or 1_000_000_000,
        prefetch_factor=prefetch_factor if num_workers > 0 else None,
    )
    if isinstance(dataset, IterableDataset):
        loader = StatefulDataLoader(dataset, batch_size=batch_size, **common)
    else:
        if sampler is None:
            sampler = StatefulRandomSampler(len(dataset), rank=rank, world_size=world_size, seed=seed,
                                            shuffle=shuffle, with_seeds=num_workers > 0)
        loader = StatefulDataLoader(SeededDataset(dataset), batch_sampler=StatefulBatchSampler(sampler, batch_size),
                                    **common)
    _LOADERS.add(loader)
    return loader


def build_eval_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    num_workers: int,
    seed: int,
    rank: int,
    world_size: int,
    collate_fn: Callable | None = None,
    pin_memory: bool = False,
    prefetch_factor: int | None = None,
) -> DataLoader:
    """Each sample exactly once across ranks, in a fixed order."""
    common = dict(batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
                  pin_memory=pin_memory, worker_init_fn=worker_init_fn if num_workers > 0 else None,
                  generator=_loader_generator(seed, rank, 1),
                  prefetch_factor=prefetch_factor if num_workers > 0 else None)
    if isinstance(dataset, IterableDataset):
        loader = DataLoader(dataset, **common)
    else:
        sampler = ShardedEvalSampler(len(dataset), rank=rank, world_size=world_size, seed=seed)
        loader = DataLoader(SeededDataset(dataset), sampler=sampler, **common)
    _LOADERS.add(loader)
    return loader


def stream_batches_per_rank(dataset: IterableDataset, world_size: int, batch_size: int) -> int:
    """Batches per epoch on each rank of an iterable data set, from its
    ``num_samples()``: the size of the **whole stream** (all ranks together),
    floored per rank then per batch, as upstream pimm reads it, so every rank
    runs the same number of steps (DDP lockstep). A stream that shards itself
    gives each rank ``num_samples() // world_size`` samples per epoch."""
    count = getattr(dataset, "num_samples", None)
    if not callable(count):
        raise ConfigError(f"{type(dataset).__name__} is an iterable data set: set iters_per_epoch (top level or "
                          "train.iters_per_epoch) or give the data set a num_samples() method")
    total = count()
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ConfigError(f"{type(dataset).__name__}.num_samples() returned {total!r}: it must be the number of "
                          "samples in the whole stream (an integer >= 0)")
    return total // world_size // batch_size


def point_batch_size(batch):
    """``(points, events)`` of a point-cloud batch (an ``offset`` of cumulative
    event ends, docs/contract.md): points as a 0-d tensor where the batch is
    (read without a host sync), events an int; None for other batches."""
    offset = batch.get("offset") if isinstance(batch, dict) else None
    if not isinstance(offset, torch.Tensor) or offset.ndim != 1 or not len(offset):
        return None
    return offset[-1], len(offset)


def points_per_sample(sizes: list):
    """Mean points per event over batches' :func:`point_batch_size` (None when
    any is not a point-cloud batch): a 0-d float tensor on the batch's device."""
    if not sizes or any(size is None for size in sizes):
        return None
    points = sizes[0][0] if len(sizes) == 1 else torch.stack([p for p, _ in sizes]).sum()
    return points / sum(events for _, events in sizes)  # true division: a float tensor


def batch_stats(batch, samples: int) -> dict:
    """What a ``batch`` trace counter records: samples, and for point-cloud batches
    (an ``offset`` of cumulative event ends, see docs/contract.md) the points."""
    stats = {"samples": samples}
    offset = batch.get("offset") if isinstance(batch, dict) else None
    if isinstance(offset, torch.Tensor) and offset.numel():
        coord = batch.get("coord")
        # The points are coord's rows: a shape, where reading offset[-1] would make the
        # host wait for the device at every traced step.
        stats["points"] = coord.shape[0] if isinstance(coord, torch.Tensor) else int(offset[-1])
    return stats
