"""Step time of upstream's whole-model families on LArTPC batches, each beside
the model it extends, on the same batches.

Families (``--families``), each on the batches of its config's transform
(``LArTPCSynthDataset`` events, split ``train``, seed 0):

* ``pg``: ``PG-v1m1`` as ``configs/lartpc/inseg-pg-v1m1.py`` builds it, beside
  its backbone (``SpUNet-v1m1``) under ``DefaultSegmentor`` (a linear head,
  cross-entropy); evaluation forwards too (PG's includes the clustering),
  and the clustering alone on perfect predictions (true classes, every
  point shifted onto its instance's centroid: the densest balls);
* ``detector``: ``detector-v3m2`` as docs/models.md's options line builds it,
  beside ``configs/lartpc/panseg-detector.py``'s ``detector-v5`` (the same
  encoder and decoder widths);
* ``dino``: ``DINOEnhancedSegmentor`` on ``configs/lartpc/semseg-ptv3.py``'s
  PT-v3m2 (traceable: the decoder's hypercolumn) with 8 random DINO features
  from 256 feature points an event, beside that config's ``DefaultSegmentorV2``.

A training step is forward, the model's loss, backward and an AdamW step (lr
1e-3); an evaluation step a forward in eval mode without gradients. After one
untimed pass, ``--rounds`` rounds alternate the models (the order reversed
every other round); each round times one pass over the batches. Reported:
the median CPU time per step (``time.process_time``: with one thread the
work's time, steadier than wall time on a shared machine) and the ratio to
the family's first model.

    python bench/zoo_models.py [--families pg detector dino] [--rounds 3] [--batches 2] [--events 4]
                               [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from copy import deepcopy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pimm.datasets  # noqa: E402,F401  (registers the data set and transforms)
import pimm.models  # noqa: E402,F401  (registers the models)
from pimm.datasets.collate import inseg_collate_fn, point_collate_fn  # noqa: E402
from pimm.engines.registries import DATASETS, MODELS  # noqa: E402
from pimm.utils.config import Config  # noqa: E402

CONFIGS = ROOT / "configs" / "lartpc"
DINO_DIM, DINO_POINTS = 8, 256
V3M2_ENCODER = dict(type="PT-v3m2", in_channels=4, order=("z", "z-trans", "hilbert", "hilbert-trans"),
                    stride=(2, 2, 2), enc_depths=(1, 1, 1, 1), enc_channels=(16, 32, 48, 64),
                    enc_num_head=(1, 2, 3, 4), enc_patch_size=(64, 64, 64, 64), mlp_ratio=2, enc_mode=True)
V3M2 = dict(type="detector-v3m2", labels=("particle", "interaction"), eval_label="particle",
            label_configs=dict(particle=dict(segment_key="segment_pid")),
            num_queries=dict(particle=32, interaction=8), backbone=V3M2_ENCODER, full_in_channels=160,
            mlp_point_proj=True, hidden_channels=64, num_heads=4, depth=2, mlp_ratio=2.0, qkv_bias=True,
            criteria=[dict(type="InstanceSegmentationLoss", truth_label="instance", cost_class=1.0,
                           loss_weight_focal=2.0, loss_weight_dice=5.0, cls_weight_noobj=0.5)])


def _config(name: str) -> Config:
    return Config.fromfile(str(CONFIGS / name))


def _batches(cfg: Config, collate, count: int, events: int) -> list[dict]:
    dataset = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=count * events, split="train", seed=0,
                                  transform=cfg.data["train"]["transform"]))
    return [collate([dataset[b * events + i] for i in range(events)]) for b in range(count)]


def _with_dino(batch: dict, generator: torch.Generator) -> dict:
    """Random DINO feature points over each event's bounding box (pimm computes no DINO features)."""
    batch = dict(batch, origin_coord=batch["coord"].clone(), origin_offset=batch["offset"].clone())
    starts = [0] + batch["offset"].tolist()[:-1]
    coords = []
    for start, end in zip(starts, batch["offset"].tolist()):
        low, high = batch["coord"][start:end].min(0).values, batch["coord"][start:end].max(0).values
        coords.append(low + torch.rand(DINO_POINTS, 3, generator=generator) * (high - low))
    batch["dino_coord"] = torch.cat(coords)
    batch["dino_feat"] = torch.randn(len(coords) * DINO_POINTS, DINO_DIM, generator=generator)
    batch["dino_offset"] = torch.arange(1, len(coords) + 1) * DINO_POINTS
    return batch


def _pg(count: int, events: int):
    cfg = _config("inseg-pg-v1m1.py")
    segmentor = dict(type="DefaultSegmentor", num_classes=5, backbone=dict(cfg.model["backbone"]))
    return (_batches(cfg, inseg_collate_fn, count, events),
            [("SpUNet-v1m1+head", segmentor), ("PG-v1m1", dict(cfg.model))], True)


