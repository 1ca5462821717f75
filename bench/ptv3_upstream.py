"""PT-v3's training step in pimm against upstream pimm's own code, same CPU.

The backbone of ``configs/lartpc/semseg-ptv3.py`` (``PT-v3m2``; ``--backbone
KEY=VALUE`` overrides it) under a linear head, on the same ``--batches``
batches of ``--events`` generated events (the config's transforms), one
thread each. A step is forward, cross-entropy, backward (no optimizer);
CPU time, median over ``--rounds`` rounds, the two sides' rounds
interleaved so both see the same machine load.

Upstream runs in its own interpreter (``--upstream-python``, a scratch venv
with torch, spconv, addict, einops and numpy, as
``tests/fixtures/ptv3/make_reference.py`` documents): its sources are
exported from the git mirror (``--mirror``) into a temporary directory with
that script's stand-ins for what a CPU box lacks (``torch_scatter``'s
``segment_csr`` as ``torch.segment_reduce``, timm's ``DropPath``), and
spconv's CPU convolutions run without their fused bias (added after; spconv
refuses it on the CPU) and their backward is not asked for a CUDA stream
(spconv 2.3.8 asks unconditionally, then takes its CPU path). Nothing of upstream enters this repository, and
pimm does not depend on it: without the venv or the mirror the script says
so in one line and exits 0.

Upstream's flash path needs flash-attn (GPU only), so the like-for-like
pair is ``enable_flash=False`` on both sides (the same function); pimm's
shipped flash path (``scaled_dot_product_attention``) is timed alongside.

    python bench/ptv3_upstream.py [--rounds 5] [--batches 2] [--events 8]
        [--upstream-python /tmp/upvenv_v4/bin/python]
        [--mirror /work/.mirror/gregorkrz+particle-imaging-models/repo]
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "lartpc" / "semseg-ptv3.py"
UPSTREAM_PYTHON = Path("/tmp/upvenv_v4/bin/python")
MIRROR = Path("/work/.mirror/gregorkrz+particle-imaging-models/repo")
NUM_CLASSES = 5


def timed_steps(step, batches) -> list[float]:
    times = []
    for batch in batches:
        t = time.process_time()
        step(batch)
        times.append(time.process_time() - t)
    return times


# ------------------------------------------------------------------------------------------ upstream side
# Runs in the scratch venv: imports neither pimm (this repository's) nor anything of its venv.

def upstream_worker(batch_file: str, mirror: str, kwargs: str) -> None:
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    import upstream_standins as common

    reference = common.load_script("ptv3")
    root = Path(tempfile.mkdtemp(prefix="upstream_ptv3_bench_"))
    reference.export_upstream(Path(mirror), root)
    sys.path.insert(0, str(root))
    from spconv.pytorch.conv import SparseConvolution

    original = SparseConvolution.forward

    def bias_after(self, input, *args, **kw):  # spconv's CPU kernel refuses a fused bias
        bias = self._parameters["bias"]
        self._parameters["bias"] = None
        try:
            out = original(self, input, *args, **kw)
        finally:
            self._parameters["bias"] = bias
        return out if bias is None else out.replace_feature(out.features + bias)

    SparseConvolution.forward = bias_after
    import spconv.pytorch.ops as spconv_ops

    spconv_ops.get_current_stream = lambda: 0  # its CPU backward asks for a CUDA stream it then does not use
    from pimm.models.point_transformer_v3.point_transformer_v3m2_sonata import PointTransformerV3

    torch.set_num_threads(1)
    kwargs = json.loads(kwargs)
    head_width = kwargs.pop("head_width")
    torch.manual_seed(0)
    backbone = PointTransformerV3(**kwargs).train()
    head = torch.nn.Linear(head_width, NUM_CLASSES)
    batches = torch.load(batch_file, weights_only=True)

    def step(batch):
        point = backbone({k: v.clone() for k, v in batch.items() if k != "segment"})
        loss = torch.nn.functional.cross_entropy(head(point.feat), batch["segment"])
        loss.backward()
        backbone.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)

    for line in sys.stdin:  # "round": time one pass over the batches, answer with the seconds
        print(json.dumps(timed_steps(step, batches)), flush=True)


# ------------------------------------------------------------------------------------------ pimm side

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--events", type=int, default=8)
    parser.add_argument("--upstream-python", type=Path, default=UPSTREAM_PYTHON)
    parser.add_argument("--mirror", type=Path, default=MIRROR)
    parser.add_argument("--backbone", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        upstream_worker(*args.worker)
        return
    if not args.upstream_python.exists() or not args.mirror.exists():
        missing = args.upstream_python if not args.upstream_python.exists() else args.mirror
        print(f"skipped: {missing} is missing (upstream's scratch venv and git mirror, see the docstring)")
        return

    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    import pimm.datasets  # noqa: F401  (registers the data set and transforms)
    import pimm.models  # noqa: F401  (registers the models)
    from pimm.datasets.collate import point_collate_fn
    from pimm.engines.registries import DATASETS, MODELS
    from pimm.utils.config import Config

    torch.set_num_threads(1)
    cfg = Config.fromfile(str(CONFIG))
    backbone_cfg = dict(cfg.model["backbone"])
    for item in args.backbone:
        key, _, value = item.partition("=")
        backbone_cfg[key] = ast.literal_eval(value)
    dataset = DATASETS.build(dict(cfg.data["train"], num_events=args.batches * args.events, in_memory=False))
    batches = []
    for b in range(args.batches):
        batch = point_collate_fn([dataset[b * args.events + i] for i in range(args.events)])
        batches.append({k: batch[k] for k in ("feat", "grid_coord", "coord", "offset")}
                       | {"segment": batch["segment"].long()})
    points = statistics.mean(int(b["offset"][-1]) for b in batches)

    def pimm_stepper(flash: bool):
        spec = dict(backbone_cfg, enable_flash=flash)
        torch.manual_seed(0)
        model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=NUM_CLASSES,
                                  backbone_out_channels=cfg.model["backbone_out_channels"], backbone=spec)).train()

        def step(batch):
            logits = model({k: v for k, v in batch.items() if k != "segment"})["seg_logits"]
            F.cross_entropy(logits, batch["segment"]).backward()
            model.zero_grad(set_to_none=True)
        return step

    upstream_kwargs = {k: v for k, v in backbone_cfg.items() if k != "type"}
    upstream_kwargs.update(enable_flash=False, head_width=cfg.model["backbone_out_channels"])
    with tempfile.TemporaryDirectory() as tmp:
        batch_file = Path(tmp) / "batches.pt"
        torch.save(batches, batch_file)
        worker = subprocess.Popen(
            [str(args.upstream_python), __file__, "--worker", str(batch_file), str(args.mirror),
             json.dumps(upstream_kwargs, default=list)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp)

        def upstream_round() -> list[float]:
            worker.stdin.write("round\n")
            worker.stdin.flush()
            line = worker.stdout.readline()
            if not line:
                raise SystemExit(f"upstream's worker exited (code {worker.wait()}); see its error above")
            return json.loads(line)

        sides = {"pimm, enable_flash=False": pimm_stepper(False), "upstream, enable_flash=False": upstream_round,
                 "pimm, enable_flash=True (shipped)": pimm_stepper(True)}
        times = {name: [] for name in sides}
        print(f"{args.batches} batches of {args.events} events ({points:,.0f} points a batch), one thread, "
              f"CPU time of forward + cross-entropy + backward; {args.rounds} interleaved rounds after one untimed")
        for round_index in range(args.rounds + 1):
            for name, side in sides.items():
                seconds = side() if side is upstream_round else timed_steps(side, batches)
                if round_index:
                    times[name].extend(seconds)
        worker.stdin.close()
        worker.wait()
    median = {name: statistics.median(t) for name, t in times.items()}
    for name, seconds in median.items():
        print(f"  {name:<36} {seconds * 1e3:7.0f} ms/step (median of {len(times[name])})")
    up = median["upstream, enable_flash=False"]
    print(f"step ratio pimm / upstream: {median['pimm, enable_flash=False'] / up:.2f} (same function), "
          f"{median['pimm, enable_flash=True (shipped)'] / up:.2f} (pimm's shipped flash path)")


if __name__ == "__main__":
    main()
