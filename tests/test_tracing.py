"""Structured tracer (pimm.engines.tracing): files, records, rotation, attempts,
retention, kills and the disabled tracer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines.observe.tracing import NULL_TRACER, TRACING_DEFAULTS, Tracer, build_tracer, trace_files  # noqa: E402
from pimm.cli.jsonl import read_jsonl  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402


def lines_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def write_steps(tracer: Tracer, steps: range, flush_every: int) -> None:
    """One "step" span per step, flushed in batches (each batch may rotate the file)."""
    for step in steps:
        tracer.step = step
        tracer.complete("step", tracer.now())
        if step % flush_every == 0:
            tracer.flush()


def test_records_have_the_documented_format(tmp_path):
    before = time.time()
    tracer = build_tracer(dict(enabled=True), tmp_path, rank=3, world_size=4, attempt=2, job="7781")
    tracer.instant("train_start", resumed=False)
    tracer.step, tracer.epoch = 5, 1
    t = tracer.now()
    t = tracer.complete("data_fetch", t)
    tracer.complete("forward", t, args={"micro_batch": 0})
    with tracer.span("after_step"):
        pass
    with tracer.long_span("evaluate", split="val"):
        tracer.step = 6  # the span belongs to the step it started in
    tracer.counter("batch", samples=16, points=35210)
    tracer.complete("checkpoint_write", tracer.now(), thread="checkpoint-writer")
    tracer.close()
    after = time.time()

    [(rank, seq, path)] = trace_files(tmp_path / "trace")
    assert (rank, seq, path.name) == (3, 0, "rank00003-0000.jsonl")
    records = lines_of(path)
    meta = records[0]
    assert list(meta) == ["ph", "name", "rank", "pid", "host", "attempt", "job", "world_size", "ts"]
    assert (meta["ph"], meta["name"], meta["rank"], meta["pid"], meta["attempt"], meta["job"], meta["world_size"]) \
        == ("M", "process", 3, os.getpid(), 2, "7781", 4)
    assert before - 1 <= meta["ts"] <= after + 1

    by_name = {}
    for r in records[1:]:
        by_name.setdefault(r["name"], []).append(r)
        assert r["rank"] == 3 and before - 1 <= r["ts"] <= after + 1
        assert list(r)[:6] == ["ph", "name", "rank", "step", "epoch", "ts"]
    assert by_name["train_start"] == [{"ph": "i", "name": "train_start", "rank": 3, "step": 0, "epoch": 0,
                                       "ts": by_name["train_start"][0]["ts"], "args": {"resumed": False}}]
    fetch, forward = by_name["data_fetch"][0], by_name["forward"][0]
    assert (fetch["ph"], fetch["step"], fetch["epoch"]) == ("X", 5, 1) and fetch["dur"] >= 0
    assert "args" not in fetch and forward["args"] == {"micro_batch": 0}
    assert forward["ts"] >= fetch["ts"] + fetch["dur"] - 1e-6  # chained: forward starts where data_fetch ended
    begin, end = by_name["evaluate"]
    assert (begin["ph"], end["ph"]) == ("B", "X")
    assert begin["ts"] == end["ts"] and begin["step"] == end["step"] == 5 and end["args"] == {"split": "val"}
    assert "dur" not in begin
    assert by_name["batch"][0]["ph"] == "C" and by_name["batch"][0]["args"] == {"samples": 16, "points": 35210}
    assert by_name["batch"][0]["step"] == 6
    assert by_name["checkpoint_write"][0]["thread"] == "checkpoint-writer"


def test_begin_is_on_disk_before_it_returns_and_short_spans_within_flush_every_s(tmp_path):
    tracer = Tracer(tmp_path, flush_every_s=0.05)
    try:
        tracer.complete("forward", tracer.now())
        tracer.begin("checkpoint_save")
        names = [r["name"] for r in lines_of(tracer.path)]
        assert names == ["process", "forward", "checkpoint_save"]  # begin flushes what was queued, then itself
        tracer.complete("backward", tracer.now())
        deadline = time.monotonic() + 30
        while "backward" not in tracer.path.read_text() and time.monotonic() < deadline:
            time.sleep(0.02)  # the flusher thread writes it without any further call
        assert "backward" in tracer.path.read_text()
    finally:
        tracer.close()


def test_span_records_the_exception_and_end_without_begin_is_ignored(tmp_path, caplog):
    tracer = Tracer(tmp_path)
    with pytest.raises(ValueError):
        with tracer.long_span("evaluate"):
            raise ValueError("boom")
    with pytest.raises(KeyError):
        with tracer.span("forward"):
            raise KeyError("x")
    tracer.end("never_begun")
    tracer.close()
    records = {(r["ph"], r["name"]): r for r in lines_of(tracer.path)}
    assert records[("X", "evaluate")]["args"] == {"error": "ValueError"}
    assert records[("X", "forward")]["args"] == {"error": "KeyError"}
    assert not any(name == "never_begun" for _, name in records)
    assert "never_begun" in caplog.text


def test_non_finite_and_odd_values_stay_valid_json(tmp_path):
    import numpy as np

    tracer = Tracer(tmp_path)
    tracer.step, tracer.epoch = np.int64(7), None
    tracer.counter("batch", samples=3, loss=float("nan"))
    tracer.instant("note", path=Path("/x"), ratio=float("inf"), shape={(2, 3): 1})
    tracer.close()
    text = tracer.path.read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON, which Python's json would not check
    records = lines_of(tracer.path)[1:]
    assert records[0]["args"] == {"samples": 3, "loss": None} and records[0]["step"] == 7
    assert records[0]["epoch"] is None
    assert records[1]["args"] == {"path": "/x", "ratio": None, "shape": {"(2, 3)": 1}}


def test_rotation_by_size_keeps_every_record_in_order(tmp_path):
    tracer = Tracer(tmp_path, max_bytes=4096, max_files=100)
    write_steps(tracer, range(1, 301), flush_every=50)
    tracer.close()
    files = trace_files(tmp_path / "trace", 0)
    assert len(files) > 3
    assert [seq for _, seq, _ in files] == list(range(len(files)))
    steps = []
    for _, _, path in files:
        records = lines_of(path)
        assert records[0]["ph"] == "M"  # every file describes itself
        steps += [r["step"] for r in records[1:]]
    assert steps == list(range(1, 301))
    assert all(p.stat().st_size < 4096 + 50 * 200 for _, _, p in files)  # rotated after the batch that passed


def test_each_attempt_starts_a_new_file_and_never_touches_old_ones(tmp_path):
    first = build_tracer(dict(enabled=True), tmp_path, 0, 1, attempt=0, job=None)
    first.complete("forward", first.now())
    first.close()
    old = first.path.read_bytes()
    second = build_tracer(dict(enabled=True), tmp_path, 0, 1, attempt=1, job=None)
    second.complete("forward", second.now())
    second.close()
    assert second.path != first.path
    assert [seq for _, seq, _ in trace_files(tmp_path / "trace", 0)] == [0, 1]
    assert first.path.read_bytes() == old
    assert lines_of(second.path)[0]["attempt"] == 1


def test_max_files_deletes_the_oldest_of_this_rank_only(tmp_path):
    other = Tracer(tmp_path, rank=1)
    other.close()
    tracer = Tracer(tmp_path, rank=0, max_bytes=4096, max_files=3)
    write_steps(tracer, range(600), flush_every=40)
    tracer.close()
    kept = trace_files(tmp_path / "trace", 0)
    assert len(kept) == 3
    seqs = [seq for _, seq, _ in kept]
    assert seqs == list(range(seqs[0], seqs[0] + 3)) and seqs[0] > 0  # the newest three
    assert lines_of(kept[-1][2])[-1]["step"] == 599
    assert len(trace_files(tmp_path / "trace", 1)) == 1


def test_disabled_tracing_writes_nothing(tmp_path):
    assert build_tracer(None, tmp_path, 0, 1) is None
    assert build_tracer(dict(enabled=False, max_files=3), tmp_path, 0, 1) is None
    tracer = NULL_TRACER
    t = tracer.now()
    assert tracer.complete("forward", t) == 0.0
    with tracer.span("x"), tracer.long_span("y"):
        tracer.begin("z")
        tracer.end("z")
        tracer.instant("i", a=1)
        tracer.counter("batch", samples=1)
    tracer.close()
    assert not tracer.enabled and not (tmp_path / "trace").exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options, culprit", [
    (dict(enabled="yes"), "structured_logging.enabled='yes'"),
    (dict(enabled=True, trace_hook=True), "did you mean structured_logging.trace_hooks"),
    (dict(max_bytes=100), "structured_logging.max_bytes=100"),
    (dict(max_files=0), "structured_logging.max_files=0"),
    (dict(flush_every_s=0), "structured_logging.flush_every_s=0"),
    (dict(batch_stats_every=-1), "structured_logging.batch_stats_every=-1"),
    (dict(batch_stats_every=True), "structured_logging.batch_stats_every=True"),
    ("on", "structured_logging must be a dict"),
])
def test_bad_options_name_the_key(tmp_path, options, culprit):
    with pytest.raises(ConfigError) as err:
        build_tracer(options, tmp_path, 0, 1)
    assert culprit in str(err.value)


def test_defaults_are_off_and_options_reach_the_tracer(tmp_path):
    assert TRACING_DEFAULTS["enabled"] is False
    tracer = build_tracer(dict(enabled=True, trace_hooks=True, batch_stats_every=10, max_files=4), tmp_path, 0, 1)
    try:
        assert (tracer.trace_hooks, tracer.batch_stats_every, tracer.max_files) == (True, 10, 4)
        assert tracer.max_bytes == TRACING_DEFAULTS["max_bytes"]
    finally:
        tracer.close()


KILLED_CHILD = textwrap.dedent("""
    import importlib.util, os, signal, sys
    sys.path.insert(0, {root!r})
    # Loaded as files, not through pimm.engines: the tracer needs nothing but the standard
    # library and its two sibling modules (themselves standard library only).
    def load(name):
        spec = importlib.util.spec_from_file_location(
            "pimm.engines.observe." + name, {root!r} + "/pimm/engines/observe/" + name + ".py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    load("trace_options"), load("null_tracer")
    tracing = load("tracing")
    assert "torch" not in sys.modules and "numpy" not in sys.modules
    tracer = tracing.build_tracer(dict(enabled=True, flush_every_s=3600), {run!r}, 0, 1, attempt=0, job="j1")
    for step in range(1, 4):
        tracer.step, tracer.epoch = step, 1
        tracer.complete("forward", tracer.now())
    tracer.begin("checkpoint_save")      # flushes the three forward spans and itself
    tracer.complete("lost", tracer.now())  # only queued: dies with the process
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_process_leaves_readable_files_with_its_open_span(tmp_path):
    run = tmp_path / "run"
    script = KILLED_CHILD.format(root=str(ROOT), run=str(run))
    proc = subprocess.run([sys.executable, "-c", script], env=tool_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    [(_, _, path)] = trace_files(run / "trace", 0)
    records, bad = read_jsonl(path)
    assert bad == []
    assert [(r["ph"], r["name"], r.get("step")) for r in records[1:]] == [
        ("X", "forward", 1), ("X", "forward", 2), ("X", "forward", 3), ("B", "checkpoint_save", 3)]
    # A kill in the middle of a write cuts the last line: readers skip it and say so.
    with open(path, "a") as fh:
        fh.write('{"ph":"X","name":"backw')
    records_after, bad = read_jsonl(path)
    assert records_after == records
    assert [(b.line, b.reason) for b in bad] == [(len(records) + 1, "cut")]


def test_a_write_failure_stops_tracing_but_not_the_caller(tmp_path, caplog):
    tracer = Tracer(tmp_path)
    tracer.complete("forward", tracer.now())

    class Broken:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    tracer._file = Broken()
    tracer.begin("evaluate")  # flushes: the write fails
    for _ in range(100):
        tracer.complete("forward", tracer.now())
    assert len(tracer._queue) == 0  # records are dropped, not hoarded
    tracer.close()
    assert "No space left on device" in caplog.text and "structured tracing stops" in caplog.text