def _detector(count: int, events: int):
    cfg = _config("panseg-detector.py")
    return (_batches(cfg, point_collate_fn, count, events),
            [("detector-v5", dict(cfg.model)), ("detector-v3m2", deepcopy(V3M2))], False)


def _dino(count: int, events: int):
    cfg = _config("semseg-ptv3.py")
    g = torch.Generator().manual_seed(0)
    backbone = cfg.model["backbone"]
    hypercolumn = sum(backbone["dec_channels"]) + backbone["enc_channels"][-1]
    dino = dict(type="DINOEnhancedSegmentor", num_classes=5, backbone_out_channels=hypercolumn + DINO_DIM,
                backbone=dict(backbone, traceable=True), criteria=list(cfg.model["criteria"]))
    return ([_with_dino(b, g) for b in _batches(cfg, point_collate_fn, count, events)],
            [("DefaultSegmentorV2", dict(cfg.model)), ("DINOEnhancedSegmentor", dino)], False)


#: name -> (count, events) -> (batches, [(label, model config)], whether to time evaluation too)
FAMILIES = {"pg": _pg, "detector": _detector, "dino": _dino}


class Trainee:
    def __init__(self, label: str, cfg: dict):
        torch.manual_seed(0)
        self.label, self.model = label, MODELS.build(deepcopy(cfg))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.num_params = sum(p.numel() for p in self.model.parameters())

    def train_step(self, batch: dict) -> None:
        self.model.train()
        loss = self.model(dict(batch))["loss"]
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def eval_step(self, batch: dict) -> None:
        self.model.eval()
        with torch.no_grad():
            self.model(dict(batch))


def _timed(step, batches: list[dict]) -> float:
    start = time.process_time()
    for batch in batches:
        step(batch)
    return (time.process_time() - start) / len(batches)


def bench(name: str, batches: list[dict], trainees: list[Trainee], with_eval: bool, rounds: int) -> list[str]:
    kinds = [("train", Trainee.train_step)] + ([("eval", Trainee.eval_step)] if with_eval else [])
    times = {(t.label, kind): [] for t in trainees for kind, _ in kinds}
    for t in trainees:
        for _, step in kinds:
            _timed(lambda b: step(t, b), batches)  # untimed: optimizer state, allocator warm-up
    for r in range(rounds):
        for t in trainees if r % 2 == 0 else trainees[::-1]:
            for kind, step in kinds:
                times[(t.label, kind)].append(_timed(lambda b: step(t, b), batches))
    lines = []
    for kind, _ in kinds:
        first = statistics.median(times[(trainees[0].label, kind)])
        for t in trainees:
            ms = statistics.median(times[(t.label, kind)])
            lines.append(f"{name:9s} {kind:5s} {t.label:22s} {t.num_params:11,d} {1e3 * ms:9.1f} "
                         f"{ms / first:8.2f}")
    return lines


def bench_clustering(batches: list[dict], cfg: dict, rounds: int) -> str:
    """PG's evaluation clustering alone on perfect predictions: the true
    classes and every point shifted onto its instance's centroid (each
    instance one dense ball: the most neighbours a trained model gives)."""
    model = MODELS.build(deepcopy(cfg)).eval()
    inputs = []
    for b in batches:
        truth = torch.nn.functional.one_hot(b["segment"].long().clamp_min(0), 5).float() * 10
        bias = torch.where(b["instance"][:, None] >= 0, b["instance_centroid"] - b["coord"], 0.0)
        inputs.append((b["coord"], b["offset"], bias, truth))
    times, proposals = [], 0
    for _ in range(rounds + 1):
        start = time.process_time()
        for args in inputs:
            proposals += model.proposals(*args)["pred_masks"].shape[0]
        times.append((time.process_time() - start) / len(inputs))
    return (f"pg        clustering alone, perfect predictions: {1e3 * statistics.median(times[1:]):.1f} ms a batch "
            f"({proposals // (rounds + 1) // len(inputs)} proposals a batch)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--events", type=int, default=4, help="events per batch")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.batches} batches x {args.events} events")
    print(f"{'family':9s} {'step':5s} {'model':22s} {'parameters':>11s} {'ms/step':>9s} {'ratio':>8s}")
    for name in args.families:
        batches, specs, with_eval = FAMILIES[name](args.batches, args.events)
        points = sum(int(b["offset"][-1]) for b in batches) / len(batches)
        print(f"# {name}: {points:.0f} points a batch")
        for line in bench(name, batches, [Trainee(label, cfg) for label, cfg in specs], with_eval, args.rounds):
            print(line, flush=True)
        if name == "pg":
            print(bench_clustering(batches, specs[-1][1], args.rounds), flush=True)


if __name__ == "__main__":
    main()
