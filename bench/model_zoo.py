"""Training step time of several point-cloud backbones on the same LArTPC batches.

Every model named by ``--models`` trains on the same ``--batches`` batches of
``--events`` ``LArTPCSynthDataset`` events (default settings, split
``train``, seed 0) through one transform (``GridSample(grid_size=1,
return_grid_coord=True)``, log energy as the one input feature; the batches
hold ``coord``, ``grid_coord``, ``feat``, ``segment``), one CPU thread
(``--threads``). A step is forward, cross-entropy over the 5 classes,
backward and an AdamW step (lr 3e-3); a backbone that ends in its own
classifier (``output_classes``: ``SpUNet-*`` with ``num_classes``,
``MinkUNet*``) is the segmentor as upstream's ``DefaultSegmentor`` runs it,
any other gets a linear head. After one untimed pass, ``--rounds`` rounds
alternate the models (the order reversed every other round); each round times
one pass over all batches. Reported per model: parameters, the median CPU
time per step (``time.process_time``: with one thread the time the work
needed, steadier than wall time on a shared machine, which is printed
beside it), points per second and the ratio to the first model.

A model spec is a name from ``SPECS`` below (each a backbone config; the
shipped configs' backbones where there is one) or ``LABEL=dict(type=..., ...)``
for any registered backbone (``in_channels=1``).

    python bench/model_zoo.py [--models SpUNet-v1m1 MinkUNet14A SparseUNet PT-v3m2] [--rounds 3]
                              [--batches 2] [--events 4] [--threads 1]

The last line is ``<label>=<ms per step> ...`` for every model, in order.
"""

from __future__ import annotations

import argparse
import ast
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
import pimm.models  # noqa: E402,F401  (registers the models)
from pimm.datasets.collate import point_collate_fn  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.models.segmentor_v2 import DefaultSegmentorV2  # noqa: E402
from pimm.utils.config import Config  # noqa: E402
from pimm.utils.config_domains import ask_class  # noqa: E402

NUM_CLASSES = 5
CONFIGS = ROOT / "configs" / "lartpc"
TRANSFORM = [
    dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
    dict(type="LogTransform", key="energy"),
    dict(type="ToTensor"),
    dict(type="Collect", keys=("coord", "grid_coord", "segment"), feat_keys=("energy",)),
]


def _config_backbone(name: str) -> dict:
    backbone = dict(Config.fromfile(str(CONFIGS / name)).model.backbone)
    backbone["in_channels"] = 1  # the shared batches carry log energy only
    return backbone


#: label -> backbone config, built when the model is asked for. New families add their line here.
SPECS = {
    "SparseUNet": lambda: _config_backbone("semseg-sparseunet.py"),
    "PT-v3m2": lambda: _config_backbone("semseg-ptv3.py"),
    "SpUNet-v1m1": lambda: _config_backbone("semseg-spunet.py"),
    "SpUNet-v1m1-default": lambda: dict(type="SpUNet-v1m1", in_channels=1, num_classes=NUM_CLASSES),
    "MinkUNet14A": lambda: dict(type="MinkUNet14A", in_channels=1, out_channels=NUM_CLASSES),
    "MinkUNet34C": lambda: dict(type="MinkUNet34C", in_channels=1, out_channels=NUM_CLASSES),
    # the shipped config's cells are 3-24 voxels in its normalised coordinates; these batches are in voxels
    "PT-v2m2": lambda: dict(_config_backbone("semseg-ptv2.py"), grid_sizes=(3.0, 6.0, 12.0, 24.0)),
    "PointTransformer-Seg26": lambda: dict(type="PointTransformer-Seg26", in_channels=1, num_classes=NUM_CLASSES),
    # docs/models.md's LitePT and Volt lines (semseg-ptv3.py's widths)
    "LitePT": lambda: dict(type="LitePT", in_channels=1, stride=(2, 2, 2), enc_depths=(1, 1, 1, 1),
                           enc_channels=(18, 36, 72, 96), enc_num_head=(1, 2, 4, 4), enc_patch_size=(64,) * 4,
                           enc_conv=(True, True, False, False), enc_attn=(False, False, True, True),
                           enc_rope_freq=(100.0,) * 4, dec_depths=(0, 0, 0), dec_channels=(16, 36, 72),
                           dec_num_head=(1, 2, 4), dec_patch_size=(64,) * 3, dec_conv=(False,) * 3,
                           dec_attn=(False,) * 3, dec_rope_freq=(100.0,) * 3, mlp_ratio=2, drop_path=0.0),
    "Volt-v1m2": lambda: dict(type="Volt-v1m2", in_channels=1, stem_channels=16, embed_dim=96, depth=4, num_heads=4,
                              rope_freq_split=(4, 4, 4), decoder_dim=32, drop_path=0.0),
    "Volt-v1m1": lambda: dict(type="Volt-v1m1", in_channels=1, stem_channels=16, embed_dim=48, depth=2, num_heads=2,
                              rope_freq_split=(4, 4, 4), drop_path=0.0),
}


