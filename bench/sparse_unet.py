"""Training throughput of the sparse U-Net backbone: today's against the new one.

Three contenders train on the same LArTPC batches, one CPU thread:

* ``today``: ``SparseUNet`` as it was before the fast kernels
  (``bench/sparse_unet_reference.py``, a frozen copy) with its default
  architecture, the one ``configs/lartpc/semseg-sparseunet.py`` used;
* ``kernels``: the current ``SparseUNet`` with that same architecture and the
  same initial weights (copied from ``today``), i.e. the speed-up of the new
  kernels alone; the script checks that both give the same loss and
  gradients on the first batch;
* ``config``: the backbone of ``configs/lartpc/semseg-sparseunet.py`` as it
  is now (or ``--backbone``), the one training actually uses.

Each backbone gets a linear head, cross-entropy over the 5 classes and AdamW
with the config's learning rate and weight decay, and a training step is
forward + backward + optimizer step. Batches: ``--batches`` batches of
``--events`` events each from ``LArTPCSynthDataset`` at its default
settings (split ``train``, seed 0) through the config's transforms, the same
for everybody. After one untimed pass, rounds alternate the contenders; each
round times one pass over all batches. Throughput = points / second of CPU
time of this process (``time.process_time``; with one thread it is the time
the work needed, which on a machine shared with other jobs is steadier than
wall time, printed beside it). ``speedup`` = median seconds per round of
``today`` over those of ``config``.

Peak memory: the most tensor memory alive at once during one training step
on the largest batch, above what was alive when the step began (so
activations and what backward saves, gradients, temporaries; the weights and
optimizer state existed before). It is read off ``torch.profiler`` with
``profile_memory=True``: every allocation and release by torch's CPU
allocator, in time order, summed -- what ``torch.cuda.max_memory_allocated``
measures on a GPU. ``memory_ratio`` = that peak for ``config`` over that of
``today``. Beside it the growth of the resident set over the same step
(Linux ``VmHWM``, reset through ``/proc/self/clear_refs`` after
``malloc_trim``) is printed for context: it adds what glibc keeps of freed
blocks (its mmap threshold grows after large frees, so later blocks come from
a fragmenting heap) and varies by ~10 % from run to run; with
``MALLOC_MMAP_THRESHOLD_=65536`` it falls to the profiler's figure.

    python bench/sparse_unet.py [--rounds 5] [--batches 4] [--events 4] [--backbone "dict(...)"]

The last line is ``speedup=<x>  memory_ratio=<y>``.
"""

from __future__ import annotations

import argparse
import ast
import copy
import ctypes
import re
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pimm.datasets  # noqa: E402,F401  (registers the data set and transforms)
import pimm.models  # noqa: E402,F401  (registers the backbones)
from pimm.datasets.collate import collate_fn  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.utils.config import Config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sparse_unet_reference import ReferenceSparseUNet  # noqa: E402

CONFIG = ROOT / "configs" / "lartpc" / "semseg-sparseunet.py"
NUM_CLASSES = 5


class Trainee:
    """A backbone, a linear head, cross-entropy and AdamW: one training step."""

    def __init__(self, name: str, backbone: nn.Module, lr: float, weight_decay: float):
        self.name = name
        self.backbone = backbone
        torch.manual_seed(1)
        self.head = nn.Linear(backbone.out_channels, NUM_CLASSES)
        params = list(backbone.parameters()) + list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.num_params = sum(p.numel() for p in backbone.parameters())

    def loss(self, batch: dict) -> torch.Tensor:
        return F.cross_entropy(self.head(self.backbone(batch)), batch["segment"], ignore_index=-1)

    def step(self, batch: dict) -> None:
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def make_batches(cfg: Config, num_batches: int, events: int) -> list[dict]:
    data = dict(type="LArTPCSynthDataset", num_events=num_batches * events, split="train", seed=0,
                transform=copy.deepcopy(cfg.data.train.transform))
    dataset = DATASETS.build(data)
    return [collate_fn([dataset[b * events + i] for i in range(events)]) for b in range(num_batches)]


def check_same_numerics(today: Trainee, kernels: Trainee, batch: dict) -> str:
    """Loss and gradient agreement of two implementations with equal weights."""
    losses, grads = [], []
    for t in (today, kernels):
        t.optimizer.zero_grad(set_to_none=True)
        loss = t.loss(batch)
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad for p in t.backbone.parameters()])
        t.optimizer.zero_grad(set_to_none=True)
    worst = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(*grads))
    if abs(losses[0] - losses[1]) > 1e-4 * abs(losses[0]) or worst > 1e-2:
        raise SystemExit(f"today and kernels disagree: loss {losses[0]} vs {losses[1]}, gradient rel. error {worst:.2e}")
    return f"loss {losses[0]:.6f} vs {losses[1]:.6f}, worst relative gradient difference {worst:.1e}"


