"""How long pimm's checkpoints take to write and to resume from, on the ring example.

The trainer comes from ``configs/rings/cls-cnn.py`` when that file exists
(with a small on-the-fly training set and a temporary ``save_path``), else
from an equivalent config written here: RingCNN with its defaults on
CherenkovRingDataset images, AdamW, CosineWarmupLR, the default hooks.

1. Save: a trainer is built and trained for a few steps (so AdamW has its
   moment buffers), then ``trainer.save_checkpoint()`` is timed several
   times, each at a new step (a checkpoint at an existing step is skipped by
   design), with ``model/model_last.pth`` and the retention of old checkpoints
   included, as in a run. Side by side in one run: the synchronous save (the
   training thread writes, commits and writes model_last.pth) and the
   asynchronous one (the training thread blocks only while the state is
   copied; the background writer does the rest; each timed call first waits
   for the previous write, outside the timing, as the next save of a run
   would long after). Reported: median and min of the blocking time, the
   background write time, and the checkpoint's size (MB).
2. Resume: from a checkpoint taken mid-epoch, the time from building the
   trainer with ``resume=True`` to the end of its first step, minus the same
   for a fresh run (no checkpoint). Rounds alternate fresh/resume, each
   resume from an untouched copy of the run directory, and the medians are
   compared. ``restore`` is the trainer's restore alone (reading the
   checkpoint and loading every participant). With data workers, the first
   step after a resume also includes torchdata's replay of the batches drawn
   since the loader's last snapshot (see bench/loader_overhead.py).

    python bench/checkpoint_timing.py [--saves 7] [--rounds 5] [--workers 0 2]
"""

from __future__ import annotations

import argparse
import logging
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

import pimm.datasets, pimm.evaluation, pimm.models  # noqa: E402,F401,E401  (registers every data set, model, evaluator, hook and trainer)
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.utils.logger import setup_logger  # noqa: E402

RING_CONFIG = ROOT / "configs" / "rings" / "cls-cnn.py"
BATCH = 32
STEPS_PER_EPOCH = 16
CHECKPOINT_STEP = 8  # the resume starts in the middle of the epoch

# Used when configs/rings/cls-cnn.py does not exist (yet): the same pieces.
FALLBACK = """
_base_ = {runtime!r}
train = dict(type="ImageClassTrainer")
model = dict(type="RingCNN")
data = dict(train=dict(type="CherenkovRingDataset", split="train", num_events={events}))
optimizer = dict(type="AdamW", lr=1e-3, weight_decay=0.01)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.1)
"""

# Applied on top of either: a short epoch generated on the fly, no evaluation.
OVERRIDES = """
save_path = {save_path!r}
resume = {resume}
epoch = 1
batch_size = {batch}
num_worker = {workers}
evaluate = False
data = dict(train=dict(num_events={events}, in_memory=False))
"""


class _FirstStepDone(Exception):
    """Stops a timed run once its first step has finished."""


def write_config(workdir: Path, save_path: Path, workers: int, resume: bool) -> Path:
    events = BATCH * STEPS_PER_EPOCH
    base = RING_CONFIG if RING_CONFIG.exists() else workdir / "ring_base.py"
    if not RING_CONFIG.exists():
        base.write_text(FALLBACK.format(runtime=str(ROOT / "configs" / "_base_" / "default_runtime.py"),
                                        events=events))
    path = workdir / f"cfg_{save_path.name}_{int(resume)}.py"
    path.write_text(f"_base_ = {str(base)!r}\n" + OVERRIDES.format(
        save_path=str(save_path), resume=resume, batch=BATCH, workers=workers, events=events))
    return path


def make_trainer(workdir: Path, save_path: Path, workers: int, resume: bool = False):
    cfg, hooks = load_config(str(write_config(workdir, save_path, workers, resume)), [], world_size=1)
    logger = setup_logger(cfg.save_path, rank=0)  # train.log only; the console copy would flood the output
    for handler in list(logger.handlers):
        if not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    return build_trainer(cfg, hooks=hooks)


def train_steps(trainer, steps: int) -> None:
    """Run ``steps`` steps of the first epoch the way TrainerBase.run_epoch does."""
    trainer.call_hooks("before_train")
    trainer.call_hooks("before_epoch")
    trainer.start_epoch_data()
    state = trainer.train_state
    for _ in range(steps):
        trainer.call_hooks("before_step")
        trainer.run_step()
        state.iter_in_epoch += 1
        state.global_step += 1
        state.samples_seen += trainer.samples_per_step
        trainer.call_hooks("after_step")


