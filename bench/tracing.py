"""What structured tracing (``pimm.engines.observe.tracing``) costs on the training thread.

Three measurements, each side by side in one process, rounds interleaved,
medians reported; CPU time (``process_time``: every thread of the process,
so the tracer's flusher thread, which formats and writes, is counted):

1. **per record**: ``t = tracer.complete("forward", t)`` in a loop, for the
   enabled tracer (writing to a temporary directory, ``close()`` inside the
   timed region so formatting and writing are paid), the ``NULL_TRACER`` and
   a plain ``if tracer is not None`` check, minus an empty loop.
2. **per step**: the loop of a training step's records (8 chained spans and
   one ``batch`` counter) with nothing else in it, enabled vs disabled.
3. **on a ~1 ms step**: a 3-layer MLP training step (batch 64, one thread,
   like ``bench/overhead.py``) instrumented with the same 8 spans + counter,
   tracing on vs off (``NULL_TRACER``) vs no instrumentation at all;
   ``ratio`` is traced / uninstrumented, from the medians and from the
   fastest rounds (the steadier figure on a shared machine). Measurements 1
   and 2 are the precise ones; 3 shows them in context and needs a quiet
   machine to resolve 2 %.

    python bench/tracing.py [--records 200000] [--steps 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines.observe.tracing import NULL_TRACER, Tracer  # noqa: E402

SPANS = ("step", "data_fetch", "batch_to_device", "before_step", "forward", "backward", "optimizer", "after_step")


def _fresh_tracer(tmp: Path, round_index: int) -> Tracer:
    return Tracer(tmp / f"r{round_index}", rank=0, world_size=1, attempt=0, max_bytes=1 << 30)


def time_records(n: int, mode: str, tmp: Path, round_index: int) -> float:
    """CPU seconds for ``n`` records of ``mode`` (close included when enabled)."""
    tracer = _fresh_tracer(tmp, round_index) if mode == "enabled" else None
    if mode == "null":
        tracer = NULL_TRACER
    start = time.process_time()
    if mode == "empty":
        for _ in range(n):
            pass
    elif mode == "none-check":
        t = 0.0
        for _ in range(n):
            if tracer is not None:
                t = tracer.complete("forward", t)
    else:
        t = tracer.now()
        for _ in range(n):
            t = tracer.complete("forward", t)
    if mode == "enabled":
        tracer.close()
    return time.process_time() - start


def step_records(tracer, steps: int) -> None:
    for step in range(1, steps + 1):
        tracer.step = step
        t_step = t = tracer.now()
        for name in SPANS[1:]:
            t = tracer.complete(name, t)
        tracer.complete("step", t_step)
        tracer.counter("batch", samples=64, points=64)


def time_steps(steps: int, enabled: bool, tmp: Path, round_index: int) -> float:
    tracer = _fresh_tracer(tmp, round_index) if enabled else NULL_TRACER
    start = time.process_time()
    step_records(tracer, steps)
    tracer.close()
    return time.process_time() - start


def mlp_setup():
    import torch
    from torch import nn

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = [(torch.randn(64, 32), torch.randint(0, 10, (64,))) for _ in range(32)]
    return torch, model, optimizer, data


def time_mlp(setup, steps: int, mode: str, tmp: Path, round_index: int) -> float:
    torch, model, optimizer, data = setup
    loss_fn = torch.nn.functional.cross_entropy
    start = time.process_time()
    if mode == "plain":
        for step in range(steps):
            x, y = data[step % len(data)]
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
    else:
        tracer = _fresh_tracer(tmp, round_index) if mode == "traced" else NULL_TRACER
        for step in range(steps):
            tracer.step = step + 1
            t_step = t = tracer.now()
            x, y = data[step % len(data)]
            t = tracer.complete("data_fetch", t)
            t = tracer.complete("batch_to_device", t)
            optimizer.zero_grad(set_to_none=True)
            t = tracer.complete("before_step", t)
            loss = loss_fn(model(x), y)
            t = tracer.complete("forward", t)
            loss.backward()
            t = tracer.complete("backward", t)
            optimizer.step()
            t = tracer.complete("optimizer", t)
            t = tracer.complete("after_step", t)
            tracer.complete("step", t_step)
            tracer.counter("batch", samples=64, points=64)
        tracer.close()
    return time.process_time() - start


def median_per(results: dict, key: str, n: int) -> float:
    return statistics.median(results[key]) / n


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=2000, help="steps per round of measurements 2 and 3")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        modes = ("empty", "none-check", "null", "enabled")
        rec = {m: [] for m in modes}
        steps = {m: [] for m in ("disabled", "enabled")}
        mlp = {m: [] for m in ("plain", "null", "traced")}
        setup = mlp_setup()
        time_mlp(setup, 50, "plain", tmp, -1)  # warm-up
        for r in range(args.rounds):
            for m in modes:
                rec[m].append(time_records(args.records, m, tmp, 3 * r))
            steps["disabled"].append(time_steps(args.steps, False, tmp, 3 * r + 1))
            steps["enabled"].append(time_steps(args.steps, True, tmp, 3 * r + 1))
            for m in mlp:
                mlp[m].append(time_mlp(setup, args.steps, m, tmp, 3 * r + 2))

        empty = median_per(rec, "empty", args.records)
        print(f"1. per record (t = tracer.complete(name, t)), CPU us, loop overhead {empty * 1e6:.3f} us removed:")
        for m in modes[1:]:
            print(f"   {m:<11} {(median_per(rec, m, args.records) - empty) * 1e6:8.3f} us/record")
        off, on = median_per(steps, "disabled", args.steps), median_per(steps, "enabled", args.steps)
        print("2. per step (8 spans + 1 counter, formatting and writing included), CPU us:")
        print(f"   disabled {off * 1e6:8.3f} us/step   enabled {on * 1e6:8.3f} us/step   "
              f"-> {on * 1e6 / 1000 * 100:.2f} % of a 1 ms step")
        plain, null, traced = (median_per(mlp, m, args.steps) for m in ("plain", "null", "traced"))
        ratios = [t / p for t, p in zip(mlp["traced"], mlp["plain"])]
        fastest = {m: min(v) / args.steps for m, v in mlp.items()}
        print("3. MLP step (batch 64, 1 thread), CPU ms/step, median of rounds:")
        print(f"   plain {plain * 1e3:.4f}   NULL_TRACER {null * 1e3:.4f} (ratio {null / plain:.4f})   "
              f"traced {traced * 1e3:.4f} (ratio {traced / plain:.4f}; per-round ratios "
              f"{min(ratios):.3f}..{max(ratios):.3f})")
        print(f"   fastest round: plain {fastest['plain'] * 1e3:.4f}   NULL_TRACER {fastest['null'] * 1e3:.4f} "
              f"(ratio {fastest['null'] / fastest['plain']:.4f})   traced {fastest['traced'] * 1e3:.4f} "
              f"(ratio {fastest['traced'] / fastest['plain']:.4f})")


if __name__ == "__main__":
    main()
