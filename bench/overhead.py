"""Per-step overhead of pimm's DefaultTrainer against a hand-written PyTorch loop.

Both sides train the same 3-layer MLP on the same in-memory tensor data set
(dict batches ``{"x", "label"}``, batch 64, 256 steps, one CPU thread) with
AdamW and the same per-step cosine-with-warm-up learning-rate schedule, and
both keep every step's loss (on the device, fetched every 20 steps).

pimm runs exactly as a user's config would: built in-process through
``load_config`` / ``build_trainer`` with the runtime base's ``default_hooks``
(CheckpointLoader, IterationTimer, InformationWriter(log_frequency=20),
ProgressBar, LiveControl, OnDemandValidation, CheckpointSaver with the
epoch-end saves), a train.log, metrics.jsonl and TensorBoard: ``epoch=2`` over
128 batches each, so the run writes two checkpoints (and model_last.pth).

What is timed: the epoch loops (``trainer._run_epochs``: per epoch, the data
iterator, 128 x (before_step hooks, run_step, after_step hooks), then the
after_epoch hooks, whose CheckpointSaver saves a checkpoint: the training
thread blocks for the state copy, a background writer writes and commits),
against the raw loop's ``for epoch: for batch in loader`` over the same 256
steps, which writes no checkpoint. Construction is excluded on both sides;
the wait for the last checkpoint's commit at the end of training is reported
separately (``pimm train() total`` includes it and the writer's close).

Rounds alternate raw/pimm (ABAB...) after one untimed warm-up of each, and
the medians of the per-round ms/step give ``overhead_ratio = pimm / raw``.
CPU time (``process_time``, every thread of the process, so tensorboardX's
writer threads count) is reported beside wall time: on a machine shared
with other jobs it is the steadier of the two.

``--components`` times pimm's per-step pieces (data loading, run_step, each
hook) in isolation against their raw counterparts, with deterministic
Python call counts, and ranks their extra cost; ``--profile`` prints a
cProfile of one pimm epoch loop (top 25 cumulative entries inside pimm/).

    python bench/overhead.py [--rounds 11] [--components] [--profile] [--hidden 256]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import pimm.engines  # noqa: E402,F401  (registers DefaultTrainer and the built-in hooks)
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.utils.logger import setup_logger  # noqa: E402

STEPS = 256  # in all, over EPOCHS epochs
EPOCHS = 2
BATCH = 64
IN_DIM = 32
HIDDEN = 256
NUM_CLASSES = 10
LOG_EVERY = 20
LR = 1e-3
WEIGHT_DECAY = 0.01
WARMUP_RATIO = 0.1
WARMUP_START = 0.001  # CosineWarmupLR's default warmup_start_factor


@DATASETS.register_module(force=True)
class BenchTensorDataset(Dataset):
    """In-memory features with labels from a fixed random linear teacher."""

    def __init__(self, num_samples: int, dim: int = IN_DIM, num_classes: int = NUM_CLASSES, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=generator)
        teacher = torch.randn(dim, num_classes, generator=generator)
        self.label = (self.x @ teacher).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index):
        return {"x": self.x[index], "label": self.label[index]}


@MODELS.register_module(force=True)
class BenchMLP(nn.Module):
    """``num_layers`` linear layers with ReLUs between them; returns logits and the loss."""

    def __init__(self, in_dim: int = IN_DIM, hidden: int = HIDDEN, num_layers: int = 3,
                 num_classes: int = NUM_CLASSES):
        super().__init__()
        dims = [in_dim] + [hidden] * (num_layers - 1) + [num_classes]
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
            layers.append(nn.Linear(a, b))
            if i < num_layers - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, batch: dict) -> dict:
        logits = self.net(batch["x"])
        return {"cls_logits": logits, "loss": nn.functional.cross_entropy(logits, batch["label"])}


CONFIG = """
_base_ = {base!r}
save_path = {save_path!r}
seed = {seed}
epoch = {epochs}
batch_size = {batch}
num_worker = 0
model = dict(type="BenchMLP", in_dim={in_dim}, hidden={hidden}, num_layers=3, num_classes={classes})
data = dict(train=dict(type="BenchTensorDataset", num_samples={samples}, dim={in_dim}, num_classes={classes}))
optimizer = dict(type="AdamW", lr={lr}, weight_decay={wd})
scheduler = dict(type="CosineWarmupLR", warmup_ratio={warmup})
# hooks: the runtime base's default_hooks, untouched
"""


def lr_factor(step: int, total: int = STEPS) -> float:
    """The same schedule as pimm's CosineWarmupLR(warmup_ratio=WARMUP_RATIO), written out."""
    warmup = round(WARMUP_RATIO * total)
    if step < warmup:
        return WARMUP_START + (1.0 - WARMUP_START) * step / warmup
    progress = min(step - warmup, total - warmup) / (total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def run_raw(seed: int, save_dir: Path | None = None) -> dict:
    """The hand-written loop; returns its wall and CPU seconds. With
    ``save_dir`` it also ends each epoch as a careful hand-written loop does:
    ``torch.save`` of model, optimizer, scheduler and epoch into a temporary
    file, fsync, rename (what pimm's epoch-end checkpoint costs a user who
    writes the loop by hand, minus the RNG and data-position state)."""
    torch.manual_seed(seed)
    dataset = BenchTensorDataset(STEPS // EPOCHS * BATCH)
    model = BenchMLP(hidden=HIDDEN)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=0)
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    gc.collect()
    cpu_start, start = time.process_time(), time.perf_counter()
    for _ in range(EPOCHS):  # noqa: B007  (the epoch index names the checkpoint)
        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = model(batch)["loss"]
            loss.backward()
            optimizer.step()
            scheduler.step()
            pending.append(loss.detach())
            if len(pending) == LOG_EVERY:
                losses.extend(torch.stack(pending).tolist())
                pending.clear()
        if save_dir is not None:
            _save_epoch(save_dir, model, optimizer, scheduler, _ + 1)
    if pending:
        losses.extend(torch.stack(pending).tolist())
    loop, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    assert len(losses) == STEPS, len(losses)
    return {"loop": loop, "cpu": cpu}


def _save_epoch(save_dir: Path, model, optimizer, scheduler, epoch: int) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    tmp, final = save_dir / f".epoch{epoch}.pth.tmp", save_dir / f"epoch{epoch}.pth"
    with open(tmp, "wb") as fh:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "epoch": epoch}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)


