"""Which of pimm's default services the per-step overhead comes from.

``bench/overhead.py``'s workload (an MLP, 256 steps over 2 epochs, one
thread), run as pimm with the runtime base's default hooks and then with one
service switched off by a command-line option, in interleaved rounds beside
the raw loop; and once with the checkpoints' background writes deferred
until after the timed loop (only their blocking part stays in it: what no
faster writer could beat). Reported: each variant's median CPU time per step
(``process_time``: every thread, so background writers count) and the median
of its per-round ratios to the raw loop; wall time beside it.

    python bench/overhead_services.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import torch  # noqa: E402

import overhead  # noqa: E402  (the workload, the raw loop, the config)

_EVERY_HOOK = [f"default_hooks.{name}=None" for name in (
    "checkpoint", "live_control", "information_writer", "progress_bar", "timer", "on_demand_validation")]
VARIANTS = {
    "all defaults": [],
    "no epoch-end checkpoints": ["default_hooks.checkpoint=None"],
    "no TensorBoard": ["enable_tensorboard=False"],
    "no InformationWriter": ["default_hooks.information_writer=None"],
    "no LiveControl": ["default_hooks.live_control=None"],
    "no progress bar": ["default_hooks.progress_bar=None"],
    "no IterationTimer": ["default_hooks.timer=None"],
    "no on-demand validation": ["default_hooks.on_demand_validation=None"],
    "no default hook, no TensorBoard": ["enable_tensorboard=False", *_EVERY_HOOK],
}
DEFERRED = "checkpoint writes deferred past the loop"


@contextlib.contextmanager
def writes_deferred():
    """Every CheckpointManager.save takes its blocking part (the state copy) at
    once and leaves the write for after the run: the bound of any writer."""
    from pimm.engines.state.manager import CheckpointManager

    jobs, save = [], CheckpointManager.save

    def deferred(self, global_step, epoch, extra_manifest=None, after_commit=()):
        final, job = self._prepare(global_step, epoch, extra_manifest, after_commit)
        if job is not None:
            jobs.append(job)
        return final

    CheckpointManager.save = deferred
    try:
        yield
    finally:
        CheckpointManager.save = save
        for tmp, *_ in jobs:  # written nowhere: the run is a benchmark and its folder is deleted
            shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    walls = {name: [] for name in ["raw", *VARIANTS, DEFERRED]}
    cpus = {name: [] for name in walls}
    with tempfile.TemporaryDirectory(prefix="pimm-services-") as tmp:
        workdir = Path(tmp)
        overhead.run_raw(0)  # untimed warm-up of both sides
        overhead.run_pimm(workdir, "warmup", 0)
        for r in range(args.rounds):
            raw = overhead.run_raw(r + 1)
            walls["raw"].append(raw["loop"])
            cpus["raw"].append(raw["cpu"])
            for i, (name, options) in enumerate(VARIANTS.items()):
                result = overhead.run_pimm(workdir, f"r{r}v{i}", r + 1, options=tuple(options))
                walls[name].append(result["loop"])
                cpus[name].append(result["cpu"])
            with writes_deferred():
                result = overhead.run_pimm(workdir, f"r{r}deferred", r + 1)
            walls[DEFERRED].append(result["loop"])
            cpus[DEFERRED].append(result["cpu"])
            print(f"round {r}: " + "  ".join(f"{name} {cpus[name][-1] / overhead.STEPS * 1e3:.3f}" for name in walls)
                  + " ms/step (cpu)", flush=True)
    print(f"\n{overhead.STEPS} steps; {args.rounds} interleaved rounds; load average "
          + " ".join(f"{x:.1f}" for x in __import__("os").getloadavg()))
    print("| pimm variant | median CPU ms/step | CPU ratio to raw | median wall ms/step | wall ratio to raw |")
    print("| --- | --- | --- | --- | --- |")
    for name in walls:
        cpu_ratio = statistics.median(c / b for c, b in zip(cpus[name], cpus["raw"]))
        wall_ratio = statistics.median(w / b for w, b in zip(walls[name], walls["raw"]))
        print(f"| {name} | {statistics.median(cpus[name]) / overhead.STEPS * 1e3:.3f} | {cpu_ratio:.3f} | "
              f"{statistics.median(walls[name]) / overhead.STEPS * 1e3:.3f} | {wall_ratio:.3f} |")


if __name__ == "__main__":
    main()