def parse_dict(text: str) -> dict:
    """``{"k": v}`` or ``dict(k=v)`` with literal values (never evaluated as code)."""
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    value = ast.literal_eval(node)
    if not isinstance(value, dict):
        raise SystemExit(f"--backbone must be a dict, got {text!r}")
    return value


def _proc_status() -> dict[str, int] | None:
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) * 1024 for k in ("VmRSS", "VmHWM")}


def peak_tensor_memory(trainee: Trainee, batch: dict) -> int:
    """Most bytes of tensor memory alive at once during one training step,
    above those alive when it began (torch's CPU allocator, via the profiler)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        trainee.step(batch)
    # The kineto events keep every allocation (FunctionEvent lists drop some).
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def peak_step_memory(trainee: Trainee, batch: dict) -> float | None:
    """Resident-set growth (bytes) over one training step, or None off Linux."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS
    except OSError:
        return None
    before = _proc_status()
    trainee.step(batch)
    after = _proc_status()
    return None if before is None or after is None else after["VmHWM"] - before["VmRSS"]


def run_round(trainee: Trainee, batches: list[dict]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in batches:
        trainee.step(batch)
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--events", type=int, default=4, help="events per batch")
    parser.add_argument("--backbone", default=None,
                        help="backbone config for 'config' as a Python dict literal (default: the semseg config's)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    cfg = Config.fromfile(CONFIG)
    backbone_cfg = dict(cfg.model.backbone) if args.backbone is None else parse_dict(args.backbone)
    backbone_cfg.setdefault("type", "SparseUNet")
    backbone_cfg.setdefault("in_channels", 1)
    lr, wd = cfg.optimizer.lr, cfg.optimizer.get("weight_decay", 0.0)
    batches = make_batches(cfg, args.batches, args.events)
    points = sum(int(b["offset"][-1]) for b in batches)

    torch.manual_seed(0)
    reference = ReferenceSparseUNet(in_channels=1)
    same = MODELS.build(dict(type="SparseUNet", in_channels=1))
    same.load_state_dict(reference.state_dict())
    torch.manual_seed(0)
    trainees = [Trainee("today", reference, lr, wd), Trainee("kernels", same, lr, wd),
                Trainee("config", MODELS.build(backbone_cfg), lr, wd)]
    trainees[1].head.load_state_dict(trainees[0].head.state_dict())

    print(f"data: {args.batches} batches x {args.events} LArTPCSynthDataset events, {points} points in all "
          f"({points / args.batches:.0f} per batch); torch {torch.__version__}, 1 thread")
    print(f"today:   bench/sparse_unet_reference.py ReferenceSparseUNet(in_channels=1), {trainees[0].num_params:,} parameters")
    print(f"kernels: SparseUNet(in_channels=1), same architecture, {trainees[1].num_params:,} parameters")
    print(f"config:  {backbone_cfg}, {trainees[2].num_params:,} parameters")
    print("today vs kernels on batch 0:", check_same_numerics(trainees[0], trainees[1], batches[0]))

    largest = max(batches, key=lambda b: int(b["offset"][-1]))
    for t in trainees:  # untimed pass: optimizer state, allocator warm-up
        run_round(t, batches)
    rss = {t.name: peak_step_memory(t, largest) for t in trainees}

    cpu: dict[str, list[float]] = {t.name: [] for t in trainees}
    wall: dict[str, list[float]] = {t.name: [] for t in trainees}
    for r in range(args.rounds):
        order = trainees if r % 2 == 0 else trainees[::-1]
        for t in order:
            c, w = run_round(t, batches)
            cpu[t.name].append(c)
            wall[t.name].append(w)

    # After the timing: the profiler is not seen to slow what follows, but why risk it.
    memory = {t.name: max(peak_tensor_memory(t, largest) for _ in range(2)) for t in trainees}
    for t in trainees:
        c, w = statistics.median(cpu[t.name]), statistics.median(wall[t.name])
        growth = rss[t.name]
        rss_text = f"{growth / 2**20:6.1f} MiB" if growth is not None else "   n/a"
        print(f"{t.name:8s} {points / c:9.0f} points/s CPU ({1e3 * c / args.batches:6.1f} ms/step; "
              f"wall {points / w:8.0f} points/s)  peak step memory {memory[t.name] / 2**20:6.1f} MiB "
              f"(RSS growth {rss_text})")
    today, kernels, config = (statistics.median(cpu[n]) for n in ("today", "kernels", "config"))
    print(f"kernels_speedup={today / kernels:.2f}  kernels_memory_ratio={memory['kernels'] / memory['today']:.2f}"
          "  (same architecture, new kernels)")
    print(f"speedup={today / config:.2f}  memory_ratio={memory['config'] / memory['today']:.2f}")


if __name__ == "__main__":
    main()
