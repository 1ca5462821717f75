"""Forward + backward time of the PT-v3 backbone, with a breakdown.

The model of ``configs/lartpc/semseg-ptv3.py`` (``DefaultSegmentorV2`` over
``PT-v3m2``, or ``--config``) trains on ``--batches`` batches of
``--events`` LArTPC events through the config's own transforms, one thread
(``--threads``), on ``--device``. A step is forward + loss + backward (no
optimizer step). After one untimed pass, ``--rounds`` passes over the
batches are timed; the median seconds per step is reported with points per
second, in CPU time (all threads) and in wall time (what counts with
``--threads 2``). ``--backbone KEY=VALUE ...`` overrides backbone options
(e.g. ``enc_patch_size=(32,32,32,32)``) to time a variant.

Breakdown (forward + backward of each piece, replayed in isolation on the
inputs it saw in a real forward, summed over the step's calls):

* ``serialization``: space-filling-curve codes, orders and inverses of every
  level (encoded on the finest, read off the finer level's on the coarser
  ones where that gives the same result; no backward);
* ``attention``: the patch attention (qkv, SDPA over the padded patches,
  projection);
* ``cpe``: the sparse convolutions (CPE, and PT-v3m1's stem) with their
  kernel maps (built once per level and cached, so the first call of a level
  pays for the map);
* ``pooling``: grid / serialized pooling (re-serialization excluded, it is in
  ``serialization``) and un-pooling.

The rest of a step (MLPs, norms, the head and the loss) is ``other``. The
script also checks the largest attention operand: ``(patches, heads, K,
dim)``, never ``N x N``.

``--compare configs/lartpc/semseg-sparseunet.py`` times that config's step
on the same events in rounds interleaved with PT-v3's and prints the ratio.

    python bench/ptv3.py [--rounds 3] [--batches 2] [--events 8] [--threads 1] [--device cpu]
                         [--backbone KEY=VALUE ...] [--model KEY=VALUE ...] [--compare CONFIG]
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pimm.datasets  # noqa: E402,F401  (registers the data set and transforms)
import pimm.models  # noqa: E402,F401  (registers the models)
from pimm.datasets.collate import point_collate_fn  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.models.ptv3 import attention as attention_module  # noqa: E402
from pimm.models.ptv3 import pooling as pooling_module  # noqa: E402
from pimm.models.ptv3.structure import Point  # noqa: E402
from pimm.utils.config import Config  # noqa: E402

CONFIG = ROOT / "configs" / "lartpc" / "semseg-ptv3.py"


def clock() -> float:
    """CPU time of this process on a CPU (steadier than wall time on a shared
    machine; with one thread it is the time the work took), wall time on a GPU."""
    return time.process_time() if DEVICE.type == "cpu" else time.perf_counter()


DEVICE = torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class Recorder:
    """Wraps the pieces to capture their inputs and time serialization."""

    def __init__(self, device):
        self.device = device
        self.calls = defaultdict(list)
        self.serialization = 0.0
        self.recording = False
        self.max_attention_operand = ()
        self._undo = []

    def patch(self, owner, name, wrapper):
        original = getattr(owner, name)
        setattr(owner, name, wrapper(original))
        self._undo.append((owner, name, original))

    def install(self):
        rec = self

        def serialization(original):
            def wrapped(point, *args, **kwargs):
                sync(rec.device)
                t = clock()
                out = original(point, *args, **kwargs)
                sync(rec.device)
                rec.serialization += clock() - t
                return out
            return wrapped

        def attention(original):
            def wrapped(module, point, feat=None):
                if rec.recording:
                    rec.calls["attention"].append((module, point, (point["feat"] if feat is None else feat).detach()))
                return original(module, point, feat)
            return wrapped

        def conv(original):
            def wrapped(point, module, feat, then=None):
                if rec.recording:
                    rec.calls["cpe"].append(((module, then), point, feat.detach()))
                return original(point, module, feat, then)
            return wrapped

        def pool(original):
            def wrapped(module, point):
                if rec.recording:
                    rec.calls["pooling"].append((module, Point(point), point["feat"].detach()))
                return original(module, point)
            return wrapped

        def unpool(original):
            def wrapped(module, point):
                if rec.recording:
                    parent = point["pooling_parent"]
                    rec.calls["pooling"].append((module, Point(point, pooling_parent=Point(parent)),
                                                 (point["feat"].detach(), parent["feat"].detach())))
                return original(module, point)
            return wrapped

        def sdpa(original):
            def wrapped(q, k, v, **kw):
                rec.max_attention_operand = max(rec.max_attention_operand, tuple(q.shape),
                                                key=lambda s: torch.Size(s).numel() if s else 0)
                return original(q, k, v, **kw)
            return wrapped

        self.original_conv = Point.sparse_conv  # the replay calls the unwrapped one
        self.patch(Point, "serialization", serialization)
        self.patch(Point, "coarsen_serialization", serialization)
        self.patch(Point, "sparse_conv", conv)
        self.patch(attention_module.SerializedAttention, "forward", attention)
        for cls in (pooling_module.GridPooling, pooling_module.SerializedPooling):
            self.patch(cls, "forward", pool)
        for cls in (pooling_module.GridUnpooling, pooling_module.SerializedUnpooling):
            self.patch(cls, "forward", unpool)
        self.patch(attention_module.F, "scaled_dot_product_attention", sdpa)

    def replay(self, kind: str) -> float:
        """Seconds of forward + backward of every captured call of ``kind``."""
        total = 0.0
        for module, point, feat in self.calls[kind]:
            if kind == "pooling" and isinstance(feat, tuple):
                child, parent = (f.clone().requires_grad_() for f in feat)
                p = Point(point, feat=child, pooling_parent=Point(point["pooling_parent"], feat=parent))
                args, inputs = (p,), (child, parent)
            else:
                x = feat.clone().requires_grad_()
                inputs = (x,)
                if kind == "attention":
                    args = (point, x)
                elif kind == "cpe":
                    args = (*module, x)
                else:
                    args = (Point(point, feat=x),)
            serialized = self.serialization
            sync(self.device)
            t = clock()
            if kind == "cpe":
                out = self.original_conv(point, args[0], args[2], args[1])
            else:
                out = module(*args)
            out = out["feat"] if isinstance(out, dict) else out
            out.sum().backward()
            sync(self.device)
            # pooling re-serializes the coarse level: that part is booked to serialization
            total += clock() - t - (self.serialization - serialized)
            self.serialization = serialized
            del inputs
        return total



class Stepper:
    """One config's model and its batches (the config's own transforms) of
    the same generated events, and its timed training steps."""

    def __init__(self, config: str, args, device, backbone_overrides=(), model_overrides=()):
        cfg = Config.fromfile(config)
        for item in backbone_overrides:
            key, _, value = item.partition("=")
            cfg.model["backbone"][key] = ast.literal_eval(value)
        for item in model_overrides:
            key, _, value = item.partition("=")
            cfg.model[key] = ast.literal_eval(value)
        self.name = Path(config).name
        self.cfg = cfg
        dataset = DATASETS.build(dict(cfg.data["train"], num_events=args.batches * args.events, in_memory=False))
        self.batches = [to_device(point_collate_fn([dataset[b * args.events + i] for i in range(args.events)]),
                                  device) for b in range(args.batches)]
        torch.manual_seed(0)
        self.model = MODELS.build(cfg.model).to(device).train()
        self.points = [int(b["offset"][-1]) for b in self.batches]
        self.times, self.walls = [], []

    def step(self, batch):
        out = self.model(dict(batch))
        out["loss"].backward()
        self.model.zero_grad(set_to_none=True)

    def timed_round(self, device):
        for batch in self.batches:
            sync(device)
            t, wall = clock(), time.perf_counter()
            self.step(batch)
            sync(device)
            self.times.append(clock() - t)
            self.walls.append(time.perf_counter() - wall)

    def report(self) -> float:
        per_step = statistics.median(self.times)
        params = sum(p.numel() for p in self.model.parameters())
        print(f"{self.name}: {self.cfg.model['backbone']['type']}, {params:,} parameters, "
              f"{statistics.mean(self.points):,.0f} points per batch: {per_step * 1e3:.0f} ms/step "
              f"(median of {len(self.times)}), {statistics.mean(self.points) / per_step:,.0f} points/s; "
              f"wall {statistics.median(self.walls) * 1e3:.0f} ms/step")
        return per_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(CONFIG))
    parser.add_argument("--compare", default=None, metavar="CONFIG",
                        help="also time this config's step (e.g. configs/lartpc/semseg-sparseunet.py), rounds "
                             "interleaved with the main config's so both see the same machine load")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--events", type=int, default=8, help="events per batch (the config's batch size: 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backbone", nargs="*", default=[], metavar="KEY=VALUE",
                        help="backbone options over the config's, e.g. enc_patch_size=(32,32,32,32)")
    parser.add_argument("--model", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model options over the config's, e.g. backbone_out_channels=16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    device = DEVICE = torch.device(args.device)

    main_run = Stepper(args.config, args, device, args.backbone, args.model)
    runs = [main_run] + ([Stepper(args.compare, args, device)] if args.compare else [])
    print(f"{args.batches} batches of {args.events} events, {args.threads} thread(s), {device}")
    for run in runs:
        for batch in run.batches:  # untimed warm-up
            run.step(batch)
    for _ in range(args.rounds):
        for run in runs:
            run.timed_round(device)
    per_step = main_run.report()
    if args.compare:
        other = runs[1].report()
        print(f"step ratio {main_run.name} / {runs[1].name} = {per_step / other:.2f} (CPU time)")

    # Breakdown on the first batch.
    model, batches, points, times = main_run.model, main_run.batches, main_run.points, main_run.times
    rec = Recorder(device)
    rec.install()
    rec.recording = True
    out = model(dict(batches[0]))
    rec.recording = False
    out["loss"].backward()
    model.zero_grad(set_to_none=True)
    rows = {kind: rec.replay(kind) for kind in ("attention", "cpe", "pooling")}
    rows = {"serialization": rec.serialization, **rows}
    model.zero_grad(set_to_none=True)
    total = statistics.median(times[0::args.batches])  # the first batch's steps
    print("breakdown of one step (first batch), forward+backward:")
    for kind, seconds in rows.items():
        calls = "all levels" if kind == "serialization" else f"{len(rec.calls[kind])} calls"
        print(f"  {kind:<14} {seconds * 1e3:8.1f} ms  {100 * seconds / total:5.1f}%  ({calls})")
    other = total - sum(rows.values())
    print(f"  {'other':<14} {other * 1e3:8.1f} ms  {100 * other / total:5.1f}%  (MLP, norms, head, loss)")
    q = rec.max_attention_operand
    n = points[0]
    print(f"largest attention operand (patches, heads, K, dim) = {q}; an N x N score matrix would be {n} x {n}")
    assert q and q[2] < n, "attention would materialise N x N"
    print(f"ms_per_step={per_step * 1e3:.0f}")


if __name__ == "__main__":
    main()
