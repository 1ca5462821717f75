"""Training step time of point-cloud models on the same LArTPC batches: backbones
side by side (``--models``), and upstream's whole-model families each beside
the model it extends (``--families``).

Both parts train on ``--batches`` batches of ``--events``
``LArTPCSynthDataset`` events (default settings, split ``train``, seed 0), one
CPU thread (``--threads``). After one untimed pass, ``--rounds`` rounds
alternate the models (the order reversed every other round); each round times
one pass over the batches. Times are the median CPU time per step
(``time.process_time``: with one thread the time the work needed, steadier
than wall time on a shared machine).

Backbones (``--models``, the default part): every model trains on batches of
one transform (``GridSample(grid_size=1, return_grid_coord=True)``, log energy
as the one input feature; the batches hold ``coord``, ``grid_coord``,
``feat``, ``segment``). A step is forward, cross-entropy over the 5 classes,
backward and an AdamW step (lr 3e-3); a backbone that ends in its own
classifier (``output_classes``: ``SpUNet-*`` with ``num_classes``,
``MinkUNet*``) is the segmentor as upstream's ``DefaultSegmentor`` runs it,
any other gets a linear head. Reported per model: parameters, CPU and wall
time per step, points per second and the ratio to the first model. A model
spec is a name from ``SPECS`` below (each a backbone config; the shipped
configs' backbones where there is one) or ``LABEL=dict(type=..., ...)`` for
any registered backbone (``in_channels=1``). The last line is
``<label>=<ms per step> ...`` for every model, in order.

Families (``--families``, all of them when named without a list), each on the
batches of its config's transform:

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

A family's training step is forward, the model's own loss, backward and an
AdamW step (lr 1e-3); an evaluation step a forward in eval mode without
gradients. Reported: CPU time per step and the ratio to the family's first
model. Families print before the backbones, so the summary line stays last.

    python bench/model_zoo.py [--models SpUNet-v1m1 MinkUNet14A SparseUNet PT-v3m2] [--rounds 3]
                              [--batches 2] [--events 4] [--threads 1]
    python bench/model_zoo.py --families [pg detector dino] [--rounds 3] [--batches 2] [--events 4]
"""

from __future__ import annotations

import argparse
import ast
import statistics
import sys
import time
from copy import deepcopy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import pimm.datasets  # noqa: E402,F401  (registers the data set and transforms)
import pimm.models  # noqa: E402,F401  (registers the models)
from pimm.datasets.collate import inseg_collate_fn, point_collate_fn  # noqa: E402
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


def _config(name: str) -> Config:
    return Config.fromfile(str(CONFIGS / name))


def _config_backbone(name: str) -> dict:
    backbone = dict(_config(name).model.backbone)
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


def make_batches(transform: list, collate, count: int, events: int) -> list[dict]:
    dataset = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=count * events, split="train", seed=0,
                                  transform=transform))
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
    segmentor = dict(type="DefaultSegmentor", num_classes=NUM_CLASSES, backbone=dict(cfg.model["backbone"]))
    return (make_batches(cfg.data["train"]["transform"], inseg_collate_fn, count, events),
            [("SpUNet-v1m1+head", segmentor), ("PG-v1m1", dict(cfg.model))], True)


def _detector(count: int, events: int):
    cfg = _config("panseg-detector.py")
    return (make_batches(cfg.data["train"]["transform"], point_collate_fn, count, events),
            [("detector-v5", dict(cfg.model)), ("detector-v3m2", deepcopy(V3M2))], False)


def _dino(count: int, events: int):
    cfg = _config("semseg-ptv3.py")
    g = torch.Generator().manual_seed(0)
    backbone = cfg.model["backbone"]
    hypercolumn = sum(backbone["dec_channels"]) + backbone["enc_channels"][-1]
    dino = dict(type="DINOEnhancedSegmentor", num_classes=NUM_CLASSES, backbone_out_channels=hypercolumn + DINO_DIM,
                backbone=dict(backbone, traceable=True), criteria=list(cfg.model["criteria"]))
    batches = make_batches(cfg.data["train"]["transform"], point_collate_fn, count, events)
    return ([_with_dino(b, g) for b in batches],
            [("DefaultSegmentorV2", dict(cfg.model)), ("DINOEnhancedSegmentor", dino)], False)


#: name -> (count, events) -> (batches, [(label, model config)], whether to time evaluation too)
FAMILIES = {"pg": _pg, "detector": _detector, "dino": _dino}


class Trainee:
    """A whole model under AdamW, trained on the loss it returns."""

    lr, weight_decay = 1e-3, 1e-2

    def __init__(self, label: str, cfg: dict):
        self.label, self.cfg = label, cfg
        torch.manual_seed(0)
        self.model = self.build(cfg)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.lr, weight_decay=self.weight_decay)
        self.num_params = sum(p.numel() for p in self.counted().parameters())

    def build(self, cfg: dict) -> nn.Module:
        return MODELS.build(deepcopy(cfg))

    def counted(self) -> nn.Module:
        return self.model

    def loss(self, batch: dict) -> torch.Tensor:
        return self.model(dict(batch))["loss"]

    def train_step(self, batch: dict) -> None:
        self.model.train()
        loss = self.loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()

    def eval_step(self, batch: dict) -> None:
        self.model.eval()
        with torch.no_grad():
            self.model(dict(batch))