def parse_spec(text: str) -> tuple[str, dict]:
    """``NAME`` (a key of SPECS) or ``LABEL=dict(k=v, ...)`` with literal values (never evaluated as code)."""
    if "=" not in text or text.split("=", 1)[0] in SPECS:
        if text not in SPECS:
            raise SystemExit(f"unknown model {text!r}: one of {', '.join(SPECS)} or LABEL=dict(type=..., ...)")
        return text, SPECS[text]()
    label, literal = text.split("=", 1)
    node = ast.parse(literal, mode="eval").body
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict"):
        raise SystemExit(f"{label}: expected dict(type=..., ...), got {literal!r}")
    return label, {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}


class Trainee:
    """A backbone, a linear head unless it has its own classifier, cross-entropy and AdamW."""

    def __init__(self, label: str, cfg: dict):
        self.label, self.cfg = label, cfg
        torch.manual_seed(0)
        self.backbone = MODELS.build(dict(cfg))
        own = ask_class(cfg, "model", "output_classes")
        self.head = nn.Identity() if own == NUM_CLASSES else nn.Linear(self.backbone.out_channels, NUM_CLASSES)
        params = list(self.backbone.parameters()) + list(self.head.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=3e-3, weight_decay=1e-4)
        self.num_params = sum(p.numel() for p in self.backbone.parameters())

    def step(self, batch: dict) -> None:
        # A Point (PT-v3, LitePT, Volt) back on the input points, as DefaultSegmentorV2 reads it.
        feat, _ = DefaultSegmentorV2.point_features(self.backbone(dict(batch)))
        loss = F.cross_entropy(self.head(feat), batch["segment"].long(), ignore_index=-1)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()


def make_batches(num_batches: int, events: int) -> list[dict]:
    dataset = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=num_batches * events, split="train", seed=0,
                                  transform=TRANSFORM))
    return [point_collate_fn([dataset[b * events + i] for i in range(events)]) for b in range(num_batches)]


def run_round(trainee: Trainee, batches: list[dict]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in batches:
        trainee.step(batch)
    return time.process_time() - cpu, time.perf_counter() - wall


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["SpUNet-v1m1", "MinkUNet14A", "SparseUNet", "PT-v3m2"],
                        help=f"model specs: {', '.join(SPECS)}, or LABEL=dict(type=..., ...)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--events", type=int, default=4, help="events per batch")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    specs = [parse_spec(text) for text in args.models]
    batches = make_batches(args.batches, args.events)
    points = sum(int(b["offset"][-1]) for b in batches)
    print(f"data: {args.batches} batches x {args.events} LArTPCSynthDataset events, {points} points in all "
          f"({points / args.batches:.0f} per batch); torch {torch.__version__}, {args.threads} thread(s)")
    trainees = [Trainee(label, cfg) for label, cfg in specs]
    for t in trainees:
        print(f"{t.label}: {t.cfg}, {t.num_params:,} parameters")
        run_round(t, batches)  # untimed: optimizer state, allocator warm-up

    cpu: dict[str, list[float]] = {t.label: [] for t in trainees}
    wall: dict[str, list[float]] = {t.label: [] for t in trainees}
    for r in range(args.rounds):
        for t in trainees if r % 2 == 0 else trainees[::-1]:
            c, w = run_round(t, batches)
            cpu[t.label].append(c)
            wall[t.label].append(w)

    first = statistics.median(cpu[trainees[0].label])
    print(f"{'model':22s} {'parameters':>12s} {'ms/step (CPU)':>14s} {'wall':>8s} {'points/s':>9s} "
          f"{'x ' + trainees[0].label:>14s}")
    for t in trainees:
        c, w = statistics.median(cpu[t.label]), statistics.median(wall[t.label])
        print(f"{t.label:22s} {t.num_params:12,d} {1e3 * c / args.batches:14.1f} {1e3 * w / args.batches:8.1f} "
              f"{points / c:9.0f} {c / first:14.2f}")
    print("  ".join(f"{t.label}={1e3 * statistics.median(cpu[t.label]) / args.batches:.1f}" for t in trainees))


if __name__ == "__main__":
    main()
