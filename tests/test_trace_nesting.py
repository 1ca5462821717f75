"""The Chrome trace export nests: on every thread each slice lies inside its
parent or follows it (issue 22: ~10 % of the main thread's slices crossed their
parent's end, start rounded to a microsecond, duration not). Checked with the
strict trace-event reader of tests/support/chrome_trace.py."""

from __future__ import annotations

import json

import pytest

from pimm.engines.observe.tracing import Tracer
from pimm.cli.trace_report import export
from tests.support.chrome_trace import crossings, load
from tests.support.run import run_tool, write_toy_config


def test_the_checker_catches_a_crossing_slice():
    parent = {"ph": "X", "pid": 0, "tid": 0, "ts": 1, "dur": 1}
    child = {"ph": "X", "pid": 0, "tid": 0, "ts": 2, "dur": 1}
    inside = {"ph": "X", "pid": 0, "tid": 0, "ts": 1, "dur": 1}
    assert crossings([parent, child]) == []  # follows exactly
    assert crossings([{**parent, "dur": 2}, child, inside]) == []
    assert crossings([{**parent, "dur": 2}, {**child, "dur": 2}]) != []


def test_sub_microsecond_boundaries_still_nest(tmp_path):
    """A parent from 1999 ns to 3001 ns with a child from 2000 ns to 3001 ns:
    floored start with an exact duration put the child's end 1 ns past the
    parent's (1.002 µs from 1 µs against 1.001 µs from 2 µs)."""
    tracer = Tracer(tmp_path, rank=0, world_size=1)
    tracer._unix_offset_ns = 1_700_000_000 * 10**9
    records = [("X", "step", 0, 0, 1999, 1002, None, None), ("X", "forward", 0, 0, 2000, 1001, None, None),
               ("X", "a", 0, 0, 3001, 500, None, None), ("X", "b", 0, 0, 3501, 499, None, None)]
    lines = [json.loads(line) for line in tracer._format_all(records).splitlines()]
    events = [{"ph": "X", "pid": 0, "tid": 0, "ts": round(r["ts"] * 1e6), "dur": round(r["dur"] * 1e9) // 1000}
              for r in lines]
    assert crossings(events) == []
    assert [e["ts"] + e["dur"] - 1_700_000_000 * 10**6 for e in events] == [3, 3, 3, 4]  # floors of the true ends


@pytest.mark.slow
def test_a_ddp_runs_export_nests_on_every_thread(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save)
    out = run_tool("train", cfg, "epoch=2", "structured_logging.enabled=True", num_gpus=2)
    assert out.returncode == 0, out.stderr
    events = load(export(save))
    slices = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in slices} == {0, 1}
    assert len(slices) > 200  # steps, phases and hooks of two ranks
    bad = crossings(events)
    assert bad == [], f"{len(bad)} of {len(slices)} slices cross their parent, e.g. {bad[:3]}"