def build_pimm(workdir: Path, tag: str, seed: int, options: tuple[str, ...] = ()):
    """A DefaultTrainer built from a config file (and ``--options``), as tools/train.py would build it."""
    save_path = workdir / tag
    cfg_file = workdir / f"{tag}_cfg.py"
    cfg_file.write_text(CONFIG.format(
        base=str(ROOT / "configs" / "_base_" / "default_runtime.py"), save_path=str(save_path), seed=seed,
        batch=BATCH, in_dim=IN_DIM, hidden=HIDDEN, classes=NUM_CLASSES, samples=STEPS // EPOCHS * BATCH, lr=LR,
        epochs=EPOCHS,
        wd=WEIGHT_DECAY, warmup=WARMUP_RATIO))
    cfg, hooks = load_config(str(cfg_file), list(options), world_size=1)
    # train.log as the CLI writes it, minus the console copy (it would flood this output).
    logger = setup_logger(cfg.save_path, rank=0)
    for handler in list(logger.handlers):
        if not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    return build_trainer(cfg, hooks=hooks)


def run_pimm(workdir: Path, tag: str, seed: int, profiler: cProfile.Profile | None = None,
             options: tuple[str, ...] = ()) -> dict:
    trainer = build_pimm(workdir, tag, seed, options)
    timing = {}
    inner = trainer._run_epochs

    def timed_run_epochs():
        # An instance attribute shadows the method for TrainerBase.train only;
        # nothing else about the loop changes.
        if profiler is not None:
            profiler.enable()
        cpu_start, start = time.process_time(), time.perf_counter()
        try:
            return inner()
        finally:
            timing["loop"], timing["cpu"] = time.perf_counter() - start, time.process_time() - cpu_start
            if profiler is not None:
                profiler.disable()

    trainer._run_epochs = timed_run_epochs
    gc.collect()
    start = time.perf_counter()
    trainer.train()
    timing["total"] = time.perf_counter() - start
    save_path = Path(trainer.cfg.save_path)
    timing["checkpoints"] = sorted(p.name for p in (save_path / "checkpoints").glob("step*"))
    metrics = save_path / "metrics.jsonl"
    records = [json.loads(line) for line in open(metrics)] if metrics.exists() else []
    timing["losses"] = [r["train/loss"] for r in records if "train/loss" in r]
    timing["lrs"] = [r["train/lr"] for r in records if "train/lr" in r]
    del trainer
    gc.collect()
    return timing


