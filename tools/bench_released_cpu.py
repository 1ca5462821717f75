"""Time a released-model-sized forward on the CPU:
``python tools/bench_released_cpu.py [--threads 2] [--points 1175 10000] [--repeats 5]``.

Builds the real-size Panda-Semantic architecture (upstream's
``semseg-pt-v3m2-pilarnet-ft-5cls-fft.py`` model, ``enable_flash=True`` as
released) with random weights, exports it and loads it back with
``pimm.from_pretrained(..., device="cpu")`` as a user would, then times
``model(input_dict)`` under ``torch.inference_mode()`` on LArTPC-like events
(tracks from a vertex, one point per voxel) passed through Panda's documented
inference transforms. Prints one line per event size: points, median and
best wall time of the repeats, the CPU time of a forward (all threads; on an
otherwise idle machine the wall time is about CPU time / threads), and the
machine's load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "tests" / "support" / "upstream_configs" / "panda" / "semseg" / "semseg-pt-v3m2-pilarnet-ft-5cls-fft.py"


def event(points: int, seed: int = 0):
    """About ``points`` voxels of straight tracks from one vertex, with energies."""
    import numpy as np

    rng = np.random.default_rng(seed)
    vertex, voxels = rng.uniform(184, 584, 3), np.zeros((0, 3), dtype=np.float32)
    while len(voxels) < points:
        direction = rng.normal(size=3)
        steps = np.arange(0, rng.uniform(30, 300), 0.5)
        track = np.floor(vertex + steps[:, None] * direction / np.linalg.norm(direction))
        track = track[(track >= 0).all(1) & (track < 768).all(1)]
        voxels = np.unique(np.concatenate([voxels, track.astype(np.float32)]), axis=0)
    voxels = voxels[rng.permutation(len(voxels))[:points]]
    return voxels, rng.uniform(0.05, 3.0, (len(voxels), 1)).astype(np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--points", type=int, nargs="+", default=[1175, 10000])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    import pimm
    from pimm.datasets.transform import Compose
    from pimm.models import MODELS
    from pimm.utils.config import Config

    config = Config.fromfile(str(CONFIG))
    torch.manual_seed(0)
    model = MODELS.build(config.model)
    weights = sum(p.numel() for p in model.parameters())
    pipeline = Compose([
        dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
        dict(type="LogTransform", min_val=0.01, max_val=20.0, keys=("energy",)),
        dict(type="GridSample", grid_size=0.001, hash_type="fnv", mode="train", return_grid_coord=True),
        dict(type="ToTensor"),
        dict(type="Collect", keys=("coord", "grid_coord"), feat_keys=("coord", "energy")),
    ])
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        pimm.save_pretrained(model, Path(scratch) / "Panda-Semantic", cfg={"model": config.model})
        model = pimm.from_pretrained(Path(scratch) / "Panda-Semantic", device="cpu")
        print(f"Panda-Semantic architecture: {weights:,} weights; export + from_pretrained "
              f"{time.perf_counter() - started:.1f} s; torch {torch.__version__}, {args.threads} threads")
    for points in args.points:
        coord, energy = event(points)
        np.random.seed(7)
        sample = pipeline({"coord": coord, "energy": energy})
        input_dict = {key: sample[key] for key in ("coord", "grid_coord", "feat", "offset")}
        times, cpu = [], []
        with torch.inference_mode():
            model(input_dict)  # warm-up (first-call allocations)
            for _ in range(args.repeats):
                started, cpu_started = time.perf_counter(), time.process_time()
                output = model(input_dict)
                times.append(time.perf_counter() - started)
                cpu.append(time.process_time() - cpu_started)
        load = os.getloadavg()
        print(f"{len(sample['coord']):>6} points: seg_logits {tuple(output['seg_logits'].shape)}, forward wall median "
              f"{sorted(times)[len(times) // 2]:.2f} s (best {min(times):.2f} s), CPU time median "
              f"{sorted(cpu)[len(cpu) // 2]:.2f} s; {args.repeats} runs, load average {load[0]:.1f} {load[1]:.1f} "
              f"{load[2]:.1f} on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
