"""``pimm trace summarize`` / ``export`` on files written by the real tracer:
two ranks, rotation, a resumed attempt, an open span, cut lines, provenance."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines.observe.tracing import Tracer, trace_files  # noqa: E402
from pimm.cli.trace_report import export, main, summarize  # noqa: E402
from pimm.utils.errors import UserError  # noqa: E402

MS = 1_000_000  # tracer clock units (ns) per millisecond
STEPS = 40


def write_run(run: Path) -> dict:
    """Rank 0: forward 10 ms, one 80 ms outlier at step 7, rotated files, killed
    inside checkpoint_save (its B never gets an X). Rank 1: forward 20 ms, ends
    cleanly. Then a resumed attempt of rank 0. Returns what the test expects."""
    rank0 = Tracer(run, rank=0, world_size=2, attempt=0, job="42", max_bytes=4096)
    rank1 = Tracer(run, rank=1, world_size=2, attempt=0, job="42")
    for tracer in (rank0, rank1):
        tracer.instant("train_start")
    for step in range(1, STEPS + 1):
        for tracer, cost in ((rank0, 10), (rank1, 20)):
            tracer.step, tracer.epoch = step, 1
            if tracer is rank0 and step == 7:
                cost = 80
            tracer.complete("forward", tracer.now() - cost * MS)
            tracer.counter("batch", samples=16, points=1000 + step)
    with rank0.long_span("evaluate"):
        pass
    rank0.begin("checkpoint_save")
    rank0.close()  # as a kill would: the B stays without its X
    rank1.instant("train_end")
    rank1.close()
    resumed = Tracer(run, rank=0, world_size=2, attempt=1, job="43")
    resumed.step, resumed.epoch = STEPS + 1, 2
    resumed.instant("resume", from_step=STEPS)
    resumed.complete("forward", resumed.now() - 10 * MS)
    resumed.instant("train_end")
    resumed.close()
    # A kill in the middle of a write: the last line of rank 1's file is cut.
    [(_, _, rank1_file)] = trace_files(run / "trace", 1)
    with open(rank1_file, "a") as fh:
        fh.write('{"ph":"X","name":"forw')
    attempts = [
        {"attempt": 0, "event": "start", "time": 1764000000.0, "command": ["tools/train.py", "--config-file", "c.py"],
         "host": "node7", "world_size": 2, "pimm_version": "0.1.0", "git": {"commit": "abc1234", "dirty": True},
         "versions": {"torch": "2.13.0"}},
        {"attempt": 0, "event": "end", "time": 1764000100.0, "exit_reason": "killed"},
        {"attempt": 1, "event": "start"},
    ]
    (run / "attempts.jsonl").write_text("".join(json.dumps(a) + "\n" for a in attempts) + '{"attempt": 1, "ev')
    return {"rank1_file": rank1_file, "rank1_lines": len(rank1_file.read_text().splitlines())}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path = tmp_path_factory.mktemp("traced") / "run"
    facts = write_run(path)
    return path, facts


def span_row(text: str, name: str) -> list[str]:
    [line] = [l for l in text.splitlines() if l.split()[:1] == [name]]
    return line.split()


def test_summarize_reports_durations_slowest_rank_and_step(run):
    path, _ = run
    text = summarize(path)
    assert len(trace_files(path / "trace", 0)) > 2  # the report joined rotated files
    row = span_row(text, "forward")
    assert row[1] == str(2 * STEPS + 1)  # every forward of both ranks and of the resumed attempt
    p50, maximum = float(row[3].removesuffix("ms")), float(row[5].removesuffix("ms"))
    assert 10 <= p50 <= 21 and 80 <= maximum < 81
    line = " ".join(row)
    assert "rank 0, step 7" in line  # where the slowest forward happened
    slowest_median = line.split("step 7")[1].split()
    assert slowest_median[:2] == ["rank", "1"] and slowest_median[-2:] == ["0", "10.00ms)"]  # rank 1 is slower
    counters = span_row(text, "batch.points")
    assert counters[1] == str(2 * STEPS) and float(counters[3]) == 1001 and float(counters[4]) == 1000 + STEPS


def test_summarize_shows_open_spans_instants_and_processes(run):
    path, _ = run
    text = summarize(path)
    blocks = text.split("Processes:")[1]
    first, resumed_rank0 = blocks.split("  rank 0, attempt 1")
    rank0, rank1 = first.split("  rank 1, attempt 0")
    assert "rank 0, attempt 0" in rank0 and "job 42" in rank0
    assert f"last step {STEPS} (epoch 1)" in rank0
    assert "OPEN: checkpoint_save" in rank0 and f"(step {STEPS})" in rank0
    assert "killed, hung or still running" in rank0
    assert "OPEN" not in rank1 and "train_end@" in rank1
    assert "OPEN" not in resumed_rank0 and f"resume@{STEPS + 1}" in resumed_rank0
    assert "evaluate" in text and "OPEN: evaluate" not in text  # a long span that ended is not open


def test_summarize_counts_cut_lines_and_prints_provenance(run):
    path, facts = run
    text = summarize(path)
    assert "Skipped 2 unreadable line(s)" in text
    assert f"{facts['rank1_file']}:{facts['rank1_lines']} (cut)" in text
    assert f"{path / 'attempts.jsonl'}:4 (cut)" in text
    provenance = text.split("Provenance (attempts.jsonl):")[1].split("Trace:")[0]
    assert "host=node7" in provenance and "world_size=2" in provenance and "git=commit:abc1234,dirty:True" in provenance
    assert "command: tools/train.py --config-file c.py" in provenance
    assert "exit_reason=killed" in provenance and "exit_code=?" in provenance  # a missing key is shown as ?
    assert "attempt 1 start ?" in provenance


def test_export_writes_a_chrome_trace_with_the_right_phases_and_units(run):
    path, _ = run
    out = export(path)
    assert out == path / "trace" / "trace.json"
    events = json.loads(out.read_text())["traceEvents"]
    raw = [json.loads(l) for _, _, p in trace_files(path / "trace") for l in p.read_text().splitlines()
           if l.endswith("}")]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {"rank 0", "rank 1"}
    forwards = [e for e in events if e["name"] == "forward"]
    assert len(forwards) == 2 * STEPS + 1 and all(e["ph"] == "X" for e in forwards)
    slow = max(forwards, key=lambda e: e["dur"])
    record = max((r for r in raw if r.get("name") == "forward"), key=lambda r: r["dur"])
    assert slow["pid"] == 0 and slow["args"]["step"] == 7
    assert slow["dur"] == round(record["dur"] * 1e9) // 1000 and slow["ts"] == round(record["ts"] * 1e6)
    # A finished long span is one X; the span a kill left open is a B without an E.
    assert [e["ph"] for e in events if e["name"] == "evaluate"] == ["X"]
    assert [e["ph"] for e in events if e["name"] == "checkpoint_save"] == ["B"]
    assert {e["ph"] for e in events if e["name"] in ("train_start", "train_end", "resume")} == {"i"}
    batch = [e for e in events if e["name"] == "batch"]
    assert {e["ph"] for e in batch} == {"C"} and batch[0]["args"] == {"samples": 16, "points": 1001}
    # The resumed attempt gets its own track on rank 0.
    tracks = {e["tid"] for e in forwards if e["pid"] == 0}
    assert len(tracks) == 2
    threads = [e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 0]
    assert any(t.startswith("attempt 0") for t in threads) and any(t.startswith("attempt 1") for t in threads)


def test_export_output_rules(run, tmp_path, capsys):
    path, _ = run
    target = tmp_path / "mine.json"
    target.write_text("user data")
    with pytest.raises(UserError, match="exists.*--overwrite"):
        export(path, target)
    assert target.read_text() == "user data"
    assert main(["export", str(path), "-o", str(target), "--overwrite"]) == 0
    assert "traceEvents" in json.loads(target.read_text())
    assert str(target) in capsys.readouterr().out


def test_no_trace_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="structured_logging.enabled=True"):
        summarize(tmp_path / "empty")
    with pytest.raises(UserError, match="structured_logging.enabled=True"):
        export(tmp_path / "empty")
    with pytest.raises(UserError, match="no such run directory"):
        summarize(tmp_path / "missing")
    with pytest.raises(UserError, match="summarize,export"):
        main([])