def check_same_schedule(pimm_lrs: list[float]) -> tuple[float, float]:
    """Largest |difference| between pimm's logged ``train/lr`` and the raw loop's
    LambdaLR: against the lr each step used, and against the lr after each
    step's ``scheduler.step()``. pimm logs the latter (InformationWriter runs
    after the step), so the second figure is the one that must be ~0."""
    probe = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(probe, lr_factor)
    used, after = [], []
    for _ in range(STEPS):
        used.append(probe.param_groups[0]["lr"])
        probe.step()
        scheduler.step()
        after.append(probe.param_groups[0]["lr"])
    return (max(abs(a - b) for a, b in zip(used, pimm_lrs)), max(abs(a - b) for a, b in zip(after, pimm_lrs)))


def profile_pimm(workdir: Path, top: int = 25) -> None:
    run_pimm(workdir, "profile_warmup", 0)
    profiler = cProfile.Profile()
    result = run_pimm(workdir, "profile", 0, profiler)
    print(f"\n# cProfile of one pimm epoch loop ({result['loop'] / STEPS * 1e3:.3f} ms/step under the profiler)")
    stats = pstats.Stats(profiler, stream=sys.stdout)
    print(f"## top {top} cumulative entries inside pimm/")
    stats.sort_stats("cumulative").print_stats(r"[/\\]pimm[/\\]", top)
    print("## top 20 functions by own time (everything)")
    stats.sort_stats("tottime").print_stats(20)


def _median_ratio(rows: list[dict], key: str) -> float:
    return statistics.median(row["pimm"][key] / row["raw"][key] for row in rows)


def _fastest(fns: dict, repeats: int = 11) -> dict:
    """Fastest wall and CPU (process_time: all threads) seconds of each function,
    run round-robin so that every one sees the same background load. On a
    shared machine the minimum of short repeats is the least disturbed figure."""
    walls = {name: [] for name in fns}
    cpus = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            gc.collect()
            cpu, wall = time.process_time(), time.perf_counter()
            fn()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (min(walls[name]), min(cpus[name])) for name in fns}


def _drain_tensorboard(trainer) -> None:
    # tensorboardX hands each event to a background thread through a
    # multiprocessing.Queue; wait for it so that thread's CPU time is counted.
    tb = getattr(trainer.writer, "_tb", None)
    queue = getattr(getattr(getattr(tb, "file_writer", None), "event_writer", None), "_event_queue", None)
    while queue is not None and (queue._buffer or not queue.empty()):
        time.sleep(0.0005)


