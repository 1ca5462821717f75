"""CPU cost of one synthetic LArTPC event: today's generator against the frozen original.

Both generators simulate the same events -- ``np.random.default_rng([seed,
split_code, index])`` for every index of ``--splits`` x ``--seeds`` --
with ``--options`` (the data set's defaults unless given). Every field of every
event is compared (values, dtypes, shapes); one difference stops the script,
since the optimised generator must reproduce the original bit for bit.

Timing: ``--events`` per round and contender, CPU time of this process
(``time.process_time``, one thread: the work itself, steadier than wall time
on a machine shared with other jobs, which is printed beside it). One
untimed warm-up round, then ``--rounds`` rounds alternating original/current
so that load changes hit both; the figure is the median ms/event over rounds.

    python bench/lartpc_generator.py [--events 200] [--rounds 7] [--check 300]
        [--options "dict(points_per_event=6000)"]

The last line is ``speedup=<x>`` (median original / median current).
"""

from __future__ import annotations

import argparse
import ast
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "bench"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import numpy as np  # noqa: E402

import lartpc_generator_reference as reference  # noqa: E402
from pimm.datasets import lartpc  # noqa: E402

FIELDS = ("coord", "energy", "segment", "instance", "interaction")


def streams(seeds: list[int], splits: list[int], count: int):
    """The ``count`` seed triples the data set would use, split-major."""
    per = -(-count // (len(seeds) * len(splits)))
    return [[s, c, i] for s in seeds for c in splits for i in range(per)][:count]


def first_difference(ours: dict, theirs: dict) -> str | None:
    for key in FIELDS:
        a, b = ours[key], theirs[key]
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{key}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        if a.tobytes() != b.tobytes():
            return f"{key}: {int(np.sum(a != b))} values differ"
    return None


def check_identical(keys: list[list[int]], options: dict) -> int:
    points = 0
    for key in keys:
        ours = lartpc.generate_event(np.random.default_rng(key), **options)
        theirs = reference.generate_event(np.random.default_rng(key), **options)
        problem = first_difference(ours, theirs)
        if problem:
            raise SystemExit(f"event {key} differs from the original generator: {problem}")
        points += len(ours["coord"])
    return points


def time_round(generate, keys: list[list[int]], options: dict) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    for key in keys:
        generate(np.random.default_rng(key), **options)
    return (time.process_time() - cpu) * 1e3 / len(keys), (time.perf_counter() - wall) * 1e3 / len(keys)


def parse_dict(text: str) -> dict:
    """``dict(k=v)`` or ``{"k": v}`` with literal values (never evaluated as code)."""
    node = ast.parse(text, mode="eval").body
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args:
        return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
    return dict(ast.literal_eval(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=200, help="events per timed round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--check", type=int, default=300, help="events compared field by field")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--splits", type=int, nargs="+", default=[0, 1, 2], help="split codes (train val test)")
    parser.add_argument("--options", default="dict()", help="generate_event options, e.g. dict(points_per_event=6000)")
    args = parser.parse_args()
    options = parse_dict(args.options)

    check_keys = streams(args.seeds, args.splits, args.check)
    points = check_identical(check_keys, options)
    print(f"identical: {len(check_keys)} events ({points / len(check_keys):.0f} points/event), every field bit for bit")

    keys = streams(args.seeds, args.splits, args.events)
    contenders = {"original": reference.generate_event, "current": lartpc.generate_event}
    for generate in contenders.values():
        time_round(generate, keys[: max(1, len(keys) // 4)], options)
    cpu = {name: [] for name in contenders}
    wall = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, generate in contenders.items():
            c, w = time_round(generate, keys, options)
            cpu[name].append(c)
            wall[name].append(w)
    load = os.getloadavg()[0]
    print(f"{len(keys)} events x {args.rounds} rounds, options {options or 'defaults'}, "
          f"load average {load:.1f} on {os.cpu_count()} CPUs")
    for name in contenders:
        print(f"{name:>9}: {statistics.median(cpu[name]):.2f} ms CPU/event "
              f"(min {min(cpu[name]):.2f}, max {max(cpu[name]):.2f}), wall {statistics.median(wall[name]):.2f} ms")
    speedup = statistics.median(cpu["original"]) / statistics.median(cpu["current"])
    print(f"speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
