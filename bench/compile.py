"""Eager against ``compile=dict(enabled=True)`` on the ring example.

Trains ``configs/rings/cls-cnn.py`` (RingCNN, electron vs muon rings) through
the engine as ``tools/train.py`` builds it, once eagerly and once with the
``compile`` runtime key, each in a fresh process (so the compiled run pays
its whole compilation; inductor's on-disk cache is pointed at a fresh
directory per run unless ``--warm-cache``). A hook records the wall time of
every training step. Printed per variant:

* ``first step``: the first training step, which for the compiled run holds
  the compilation of forward and backward;
* ``compile time``: the compiled run's steps over the eager run's, summed over
  the steps slower than 3x the median step (compilation and the recompiles a
  shape change -- the last, smaller batch of an epoch, evaluation -- causes);
* ``median step``: the median step (compilation excluded), and the speed-up;
* ``val acc``: the final validation accuracy, to see that compiled training
  learns the same.

    python bench/compile.py [--epochs 4] [--mode default] [--backend inductor] [--warm-cache]

On a CPU inductor compiles C++ with the system compiler (gcc/clang); set
``OMP_NUM_THREADS`` as for any run (the script passes 1 by default).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "rings" / "cls-cnn.py"

CHILD = r'''
import json, sys, time
sys.path.insert(0, {root!r})
import logging
import pimm.datasets, pimm.evaluation, pimm.models  # registers what the config names
from pimm.engines.hooks import HookBase
from pimm.engines.run.launch import build_trainer, load_config
from pimm.utils.logger import setup_logger

class StepClock(HookBase):
    priority = "VERY_HIGH"
    def __init__(self):
        self.times = []
    def before_step(self):
        self._t = time.perf_counter()
    def after_step(self):
        self.times.append(time.perf_counter() - self._t)

cfg, hooks = load_config({config!r}, {options!r}, world_size=1)
logger = setup_logger(cfg.save_path, rank=0)
for handler in list(logger.handlers):
    if not isinstance(handler, logging.FileHandler):
        logger.removeHandler(handler)
clock = StepClock()
trainer = build_trainer(cfg, hooks=[*hooks, clock])
start = time.perf_counter()
trainer.train()
total = time.perf_counter() - start
records = [json.loads(line) for line in open(cfg.save_path + "/metrics.jsonl")]
acc = [r["val/acc"] for r in records if "val/acc" in r]
print("RESULT " + json.dumps(dict(times=clock.times, total=total, acc=acc[-1] if acc else None)))
'''


def run_variant(workdir: Path, name: str, options: list[str], warm_cache: bool) -> dict:
    save = workdir / name
    code = CHILD.format(root=str(ROOT), config=str(CONFIG), options=[f"save_path={str(save)!r}", *options])
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if not warm_cache:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(workdir / f"inductor-{name}")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{name} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the ring example (its config: 4)")
    parser.add_argument("--mode", default=None, help="compile.mode (default: torch's)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--warm-cache", action="store_true", help="reuse inductor's on-disk cache")
    args = parser.parse_args(argv)

    common = [f"epoch={args.epochs}", "default_hooks.checkpoint.async_write=False"]
    compiled_opts = ["compile.enabled=True", f"compile.backend={args.backend!r}"]
    if args.mode:
        compiled_opts.append(f"compile.mode={args.mode!r}")
    with tempfile.TemporaryDirectory(prefix="pimm-compile-") as tmp:
        results = {}
        for name, options in (("eager", common), ("compiled", common + compiled_opts)):
            wall = time.perf_counter()
            results[name] = run_variant(Path(tmp), name, options, args.warm_cache)
            results[name]["process"] = time.perf_counter() - wall

    eager, comp = results["eager"], results["compiled"]
    med_e, med_c = statistics.median(eager["times"]), statistics.median(comp["times"])
    slow_e = sum(t - med_e for t in eager["times"] if t > 3 * med_e)
    slow_c = sum(t - med_c for t in comp["times"] if t > 3 * med_c)
    import torch

    print(f"ring example ({CONFIG.relative_to(ROOT)}), {args.epochs} epochs, {len(eager['times'])} steps; "
          f"torch {torch.__version__}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '1')}, "
          f"backend={args.backend}, mode={args.mode}")
    print(f"{'variant':9s} {'first step':>11s} {'median step':>12s} {'train total':>12s} {'process':>9s} {'val acc':>8s}")
    for name, r in results.items():
        acc = f"{r['acc']:.4f}" if r["acc"] is not None else "n/a"
        print(f"{name:9s} {r['times'][0]:10.2f}s {1e3 * statistics.median(r['times']):10.2f}ms "
              f"{r['total']:11.1f}s {r['process']:8.1f}s {acc:>8s}")
    print(f"compile_time={slow_c - slow_e:.1f}s  step_speedup={med_e / med_c:.2f}  "
          f"acc_eager={eager['acc']}  acc_compiled={comp['acc']}")


if __name__ == "__main__":
    main()