def measure_components(workdir: Path, chunk: int = 100) -> None:
    """pimm's per-step pieces timed in isolation against their raw-loop
    counterparts on the same data, so an absolute cost per step can be given
    to each (the end-to-end ratio on a busy machine cannot resolve a few %)."""
    trainer = build_pimm(workdir, "components", 0)
    dataset = trainer.train_loader.dataset.dataset
    plain = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True)
    batches = [b for _, b in zip(range(chunk), plain)]
    fns = {}

    def draw(loader):
        return lambda: [b for _, b in zip(range(chunk), iter(loader))]

    trainer.start_epoch_data()
    fns["data: pimm train loader"] = draw(trainer.train_loader)
    fns["data: DataLoader(shuffle=True)"] = draw(plain)

    model, optimizer = trainer.model, trainer.optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)  # the raw loop's own, on a twin optimizer

    def raw_steps():  # the loss record is InformationWriter's job on the pimm side, so not here either
        for batch in batches:
            optimizer.zero_grad(set_to_none=True)
            model(batch)["loss"].backward()
            optimizer.step()
            scheduler.step()

    def pimm_steps():
        trainer._data_iter = iter(batches)
        for _ in batches:
            trainer.run_step()

    fns["step: raw step body"] = raw_steps
    fns["step: DefaultTrainer.run_step"] = pimm_steps

    trainer.call_hooks("before_train")
    state = trainer.train_state

    def hooks(before, after):
        def run():
            state.iter_in_epoch = 0
            for _ in range(chunk):
                for fn in before:
                    fn()
                state.iter_in_epoch += 1
                state.global_step += 1
                state.samples_seen += trainer.samples_per_step
                for fn in after:
                    fn()
                trainer.control.should_stop(state.global_step)
            _drain_tensorboard(trainer)
        return run

    dispatch = trainer._dispatch
    fns["hooks: all before/after_step (default set)"] = hooks(dispatch["before_step"], dispatch["after_step"])
    for fn in dispatch["after_step"]:
        name = type(fn.__self__).__name__
        fns[f"hooks: {name} only"] = hooks(dispatch["before_step"] if name == "IterationTimer" else (), (fn,))
    fns["hooks: none (loop bookkeeping only)"] = hooks((), ())
    info_writer = next(fn for fn in dispatch["after_step"] if type(fn.__self__).__name__ == "InformationWriter")
    with_tb = hooks((), (info_writer,))

    def without_tb():
        # The same writer with its TensorBoard handle switched off for this call.
        trainer.metrics.flush()
        tb, trainer.writer._tb = trainer.writer._tb, None
        try:
            with_tb()
        finally:
            trainer.writer._tb = tb

    fns["hooks: InformationWriter only, no TensorBoard"] = without_tb
    results = _fastest(fns)
    calls = {}
    for name, fn in fns.items():  # deterministic: Python calls made on the training thread
        profiler = cProfile.Profile()
        profiler.runcall(fn)
        calls[name] = pstats.Stats(profiler).total_calls / chunk
    trainer.close()

    per_step = {name: (wall / chunk * 1e6, cpu / chunk * 1e6, calls[name]) for name, (wall, cpu) in results.items()}
    raw_cpu = per_step["step: raw step body"][1] + per_step["data: DataLoader(shuffle=True)"][1]
    print(f"\n# components per step: fastest of 11 x {chunk} steps, interleaved; python calls on the training "
          f"thread (deterministic; tensorboardX's own threads not included)")
    for name, (wall, cpu, n) in per_step.items():
        print(f"{name:46s} wall {wall:8.1f} us  cpu {cpu:8.1f} us  calls {n:7.1f}")

    def minus(a: str, b: str) -> tuple:
        return tuple(x - y for x, y in zip(per_step[a], per_step[b]))

    extra = {"data loading (pimm loader - DataLoader)": minus("data: pimm train loader", "data: DataLoader(shuffle=True)"),
             "run_step (pimm - raw step body)": minus("step: DefaultTrainer.run_step", "step: raw step body")}
    extra.update({name[7:]: value for name, value in per_step.items()
                  if name.startswith("hooks: ") and "default set" not in name})
    print(f"## ranked extra cost per step (cpu; % of the raw loop's {raw_cpu:.0f} us/step). Differences below "
          f"~5% of the raw step are within this machine's noise: trust the call counts there")
    for name, (wall, cpu, n) in sorted(extra.items(), key=lambda kv: -kv[1][1]):
        print(f"{name:46s} cpu {cpu:+7.1f} us ({cpu / raw_cpu * 100:+5.1f} %)  wall {wall:+7.1f} us  calls {n:+7.1f}")