def measure_saves(workdir: Path, saves: int) -> None:
    trainer = make_trainer(workdir, workdir / "saves", workers=0)
    train_steps(trainer, 4)
    manager = trainer.checkpointer
    blocking = {False: [], True: []}
    writes = []
    for index in range(2 * saves):
        asynchronous = bool(index % 2)  # interleaved, so both see the same background load
        manager.async_write = asynchronous
        trainer.train_state.global_step += 1  # a new step: a save at an existing step is skipped
        start = time.perf_counter()
        trainer.save_checkpoint()
        blocking[asynchronous].append(time.perf_counter() - start)
        start = time.perf_counter()
        manager.wait()
        if asynchronous:
            writes.append(time.perf_counter() - start + blocking[True][-1])
    newest = manager.committed()[-1]
    size_mb = sum(f.stat().st_size for f in newest.iterdir()) / 2**20
    n_params = sum(p.numel() for p in trainer.model_without_ddp.parameters())
    trainer.close()
    print(f"# save ({type(trainer.model_without_ddp).__name__}, {n_params:,} parameters, AdamW state; "
          f"source: {RING_CONFIG.name if RING_CONFIG.exists() else 'built-in equivalent config'}); checkpoint "
          f"{size_mb:.2f} MB ({', '.join(f'{f.name} {f.stat().st_size / 2**20:.2f} MB' for f in sorted(newest.iterdir()))})")
    for asynchronous, label in ((False, "synchronous"), (True, "asynchronous")):
        times = blocking[asynchronous]
        print(f"{label:12s} save: the training thread blocks median {statistics.median(times) * 1e3:.1f} ms, "
              f"min {min(times) * 1e3:.1f} ms over {saves} saves")
    print(f"asynchronous save: copy + background write + commit + model_last.pth, median "
          f"{statistics.median(writes) * 1e3:.1f} ms")


def time_to_first_step(workdir: Path, save_path: Path, workers: int, resume: bool) -> dict:
    start = time.perf_counter()
    trainer = make_trainer(workdir, save_path, workers, resume)
    built = time.perf_counter()
    times = {}
    inner_restore = trainer.restore

    def timed_restore():
        begin = time.perf_counter()
        try:
            return inner_restore()
        finally:
            times["restore"] = time.perf_counter() - begin

    trainer.restore = timed_restore
    inner_step = trainer.run_step

    def first_step():
        inner_step()
        times["first_step"] = time.perf_counter() - start
        raise _FirstStepDone

    trainer.run_step = first_step
    try:
        trainer.train()
    except _FirstStepDone:
        pass
    times["build"] = built - start
    times["resumed_at"] = trainer.global_step
    return times


def measure_resume(workdir: Path, workers: int, rounds: int) -> None:
    source = workdir / f"resume_source_w{workers}"
    trainer = make_trainer(workdir, source, workers)
    train_steps(trainer, CHECKPOINT_STEP)
    trainer.save_checkpoint()
    trainer.checkpointer.wait()
    trainer.close()
    fresh, resumed = [], []
    for r in range(rounds):
        fresh.append(time_to_first_step(workdir, workdir / f"fresh_w{workers}_{r}", workers, resume=False))
        copy = workdir / f"resume_w{workers}_{r}"
        shutil.copytree(source, copy)
        resumed.append(time_to_first_step(workdir, copy, workers, resume=True))
        assert resumed[-1]["resumed_at"] == CHECKPOINT_STEP, resumed[-1]

    def med(rows, key):
        return statistics.median(row[key] for row in rows) * 1e3

    print(f"workers={workers}: first step done after: fresh {med(fresh, 'first_step'):7.1f} ms, "
          f"resume (checkpoint at step {CHECKPOINT_STEP}/{STEPS_PER_EPOCH}) {med(resumed, 'first_step'):7.1f} ms "
          f"-> resume cost {med(resumed, 'first_step') - med(fresh, 'first_step'):+7.1f} ms "
          f"(restore {med(resumed, 'restore'):.1f} ms; build {med(resumed, 'build'):.1f} vs "
          f"{med(fresh, 'build'):.1f} ms)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=7, help="timed trainer.save_checkpoint() calls")
    parser.add_argument("--rounds", type=int, default=5, help="alternating fresh/resume rounds per worker count")
    parser.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pimm-ckpt-bench-") as tmp:
        workdir = Path(tmp)
        measure_saves(workdir, args.saves)
        print(f"# resume: build with resume=True -> first step done, minus the same for a fresh run "
              f"(median of {args.rounds})")
        for workers in args.workers:
            measure_resume(workdir, workers, args.rounds)


if __name__ == "__main__":
    main()
