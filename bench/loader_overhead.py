"""Cost of pimm's resumable training loader against a plain DataLoader.

pimm trains from ``pimm.engines.run.data.build_train_loader``: torchdata's
StatefulDataLoader over a StatefulRandomSampler, with the data set wrapped
in SeededDataset (in a worker, every sample re-seeds the global RNGs from its
key so augmentations replay exactly after a resume). This script measures
what that costs per batch against ``torch.utils.data.DataLoader(shuffle=True)``
over the same data set, batch size and collate, for ``num_workers`` 0 and 2:

* ``toy``: tests/support/toy.py's in-memory ToyDataset (8 features, a small
  random augmentation), so the loader's own cost dominates;
* ``rings``: CherenkovRingDataset generated on the fly (the ring example's
  data), where the per-event simulation dominates;
* ``pilarnet``: PILArNetH5Dataset reading a v3 file of 512 generated LArTPC
  events (1,000-2,700 points each), batched by the point collate: a file
  reader's decoding and its per-event checks of what it read;
* ``lucid``: LUCiDEventSSLDataset reading 2 x 256 events of LUCiD shards
  written by the ring simulator (hit point clouds, PMTs aggregated).

The two file data sets are written once per run into a temporary folder.

Per-batch time is a whole epoch (``iter()`` to exhaustion) divided by its
batches, after one untimed warm-up epoch; both loaders keep persistent
workers, so worker start-up is not in it. Rounds alternate pimm/plain and the
medians give ``ratio = pimm / plain``.

Then the checkpoint side, for the pimm loader only: the cost of
``loader.state_dict()`` half-way through an epoch, and the resume latency
(``load_state_dict`` on a freshly built loader + its first batch) against
the first batch of a fresh loader. With workers, torchdata restores from the
last worker snapshot and replays the batches drawn since; the trainer sets
the snapshot interval to CheckpointSaver's ``save_freq`` (1e9 when unset),
so both an unaligned (default) and an aligned snapshot are shown. Every
resumed batch is checked against the uninterrupted one.

    python bench/loader_overhead.py [--rounds 3] [--datasets toy rings pilarnet lucid] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils.data import DataLoader, default_collate  # noqa: E402

from pimm.datasets.collate import collate_fn as point_collate  # noqa: E402
from pimm.datasets.rings import CherenkovRingDataset  # noqa: E402
from pimm.engines.run.data import build_train_loader, shutdown_loader  # noqa: E402
from pimm.utils.rng import capture_rng_state, restore_rng_state  # noqa: E402
from tests.support.toy import ToyDataset  # noqa: E402

SEED = 0
NEVER = 1_000_000_000  # the trainer's snapshot interval when no step-based save is configured

@functools.lru_cache(maxsize=None)
def _scratch() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="pimm-loader-bench-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


@functools.lru_cache(maxsize=None)
def _pilarnet_file() -> str:
    from pimm.datasets.lartpc import LArTPCSynthDataset
    from pimm.datasets.pilarnet import write_pilarnet_h5

    generated = LArTPCSynthDataset(num_events=512, seed=SEED)
    path = _scratch() / "pilarnet_v3.h5"
    write_pilarnet_h5((generated[i] for i in range(len(generated))), path, revision="v3")
    return str(path)


@functools.lru_cache(maxsize=None)
def _lucid_root() -> str:
    from pimm.datasets.lucid_generator import generate_lucid

    for species in ("electron", "muon"):
        generate_lucid(_scratch() / "lucid" / species, 256, species, seed=SEED, events_per_file=128)
    return str(_scratch() / "lucid")


def _pilarnet():
    from pimm.datasets.pilarnet import PILArNetH5Dataset

    return PILArNetH5Dataset(_pilarnet_file(), min_points=0)


def _lucid():
    from pimm.datasets.lucid_ssl import LUCiDEventSSLDataset

    return LUCiDEventSSLDataset(_lucid_root(), ["electron", "muon"], split="all")


# name -> (data set factory, batch size, collate). Sizes keep the default run short.
DATASETS = {
    "toy": (lambda: ToyDataset(num_samples=64 * 64, noise_aug=0.1), 64, default_collate),
    "rings": (lambda: CherenkovRingDataset(num_events=16 * 32, seed=SEED), 32, default_collate),
    "pilarnet": (_pilarnet, 16, point_collate),
    "lucid": (_lucid, 32, point_collate),
}


def pimm_loader(dataset, batch_size: int, workers: int, snapshot_every: int | None = None, collate=default_collate):
    return build_train_loader(dataset, batch_size=batch_size, num_workers=workers, seed=SEED, rank=0, world_size=1,
                              collate_fn=collate, snapshot_every_n_steps=snapshot_every)


def plain_loader(dataset, batch_size: int, workers: int, collate=default_collate) -> DataLoader:
    return DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                      collate_fn=collate, persistent_workers=workers > 0)


def start_epoch(loader, epoch: int):
    """What DefaultTrainer.start_epoch_data does before iterating an epoch."""
    sampler = getattr(loader, "sampler", None)
    if hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)
    return iter(loader)


def epoch_seconds(loader, epoch: int) -> tuple[float, int]:
    start = time.perf_counter()
    batches = sum(1 for _ in start_epoch(loader, epoch))
    return time.perf_counter() - start, batches


def close(loader) -> None:
    shutdown_loader(loader)


def compare_throughput(name: str, workers: int, rounds: int) -> float:
    factory, batch_size, collate = DATASETS[name]
    dataset = factory()
    loaders = {"pimm": pimm_loader(dataset, batch_size, workers, collate=collate),
               "plain": plain_loader(dataset, batch_size, workers, collate)}
    for loader in loaders.values():  # warm-up epoch: worker start-up, first-touch costs
        epoch_seconds(loader, 0)
    per_batch = {key: [] for key in loaders}
    for r in range(rounds):
        for key in ("pimm", "plain") if r % 2 == 0 else ("plain", "pimm"):
            seconds, batches = epoch_seconds(loaders[key], r + 1)
            per_batch[key].append(seconds / batches * 1e3)
    for loader in loaders.values():
        close(loader)
    pimm_ms, plain_ms = statistics.median(per_batch["pimm"]), statistics.median(per_batch["plain"])
    rounds_text = "  ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(per_batch["pimm"], per_batch["plain"]))
    print(f"{name:8s} workers={workers}  plain {plain_ms:8.3f} ms/batch  pimm {pimm_ms:8.3f} ms/batch  "
          f"ratio {pimm_ms / plain_ms:.3f}   (rounds pimm/plain: {rounds_text})", flush=True)
    return pimm_ms / plain_ms


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
                                        for k in a)


def resume_costs(name: str, workers: int, repeats: int = 3) -> None:
    """state_dict() half-way through epoch 1 and the latency of resuming from it."""
    factory, batch_size, collate = DATASETS[name]
    dataset = factory()
    reference = pimm_loader(dataset, batch_size, workers, collate=collate)
    iterator = start_epoch(reference, 1)
    expected = [next(iterator)]
    position = len(reference) // 2
    while len(expected) <= position:
        if len(expected) == position:
            # Without workers, augmentations draw from the process's RNGs, which
            # the trainer checkpoints at step boundaries: restore them likewise.
            rng_at_position = capture_rng_state()
        expected.append(next(iterator))
    close(reference)

    def first_batch(snapshot_every: int | None, state: dict | None) -> tuple[float, dict]:
        loader = pimm_loader(dataset, batch_size, workers, snapshot_every, collate)
        restore_rng_state(rng_at_position)
        start = time.perf_counter()
        if state is not None:  # as the trainer resumes: restore, then start the epoch
            loader.load_state_dict(state)
        batch = next(start_epoch(loader, 1))
        seconds = time.perf_counter() - start
        close(loader)
        return seconds, batch

    for label, snapshot_every in (("unaligned snapshot", None), ("aligned snapshot", position)):
        loader = pimm_loader(dataset, batch_size, workers, snapshot_every, collate)
        iterator = start_epoch(loader, 1)
        for _ in range(position):
            next(iterator)
        costs = []
        for _ in range(repeats):
            start = time.perf_counter()
            state = loader.state_dict()
            costs.append(time.perf_counter() - start)
        close(loader)
        fresh, resumed = [], []
        for _ in range(repeats):
            fresh.append(first_batch(snapshot_every, None)[0])
            seconds, batch = first_batch(snapshot_every, state)
            assert _same(batch, expected[position]), f"{name} workers={workers}: resumed batch differs"
            resumed.append(seconds)
        fresh_ms, resumed_ms = statistics.median(fresh) * 1e3, statistics.median(resumed) * 1e3
        print(f"{name:8s} workers={workers}  {label:18s} at batch {position}/{len(reference)}: "
              f"state_dict {statistics.median(costs) * 1e3:7.3f} ms   first batch: fresh {fresh_ms:8.1f} ms, "
              f"after load_state_dict {resumed_ms:8.1f} ms (resume latency +{resumed_ms - fresh_ms:.1f} ms)",
              flush=True)
        if workers == 0:
            break  # without workers there is no snapshot: the two cases are the same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="alternating timed epochs of each loader")
    parser.add_argument("--datasets", nargs="+", default=list(DATASETS), choices=list(DATASETS))
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.datasets:
        factory, batch_size, _ = DATASETS[name]
        print(f"# {name}: {len(factory())} samples, batch {batch_size}")
        for workers in args.workers:
            compare_throughput(name, workers, args.rounds)
        for workers in args.workers:
            resume_costs(name, workers)


if __name__ == "__main__":
    main()