def main() -> None:
    global HIDDEN
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds of each loop (alternating)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one pimm epoch loop")
    parser.add_argument("--hidden", type=int, default=HIDDEN,
                        help="MLP width; a small one (e.g. 16) makes the framework's own cost stand out")
    parser.add_argument("--components", action="store_true",
                        help="also time pimm's per-step pieces in isolation, ranked")
    args = parser.parse_args()
    HIDDEN = args.hidden
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pimm-bench-") as tmp:
        workdir = Path(tmp)
        # Untimed warm-up of both: lazy imports (tensorboardX), allocator, caches.
        run_raw(0)
        warm = run_pimm(workdir, "warmup", 0)
        assert len(warm["losses"]) == STEPS, f"pimm logged {len(warm['losses'])} losses, expected {STEPS}"
        rows = []
        for r in range(args.rounds):
            rows.append({"raw": run_raw(r + 1), "pimm": run_pimm(workdir, f"round{r}", r + 1)})
            raw, ours = rows[-1]["raw"], rows[-1]["pimm"]
            print(f"round {r}: raw {raw['loop'] / STEPS * 1e3:.3f} ms/step  pimm {ours['loop'] / STEPS * 1e3:.3f} "
                  f"ms/step  ratio {ours['loop'] / raw['loop']:.3f}  |  cpu: raw {raw['cpu'] / STEPS * 1e3:.3f} "
                  f"pimm {ours['cpu'] / STEPS * 1e3:.3f} ratio {ours['cpu'] / raw['cpu']:.3f}  |  "
                  f"pimm train() total {ours['total'] * 1e3:.0f} ms", flush=True)

        def med(side: str, key: str) -> float:
            return statistics.median(row[side][key] for row in rows) / STEPS * 1e3

        raw_med, pimm_med = med("raw", "loop"), med("pimm", "loop")
        used_gap, after_gap = check_same_schedule(warm["lrs"])
        total_ms = statistics.median(row["pimm"]["total"] for row in rows) * 1e3
        tail_ms = statistics.median(row["pimm"]["total"] - row["pimm"]["loop"] for row in rows) * 1e3
        print(f"\nworkload: {STEPS} steps, batch {BATCH}, MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{NUM_CLASSES}, AdamW, "
              f"CosineWarmupLR(warmup_ratio={WARMUP_RATIO}), 1 thread, num_workers 0; "
              f"pimm hooks: the default_runtime.py defaults")
        print(f"pimm checkpoints per run: {len(warm['checkpoints'])} ({', '.join(warm['checkpoints'])}), "
              f"the epoch-end saves; their blocking part is inside ms/step")
        print(f"LR schedule check: max |pimm train/lr - raw lr after step| = {after_gap:.1e} "
              f"(vs lr used by the step: {used_gap:.1e})")
        print(f"pimm train() total (loops + the last checkpoint's commit + close), median {total_ms:.0f} ms; "
              f"outside the loops (restore, before_train, the wait for the last commit, close) median "
              f"{tail_ms:.0f} ms")
        print(f"cpu time (process_time, all threads) per step: raw {med('raw', 'cpu'):.4f} ms  "
              f"pimm {med('pimm', 'cpu'):.4f} ms  cpu_overhead_ratio={_median_ratio(rows, 'cpu'):.4f} "
              f"(median of per-round ratios: wall {_median_ratio(rows, 'loop'):.4f})")
        print(f"raw_ms_per_step={raw_med:.4f} pimm_ms_per_step={pimm_med:.4f} overhead_ratio={pimm_med / raw_med:.4f}")
        if args.components:
            measure_components(workdir)
        if args.profile:
            profile_pimm(workdir)


if __name__ == "__main__":
    main()
