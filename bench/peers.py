"""Step time of pimm and its peers against a hand-written PyTorch loop, in one interleaved run.

The workload is ``bench/overhead.py``'s (and its pieces are reused from there):
a 3-layer MLP on an in-memory tensor data set, batch 64, 256 steps over 2
epochs, AdamW with a cosine-with-warm-up schedule stepped every step, one CPU
thread, no data-loader workers. Each contender trains it its own way:

- ``raw``: the hand-written loop (``overhead.run_raw``).
- ``raw+save``: the same loop ending each epoch with a hand-written
  checkpoint (``torch.save`` of model, optimizer, scheduler and epoch to a
  temporary file, fsync, rename): the cost of pimm's epoch-end checkpoints
  that a hand-written loop pays too, so pimm's ratio to it is the framework's
  own overhead.
- ``pimm``: DefaultTrainer built from a config with the runtime base's default
  hooks (train.log, metrics.jsonl, TensorBoard, progress bar, epoch-end
  checkpoints), as ``overhead.run_pimm`` builds it.
- ``mmengine``: ``mmengine.runner.Runner`` with its default hooks (logger,
  timer, parameter scheduler, an epoch-end checkpoint) and an AMP-free
  ``OptimWrapper``; warm-up then cosine as ``LinearLR`` + ``CosineAnnealingLR``
  per iteration.
- ``lightning``: a bare ``lightning.Trainer`` (no logger, no checkpointing, no
  progress bar, no model summary, no sanity validation), LambdaLR per step.

What is timed: from the start of the first epoch to the end of the last one
(construction excluded), per contender, in wall time and in CPU time
(``process_time``: every thread of the process; on a machine shared with
other jobs it is the steadier of the two). Each round runs every contender
once, in the same order, after one untimed warm-up of each; the table gives
each one's median ms/step and the median of its per-round ratios to ``raw``.

The peers come from the optional ``bench`` extra (``pip install -e .[bench]``);
a peer that is not installed is skipped with one line.

    python bench/peers.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import overhead  # noqa: E402  (bench/overhead.py: the workload, the raw loop and the pimm run)
from overhead import (BATCH, EPOCHS, LR, STEPS, WARMUP_RATIO, WARMUP_START, WEIGHT_DECAY,  # noqa: E402
                      BenchMLP, BenchTensorDataset, lr_factor)

SAMPLES = STEPS // EPOCHS * BATCH


def _loader(seed: int) -> DataLoader:
    torch.manual_seed(seed)
    return DataLoader(BenchTensorDataset(SAMPLES), batch_size=BATCH, shuffle=True, drop_last=True, num_workers=0)


def run_raw(workdir: Path, seed: int) -> tuple[float, float]:
    result = overhead.run_raw(seed)
    return result["loop"], result["cpu"]


def run_raw_saving(workdir: Path, seed: int) -> tuple[float, float]:
    result = overhead.run_raw(seed, save_dir=workdir / f"raw-save{seed}")
    return result["loop"], result["cpu"]


def run_pimm(workdir: Path, seed: int) -> tuple[float, float]:
    result = overhead.run_pimm(workdir, f"pimm{seed}", seed)
    assert len(result["losses"]) == STEPS, f"pimm logged {len(result['losses'])} losses, expected {STEPS}"
    return result["loop"], result["cpu"]


def make_mmengine():
    """The mmengine contender, or None when mmengine is not installed."""
    try:
        from mmengine.hooks import Hook
        from mmengine.model import BaseModel
        from mmengine.runner import Runner
    except ImportError:
        return None

    class MLP(BaseModel):
        def __init__(self):
            super().__init__()
            self.mlp = BenchMLP(hidden=overhead.HIDDEN)

        def forward(self, x, label, mode="loss"):
            out = self.mlp({"x": x, "label": label})
            return {"loss": out["loss"]} if mode == "loss" else out["cls_logits"]

    class EpochsTimer(Hook):
        """Start at the first epoch's start (runs first), stop at the last one's end (runs last)."""

        def __init__(self, timing: dict, stop: bool):
            self.timing, self.stop = timing, stop
            self.priority = "LOWEST" if stop else "HIGHEST"

        def before_train_epoch(self, runner):
            if not self.stop and "start" not in self.timing:
                self.timing["start"], self.timing["cpu_start"] = time.perf_counter(), time.process_time()

        def after_train_epoch(self, runner):
            if self.stop and runner.epoch + 1 == EPOCHS:  # runner.epoch counts up after the hooks
                self.timing["loop"] = time.perf_counter() - self.timing["start"]
                self.timing["cpu"] = time.process_time() - self.timing["cpu_start"]

    warmup = round(WARMUP_RATIO * STEPS)

    def run(workdir: Path, seed: int) -> tuple[float, float]:
        timing: dict = {}
        runner = Runner(
            model=MLP(),
            work_dir=str(workdir / f"mmengine{seed}"),
            train_dataloader=_loader(seed),
            optim_wrapper=dict(optimizer=dict(type="AdamW", lr=LR, weight_decay=WEIGHT_DECAY)),
            param_scheduler=[
                dict(type="LinearLR", start_factor=WARMUP_START, by_epoch=False, begin=0, end=warmup),
                dict(type="CosineAnnealingLR", by_epoch=False, begin=warmup, end=STEPS, T_max=STEPS - warmup),
            ],
            train_cfg=dict(by_epoch=True, max_epochs=EPOCHS),
            default_hooks=dict(logger=dict(type="LoggerHook", interval=overhead.LOG_EVERY),
                               checkpoint=dict(type="CheckpointHook", interval=1)),
            custom_hooks=[EpochsTimer(timing, stop=False), EpochsTimer(timing, stop=True)],
            randomness=dict(seed=seed),
            log_level="ERROR",
        )
        with contextlib.redirect_stdout(io.StringIO()):
            runner.train()
        torch.set_num_threads(1)
        return timing["loop"], timing["cpu"]

    return run


def make_lightning():
    """The Lightning contender (a bare Trainer), or None when lightning is not installed."""
    try:
        import lightning as L
    except ImportError:
        return None

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.mlp = BenchMLP(hidden=overhead.HIDDEN)

        def training_step(self, batch, batch_idx):
            return self.mlp(batch)["loss"]

        def configure_optimizers(self):
            optimizer = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    class EpochsTimer(L.Callback):
        def __init__(self, timing: dict):
            self.timing = timing

        def on_train_epoch_start(self, trainer, module):
            if "start" not in self.timing:
                self.timing["start"], self.timing["cpu_start"] = time.perf_counter(), time.process_time()

        def on_train_epoch_end(self, trainer, module):
            if trainer.current_epoch + 1 == EPOCHS:
                self.timing["loop"] = time.perf_counter() - self.timing["start"]
                self.timing["cpu"] = time.process_time() - self.timing["cpu_start"]

    def run(workdir: Path, seed: int) -> tuple[float, float]:
        timing: dict = {}
        torch.manual_seed(seed)
        trainer = L.Trainer(max_epochs=EPOCHS, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, callbacks=[EpochsTimer(timing)],
                            default_root_dir=str(workdir / f"lightning{seed}"))
        with contextlib.redirect_stdout(io.StringIO()):  # its tips
            trainer.fit(MLP(), train_dataloaders=_loader(seed))
        assert trainer.global_step == STEPS, trainer.global_step
        torch.set_num_threads(1)
        return timing["loop"], timing["cpu"]

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every contender once)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # Lightning's advice (num_workers, ...) is not part of the measure
    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    contenders = {"raw": run_raw, "raw+save": run_raw_saving, "pimm": run_pimm}
    for name, make in (("mmengine", make_mmengine), ("lightning", make_lightning)):
        run = make()
        if run is None:
            print(f"{name}: not installed, skipped (pip install -e .[bench])")
        else:
            contenders[name] = run
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpus: dict[str, list[float]] = {name: [] for name in contenders}
    with tempfile.TemporaryDirectory(prefix="pimm-peers-") as tmp:
        workdir = Path(tmp)
        (workdir / "warmup").mkdir()
        for name, run in contenders.items():  # untimed warm-up: lazy imports, allocator, caches
            run(workdir / "warmup", 0)
        for r in range(args.rounds):
            for name, run in contenders.items():
                gc.collect()
                assert torch.get_num_threads() == 1, (name, torch.get_num_threads())
                wall, cpu = run(workdir, r + 1)
                times[name].append(wall)
                cpus[name].append(cpu)
            print(f"round {r}: " + "  ".join(f"{name} {times[name][-1] / STEPS * 1e3:.3f}" for name in contenders)
                  + " ms/step (wall)", flush=True)

    print(f"\nworkload: {STEPS} steps, batch {BATCH}, MLP {overhead.IN_DIM}-{overhead.HIDDEN}-{overhead.HIDDEN}-"
          f"{overhead.NUM_CLASSES}, AdamW, warm-up + cosine per step, 1 thread; {args.rounds} interleaved rounds; "
          f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"torch {torch.__version__}" + "".join(
        f", {name} {__import__(name).__version__}" for name in ("mmengine", "lightning") if name in contenders))
    print("| contender | median wall ms/step | median wall ratio to raw | median CPU ms/step | median CPU ratio to raw "
          "| median wall ratio to raw+save |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in contenders:
        wall_ratio = statistics.median(t / base for t, base in zip(times[name], times["raw"]))
        cpu_ratio = statistics.median(t / base for t, base in zip(cpus[name], cpus["raw"]))
        saving_ratio = statistics.median(t / base for t, base in zip(times[name], times["raw+save"]))
        print(f"| {name} | {statistics.median(times[name]) / STEPS * 1e3:.3f} | {wall_ratio:.3f} | "
              f"{statistics.median(cpus[name]) / STEPS * 1e3:.3f} | {cpu_ratio:.3f} | {saving_ratio:.3f} |")


if __name__ == "__main__":
    main()
