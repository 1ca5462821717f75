"""Structured tracing through real training runs: the spans the loop records,
nothing when it is off, a killed run's files, a resumed attempt, and
``pimm trace summarize|export`` on them."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support import forkserver
from tests.support.run import ROOT, env, run_tool, write_toy_config

pytestmark = pytest.mark.slow

ON = "structured_logging.enabled=True"


def records(run):
    out = []
    for path in sorted((run / "trace").glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # a line cut by a kill
    return out


def pimm(*args):
    return forkserver.run([sys.executable, "-m", "pimm.cli", *args], capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=120)


def test_a_traced_run_records_every_phase_and_summarize_reads_it(tmp_path):
    run = tmp_path / "run"
    cfg = write_toy_config(tmp_path, run, "epoch = 2\n")
    result = run_tool("train", cfg, ON, "structured_logging.trace_hooks=True")
    assert result.returncode == 0, result.stderr[-2000:]
    recs = records(run)
    spans = {r["name"] for r in recs if r["ph"] == "X"}
    assert {"build_model", "build_loaders", "build_optimizer", "build_writer", "build_hooks", "step", "data_fetch",
            "batch_to_device", "forward", "backward", "optimizer", "after_step", "evaluate", "checkpoint_save",
            "checkpoint_commit", "metric_sync", "after_step:InformationWriter"} <= spans
    steps = sorted({r["step"] for r in recs if r["name"] == "step"})
    assert steps == list(range(1, 21))  # one step span per optimizer step, numbered like metrics.jsonl
    assert [r["name"] for r in recs if r["ph"] == "i"] == ["train_start", "train_end"]
    assert {r["args"]["samples"] for r in recs if r["ph"] == "C" and r["name"] == "batch"} == {16}
    meta = recs[0]
    assert meta["ph"] == "M" and meta["attempt"] == 1 and meta["world_size"] == 1
    summary = pimm("trace", "summarize", str(run))
    assert summary.returncode == 0, summary.stderr
    assert "forward" in summary.stdout and "last step 20" in summary.stdout and "attempt 1" in summary.stdout
    export = pimm("trace", "export", str(run), "-o", str(tmp_path / "trace.json"))
    assert export.returncode == 0, export.stderr
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("name") == "forward" and e.get("ph") == "X" for e in events)


def test_tracing_off_writes_nothing(tmp_path):
    run = tmp_path / "run"
    cfg = write_toy_config(tmp_path, run, "epoch = 1\n")
    assert run_tool("train", cfg).returncode == 0
    assert not (run / "trace").exists()


def test_a_killed_run_leaves_readable_traces_and_the_resume_is_a_new_attempt(tmp_path):
    run = tmp_path / "run"
    cfg = write_toy_config(tmp_path, run, "hooks = hooks + [dict(type='KillAtStep', step=13)]\n")
    killed = run_tool("train", cfg, ON)
    assert killed.returncode == -9
    summary = pimm("trace", "summarize", str(run))
    assert summary.returncode == 0 and "(no train_end record)" in summary.stdout
    assert "open span" not in summary.stdout  # finished long spans are written when they end
    resumed = run_tool("train", cfg, ON, "resume=True", "hooks.KillAtStep.step=1000")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    files = sorted(p.name for p in (run / "trace").glob("rank*.jsonl"))
    assert files == ["rank00000-0000.jsonl", "rank00000-0001.jsonl"]
    second = [json.loads(line) for line in (run / "trace" / files[1]).read_text().splitlines()]
    assert second[0]["attempt"] == 2
    resume = next(r for r in second if r["name"] == "resume")
    # The newest committed checkpoint before the kill (saves every 5 steps; the step-10 one may
    # still have been on the background writer when the kill came).
    assert resume["args"]["from_step"] in (5, 10)
