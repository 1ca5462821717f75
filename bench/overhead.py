"""Per-step overhead of pimm's DefaultTrainer against a hand-written PyTorch loop.

Both sides train the same 3-layer MLP on the same in-memory tensor data set
(dict batches ``{"x", "label"}``, batch 64, 256 steps, one CPU thread) with
AdamW and the same per-step cosine-with-warm-up learning-rate schedule, and
both keep every step's loss (on the device, fetched every 20 steps).

pimm runs exactly as a user's config would: built in-process through
``load_config`` / ``build_trainer`` with the default hooks of
``configs/_base_/default_runtime.py`` (CheckpointLoader, IterationTimer,
InformationWriter(log_frequency=20), ProgressBar, CheckpointSaver with only
the epoch-end save), a train.log, metrics.jsonl and TensorBoard. ``epoch=1``
over 256 batches, so the run writes exactly one checkpoint, at its end.

What is timed: the epoch loop (``trainer.run_epoch``: creating the epoch's
data iterator, then 256 x (before_step hooks, run_step, after_step hooks)),
against the raw loop's ``for batch in loader`` over 256 steps. Construction
is excluded on both sides; the epoch-end checkpoint is excluded from the
ratio and reported separately (``pimm_train_total`` is the whole
``trainer.train()``, checkpoint and writer close included).

Rounds alternate raw/pimm (ABAB...) after one untimed warm-up of each, and
the medians of the per-round ms/step give ``overhead_ratio = pimm / raw``.

    python bench/overhead.py [--rounds 7] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import logging
import math
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
from pimm.engines.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.utils.logger import setup_logger  # noqa: E402

STEPS = 256
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
epoch = 1
batch_size = {batch}
num_worker = 0
model = dict(type="BenchMLP", in_dim={in_dim}, hidden={hidden}, num_layers=3, num_classes={classes})
data = dict(train=dict(type="BenchTensorDataset", num_samples={samples}, dim={in_dim}, num_classes={classes}))
optimizer = dict(type="AdamW", lr={lr}, weight_decay={wd})
scheduler = dict(type="CosineWarmupLR", warmup_ratio={warmup})
# hooks: the defaults of _base_/default_runtime.py, untouched
"""


def _drop_hooks(*names: str):
    def edit(cfg) -> None:
        cfg.hooks = [h for h in cfg.hooks if h["type"] not in names]
    return edit


def _plain_loader(trainer) -> None:
    # The epoch's batches from torch's DataLoader(shuffle=True) instead of the
    # resumable StatefulDataLoader + StatefulRandomSampler + SeededDataset.
    dataset = trainer.train_loader.dataset.dataset
    trainer.train_loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True,
                                      generator=torch.Generator())


def _no_edit(_) -> None:
    pass


def _both(*steps):
    def apply(target) -> None:
        for step in steps:
            step(target)
    return apply


def _set(key: str, value):
    def edit(cfg) -> None:
        cfg[key] = value
    return edit


# variant -> (config edit before build, trainer patch after build). Bench-only
# switches that attribute pimm's per-step time to its components (--ablate).
ABLATIONS = {
    "default": (_no_edit, _no_edit),
    "no_tensorboard": (_set("enable_tensorboard", False), _no_edit),
    "no_InformationWriter": (_drop_hooks("InformationWriter"), _no_edit),
    "no_IterationTimer": (_drop_hooks("IterationTimer"), _no_edit),
    "plain_DataLoader": (_no_edit, _plain_loader),
    "no_hooks+plain_DataLoader": (_drop_hooks("CheckpointLoader", "IterationTimer", "InformationWriter",
                                              "ProgressBar", "CheckpointSaver"), _plain_loader),
}


def lr_factor(step: int, total: int = STEPS) -> float:
    """The same schedule as pimm's CosineWarmupLR(warmup_ratio=WARMUP_RATIO), written out."""
    warmup = round(WARMUP_RATIO * total)
    if step < warmup:
        return WARMUP_START + (1.0 - WARMUP_START) * step / warmup
    progress = min(step - warmup, total - warmup) / (total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def run_raw(seed: int) -> dict:
    """The hand-written loop; returns the loop time and the recorded losses."""
    torch.manual_seed(seed)
    dataset = BenchTensorDataset(STEPS * BATCH)
    model = BenchMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True, num_workers=0)
    losses: list[float] = []
    pending: list[torch.Tensor] = []
    gc.collect()
    start = time.perf_counter()
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
    if pending:
        losses.extend(torch.stack(pending).tolist())
    loop = time.perf_counter() - start
    assert len(losses) == STEPS, len(losses)
    return {"loop": loop}


def build_pimm(workdir: Path, tag: str, seed: int, variant: str = "default"):
    """A DefaultTrainer built from a config file, as tools/train.py would build it
    (``variant`` other than "default": one component switched off, see ABLATIONS)."""
    save_path = workdir / tag
    cfg_file = workdir / f"{tag}_cfg.py"
    cfg_file.write_text(CONFIG.format(
        base=str(ROOT / "configs" / "_base_" / "default_runtime.py"), save_path=str(save_path), seed=seed,
        batch=BATCH, in_dim=IN_DIM, hidden=HIDDEN, classes=NUM_CLASSES, samples=STEPS * BATCH, lr=LR,
        wd=WEIGHT_DECAY, warmup=WARMUP_RATIO))
    cfg = load_config(str(cfg_file), [], world_size=1)
    ABLATIONS[variant][0](cfg)
    # train.log as the CLI writes it, minus the console copy (it would flood this output).
    logger = setup_logger(cfg.save_path, rank=0)
    for handler in list(logger.handlers):
        if not isinstance(handler, logging.FileHandler):
            logger.removeHandler(handler)
    trainer = build_trainer(cfg)
    ABLATIONS[variant][1](trainer)
    return trainer