class BackboneTrainee(Trainee):
    """A backbone, a linear head unless it has its own classifier, cross-entropy; parameters are the backbone's."""

    lr, weight_decay = 3e-3, 1e-4

    def build(self, cfg: dict) -> nn.Module:
        backbone = MODELS.build(dict(cfg))
        own = ask_class(cfg, "model", "output_classes")
        head = nn.Identity() if own == NUM_CLASSES else nn.Linear(backbone.out_channels, NUM_CLASSES)
        return nn.ModuleDict(dict(backbone=backbone, head=head))

    def counted(self) -> nn.Module:
        return self.model["backbone"]

    def loss(self, batch: dict) -> torch.Tensor:
        # A Point (PT-v3, LitePT, Volt) back on the input points, as DefaultSegmentorV2 reads it.
        feat, _ = DefaultSegmentorV2.point_features(self.model["backbone"](dict(batch)))
        return F.cross_entropy(self.model["head"](feat), batch["segment"].long(), ignore_index=-1)


def timed(step, batches: list[dict]) -> tuple[float, float]:
    """CPU and wall seconds per batch of one pass."""
    cpu, wall = time.process_time(), time.perf_counter()
    for batch in batches:
        step(batch)
    return (time.process_time() - cpu) / len(batches), (time.perf_counter() - wall) / len(batches)


def interleaved(trainees: list[Trainee], kinds: list[str], batches: list[dict], rounds: int) -> dict:
    """(label, kind) -> (median CPU, median wall) seconds per step, after one untimed pass of each."""
    for t in trainees:
        for kind in kinds:
            timed(getattr(t, f"{kind}_step"), batches)  # untimed: optimizer state, allocator warm-up
    times = {(t.label, kind): [] for t in trainees for kind in kinds}
    for r in range(rounds):
        for t in trainees if r % 2 == 0 else trainees[::-1]:
            for kind in kinds:
                times[(t.label, kind)].append(timed(getattr(t, f"{kind}_step"), batches))
    return {key: (statistics.median(c for c, _ in runs), statistics.median(w for _, w in runs))
            for key, runs in times.items()}


def bench_models(texts: list[str], batches: int, events: int, rounds: int) -> None:
    specs = [parse_spec(text) for text in texts]
    data = make_batches(TRANSFORM, point_collate_fn, batches, events)
    points = sum(int(b["offset"][-1]) for b in data)
    print(f"data: {batches} batches x {events} LArTPCSynthDataset events, {points} points in all "
          f"({points / batches:.0f} per batch); torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    trainees = [BackboneTrainee(label, cfg) for label, cfg in specs]
    for t in trainees:
        print(f"{t.label}: {t.cfg}, {t.num_params:,} parameters")
    times = interleaved(trainees, ["train"], data, rounds)
    first = times[(trainees[0].label, "train")][0]
    print(f"{'model':22s} {'parameters':>12s} {'ms/step (CPU)':>14s} {'wall':>8s} {'points/s':>9s} "
          f"{'x ' + trainees[0].label:>14s}")
    for t in trainees:
        c, w = times[(t.label, "train")]
        print(f"{t.label:22s} {t.num_params:12,d} {1e3 * c:14.1f} {1e3 * w:8.1f} "
              f"{points / batches / c:9.0f} {c / first:14.2f}")
    print("  ".join(f"{t.label}={1e3 * times[(t.label, 'train')][0]:.1f}" for t in trainees))


def bench_family(name: str, batches: list[dict], trainees: list[Trainee], with_eval: bool, rounds: int) -> list[str]:
    kinds = ["train"] + (["eval"] if with_eval else [])
    times = interleaved(trainees, kinds, batches, rounds)
    lines = []
    for kind in kinds:
        first = times[(trainees[0].label, kind)][0]
        for t in trainees:
            ms = times[(t.label, kind)][0]
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
        truth = F.one_hot(b["segment"].long().clamp_min(0), NUM_CLASSES).float() * 10
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


def bench_families(names: list[str], count: int, events: int, rounds: int) -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {count} batches x {events} events")
    print(f"{'family':9s} {'step':5s} {'model':22s} {'parameters':>11s} {'ms/step':>9s} {'ratio':>8s}")
    for name in names:
        batches, specs, with_eval = FAMILIES[name](count, events)
        points = sum(int(b["offset"][-1]) for b in batches) / len(batches)
        print(f"# {name}: {points:.0f} points a batch")
        trainees = [Trainee(label, cfg) for label, cfg in specs]
        for line in bench_family(name, batches, trainees, with_eval, rounds):
            print(line, flush=True)
        if name == "pg":
            print(bench_clustering(batches, specs[-1][1], rounds), flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None,
                        help=f"backbone specs: {', '.join(SPECS)}, or LABEL=dict(type=..., ...) "
                             "(default SpUNet-v1m1 MinkUNet14A SparseUNet PT-v3m2 unless --families is given)")
    parser.add_argument("--families", nargs="*", default=None, choices=list(FAMILIES),
                        help="whole-model families beside what they extend (all when named without a list)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--events", type=int, default=4, help="events per batch")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.families is not None:
        bench_families(args.families or list(FAMILIES), args.batches, args.events, args.rounds)
    if args.models is not None or args.families is None:
        models = args.models or ["SpUNet-v1m1", "MinkUNet14A", "SparseUNet", "PT-v3m2"]
        bench_models(models, args.batches, args.events, args.rounds)


if __name__ == "__main__":
    main()