def run_pimm(workdir: Path, tag: str, seed: int, profiler: cProfile.Profile | None = None,
             variant: str = "default") -> dict:
    trainer = build_pimm(workdir, tag, seed, variant)
    timing = {}
    inner = trainer.run_epoch

    def timed_run_epoch():
        # An instance attribute shadows the method for TrainerBase.train only;
        # nothing else about the loop changes.
        gc.collect()
        if profiler is not None:
            profiler.enable()
        start = time.perf_counter()
        try:
            inner()
        finally:
            timing["loop"] = time.perf_counter() - start
            if profiler is not None:
                profiler.disable()

    trainer.run_epoch = timed_run_epoch
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


def check_same_schedule(pimm_lrs: list[float]) -> float:
    """Largest difference between pimm's logged LR and the raw loop's LambdaLR, step by step."""
    probe = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(probe, lr_factor)
    raw_lrs = []
    for _ in range(STEPS):
        raw_lrs.append(probe.param_groups[0]["lr"])  # the lr used by this step
        probe.step()
        scheduler.step()
    return max(abs(a - b) for a, b in zip(raw_lrs, pimm_lrs))


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


def ablate(workdir: Path, rounds: int) -> None:
    """Each variant alternated with the raw loop; the ratio drop from "default"
    is what the switched-off component costs per step."""
    print(f"\n# ablation ({rounds} alternating rounds per variant; ratio = variant / raw, medians)")
    base_ratio = None
    for variant in ABLATIONS:
        ratios = []
        for r in range(rounds):
            raw = run_raw(r + 1)["loop"]
            ratios.append(run_pimm(workdir, f"{variant}{r}", r + 1, variant=variant)["loop"] / raw)
        ratio = statistics.median(ratios)
        base_ratio = ratio if base_ratio is None else base_ratio
        print(f"{variant:28s} ratio {ratio:.3f}  (saves {base_ratio - ratio:+.3f} of raw step time)  "
              f"rounds: {' '.join(f'{x:.2f}' for x in ratios)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each loop (alternating)")
    parser.add_argument("--profile", action="store_true", help="also cProfile one pimm epoch loop")
    parser.add_argument("--ablate", action="store_true",
                        help="also time pimm with single components switched off (attribution)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="pimm-bench-") as tmp:
        workdir = Path(tmp)
        # Untimed warm-up of both: lazy imports (tensorboardX), allocator, caches.
        run_raw(0)
        warm = run_pimm(workdir, "warmup", 0)
        assert len(warm["losses"]) == STEPS, f"pimm logged {len(warm['losses'])} losses, expected {STEPS}"
        lr_gap = check_same_schedule(warm["lrs"])
        raw_ms, pimm_ms, total_ms = [], [], []
        for r in range(args.rounds):
            raw = run_raw(r + 1)
            pimm = run_pimm(workdir, f"round{r}", r + 1)
            raw_ms.append(raw["loop"] / STEPS * 1e3)
            pimm_ms.append(pimm["loop"] / STEPS * 1e3)
            total_ms.append(pimm["total"] * 1e3)
            print(f"round {r}: raw {raw_ms[-1]:.3f} ms/step  pimm {pimm_ms[-1]:.3f} ms/step  "
                  f"ratio {pimm_ms[-1] / raw_ms[-1]:.3f}  (pimm train() total {total_ms[-1]:.0f} ms)", flush=True)
        raw_med, pimm_med = statistics.median(raw_ms), statistics.median(pimm_ms)
        print(f"\nworkload: {STEPS} steps, batch {BATCH}, MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{NUM_CLASSES}, AdamW, "
              f"CosineWarmupLR, 1 thread, num_workers 0; pimm hooks: default_runtime.py defaults")
        print(f"pimm checkpoints per run: {len(warm['checkpoints'])} ({', '.join(warm['checkpoints'])}), "
              f"epoch-end only; excluded from ms/step")
        print(f"LR schedules match: max |lr_pimm - lr_raw| = {lr_gap:.2e}")
        print(f"pimm train() total (loop + epoch-end checkpoint + close), median: {statistics.median(total_ms):.0f} ms"
              f" = {statistics.median(total_ms) / STEPS:.3f} ms/step amortised")
        print(f"min over rounds: raw {min(raw_ms):.3f} pimm {min(pimm_ms):.3f} ratio {min(pimm_ms) / min(raw_ms):.3f}")
        print(f"raw_ms_per_step={raw_med:.4f} pimm_ms_per_step={pimm_med:.4f} overhead_ratio={pimm_med / raw_med:.4f}")
        if args.ablate:
            ablate(workdir, max(3, args.rounds // 2))
        if args.profile:
            profile_pimm(workdir)


if __name__ == "__main__":
    main()
