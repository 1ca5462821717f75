"""``pimm trace summarize RUN`` and ``pimm trace export RUN [-o OUT]``.

``summarize`` answers "where did the time go and what was it doing": the
run's provenance (``attempts.jsonl``), per span name the count, total, p50,
p95 and max duration with the rank and step of the slowest occurrence and the
rank with the slowest median, the counters (batch statistics), and per
process its last step, its instants and its open spans (a ``B`` record
without its ``X``: what a hung or killed process was doing).

``export`` writes the Chrome trace-event JSON (``{"traceEvents": [...]}``)
that chrome://tracing and https://ui.perfetto.dev open: one process per rank
("rank N"), one track per attempt, times in microseconds. Complete spans
become ``X`` events; a long span's ``B`` is dropped when its ``X`` exists and
exported as an unterminated ``B`` when not, which the viewers draw to the end
of the trace.
"""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

from pimm.utils.errors import UserError

from .tool_args import ToolParser, output_path, writing
from .trace_reader import Process, Trace, read_attempts, read_trace, run_directory

__all__ = ["summarize", "export", "main"]

_MAX_BAD_LISTED = 10


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f}us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.2f}s"


def _when(value) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return datetime.fromtimestamp(value).isoformat(sep=" ", timespec="seconds")
    return "?" if value is None else str(value)


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


# -- summarize --------------------------------------------------------------------
def _provenance_lines(attempts: list[dict]) -> list[str]:
    lines = ["Provenance (attempts.jsonl):"]
    start_keys = ("host", "world_size", "pimm_version", "git", "devices")
    shown = {"attempt", "event", "time", "command", "exit_reason", "exit_code", *start_keys}
    for record in attempts:
        attempt = record.get("attempt", "?")
        event = record.get("event", "?")
        head = f"  attempt {attempt} {event:<5} {_when(record.get('time'))}"
        if event == "end":
            details = [f"exit_reason={record.get('exit_reason', '?')}", f"exit_code={record.get('exit_code', '?')}"]
        else:
            details = [f"{key}={_compact(record[key])}" for key in start_keys if key in record]
        lines.append(f"{head}  {'  '.join(details)}".rstrip())
        if "command" in record:
            command = record["command"]
            lines.append(f"      command: {' '.join(command) if isinstance(command, list) else command}")
        others = {k: v for k, v in record.items() if k not in shown}
        if others:
            lines.append("      " + "  ".join(f"{k}={_compact(v)}" for k, v in others.items()))
    return lines


def _compact(value) -> str:
    if isinstance(value, dict):
        return ",".join(f"{k}:{_compact(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ",".join(_compact(v) for v in value)
    return str(value)


def _span_lines(trace: Trace) -> list[str]:
    durations: dict[str, list[tuple[float, int, object]]] = {}
    for process in trace.processes:
        for record in process.records:
            dur = record.get("dur")
            if record.get("ph") == "X" and isinstance(dur, (int, float)):
                durations.setdefault(str(record.get("name")), []).append((float(dur), process.rank, record.get("step")))
    if not durations:
        return ["Spans: none recorded"]
    header = f"  {'span':<22}{'count':>8}{'total':>11}{'p50':>11}{'p95':>11}{'max':>11}  {'slowest (rank, step)':<22}slowest rank by p50"
    lines = ["Spans (sorted by total time):", header]
    by_total = sorted(durations.items(), key=lambda item: -sum(d for d, _, _ in item[1]))
    for name, entries in by_total:
        ordered = sorted(d for d, _, _ in entries)
        worst = max(entries, key=lambda e: e[0])
        per_rank: dict[int, list[float]] = {}
        for dur, rank, _ in entries:
            per_rank.setdefault(rank, []).append(dur)
        rank_note = ""
        if len(per_rank) > 1:
            medians = {rank: _percentile(sorted(ds), 0.5) for rank, ds in per_rank.items()}
            slow = max(medians, key=medians.get)
            fast = min(medians, key=medians.get)
            rank_note = f"rank {slow} {_duration(medians[slow])} (fastest rank {fast} {_duration(medians[fast])})"
        lines.append(
            f"  {name:<22}{len(ordered):>8}{_duration(sum(ordered)):>11}{_duration(_percentile(ordered, 0.5)):>11}"
            f"{_duration(_percentile(ordered, 0.95)):>11}{_duration(ordered[-1]):>11}  "
            f"{f'rank {worst[1]}, step {worst[2]}':<22}{rank_note}".rstrip()
        )
    return lines


def _counter_lines(trace: Trace) -> list[str]:
    series: dict[str, list[float]] = {}
    for process in trace.processes:
        for record in process.records:
            if record.get("ph") == "C" and isinstance(record.get("args"), dict):
                for key, value in record["args"].items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                        series.setdefault(f"{record.get('name')}.{key}", []).append(float(value))
    if not series:
        return []
    lines = ["Counters:", f"  {'counter':<22}{'count':>8}{'mean':>12}{'min':>12}{'max':>12}"]
    for name, values in series.items():
        lines.append(f"  {name:<22}{len(values):>8}{sum(values) / len(values):>12.4g}{min(values):>12.4g}{max(values):>12.4g}")
    return lines


def _process_lines(process: Process) -> list[str]:
    lines = [f"  {process.label}  ({len(process.files)} file(s), {len(process.records)} records)"]
    last = process.last_record()
    if last is None:
        lines.append("    no records")
        return lines
    end = last["ts"] + (last.get("dur") or 0)
    steps = [r["step"] for r in process.records if isinstance(r.get("step"), int)]
    epochs = [r["epoch"] for r in process.records if isinstance(r.get("epoch"), int)]
    lines.append(
        f"    last step {max(steps, default='?')} (epoch {max(epochs, default='?')}), "
        f"last record ends {_when(end)} ({last.get('name')})"
    )
    instants = [f"{r.get('name')}@{r.get('step')}" for r in process.records if r.get("ph") == "i"]
    if instants:
        lines.append(f"    instants: {' '.join(instants)}")
    open_spans = process.open_spans()
    for span in open_spans:
        lines.append(
            f"    OPEN: {span.get('name')} since {_when(span.get('ts'))} (step {span.get('step')}), "
            f"running >= {_duration(max(0.0, end - span['ts']))} when the trace ends"
        )
    if not any(r.get("ph") == "i" and r.get("name") == "train_end" for r in process.records):
        state = "killed, hung or still running" if open_spans else "no train_end record"
        lines.append(f"    ({state})")
    return lines


def summarize(run: str | Path) -> str:
    """The text report of ``run`` (see the module docstring)."""
    directory = run_directory(run)
    attempts, attempts_bad = read_attempts(directory)
    trace = read_trace(directory)
    if not trace.files and not attempts:
        raise UserError(
            f"{run}: no trace files in {directory / 'trace'} and no attempts.jsonl; train with "
            "--options structured_logging.enabled=True to record a trace"
        )
    lines = [f"Run: {directory}"]
    if attempts:
        lines += _provenance_lines(attempts)
    bad = attempts_bad + trace.bad_lines
    if not trace.files:
        lines.append(f"No trace files in {directory / 'trace'} (structured_logging.enabled was off)")
    else:
        ranks = sorted({p.rank for p in trace.processes})
        lines.append(
            f"Trace: {len(trace.files)} file(s), {trace.num_records} records, {len(trace.processes)} process(es), "
            f"ranks {', '.join(map(str, ranks))}"
        )
        lines += _span_lines(trace)
        lines += _counter_lines(trace)
        lines.append("Processes:")
        for process in trace.processes:
            lines += _process_lines(process)
    if bad:
        listed = ", ".join(str(b) for b in bad[:_MAX_BAD_LISTED])
        more = f" and {len(bad) - _MAX_BAD_LISTED} more" if len(bad) > _MAX_BAD_LISTED else ""
        lines.append(f"Skipped {len(bad)} unreadable line(s) (cut by a kill or garbled): {listed}{more}")
    return "\n".join(lines) + "\n"


# -- export -------------------------------------------------------------------------
def chrome_events(trace: Trace) -> list[dict]:
    """Chrome trace events (pid = rank, tid = a track per attempt and thread, times
    in whole microseconds: start and end exact, so the slices of a thread nest)."""
    events: list[dict] = []
    tracks: dict[tuple, int] = {}  # (rank, attempt, pid, thread) -> tid, numbered per rank

    def track(process: Process, thread) -> int:
        key = (process.rank, process.attempt, process.pid, thread)
        if key not in tracks:
            tracks[key] = sum(1 for k in tracks if k[0] == process.rank)
            label = f"attempt {process.attempt} (pid {process.pid}, {process.host})"
            events.append({"ph": "M", "name": "thread_name", "pid": process.rank, "tid": tracks[key],
                           "args": {"name": label if thread is None else f"{label}: {thread}"}})
        return tracks[key]

    for rank in sorted({p.rank for p in trace.processes}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for process in trace.processes:
        pid = process.rank
        open_keys = {(r.get("name"), r.get("ts")) for r in process.open_spans()}
        for record in process.records:
            ph, ts = record.get("ph"), record.get("ts")
            if ph not in ("X", "B", "i", "C") or not isinstance(ts, (int, float)):
                continue
            if ph == "B" and (record.get("name"), ts) not in open_keys:
                continue  # its X carries the whole span
            start = round(ts * 1e6)  # whole microseconds, as recorded
            event = {"name": str(record.get("name")), "ph": ph, "pid": pid, "tid": track(process, record.get("thread")),
                     "ts": start}
            args = record.get("args") if isinstance(record.get("args"), dict) else {}
            if ph == "C":
                event["args"] = {k: v for k, v in args.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            else:
                event["args"] = {"step": record.get("step"), "epoch": record.get("epoch"), **args}
            if ph == "X":
                # Integer start and end: a span that ran inside another stays
                # inside it (float µs, rounded only at the start, did not).
                dur_ns = round(float(record.get("dur") or 0.0) * 1e9)
                event["dur"] = max(0, dur_ns // 1000)
            elif ph == "i":
                event["s"] = "t"
            events.append(event)
    return events


def export(run: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write ``run``'s Chrome trace JSON; returns its path (default ``RUN/trace/trace.json``)."""
    directory = run_directory(run)
    trace = read_trace(directory)
    if not trace.files:
        raise UserError(
            f"{run}: no trace files in {directory / 'trace'}; train with "
            "--options structured_logging.enabled=True to record a trace"
        )
    path = output_path(directory / "trace" / "trace.json", out, overwrite)
    document = {"traceEvents": chrome_events(trace), "displayTimeUnit": "ms",
                "otherData": {"run": str(directory), "skipped_lines": len(trace.bad_lines)}}
    with writing(path):
        tmp = path.with_name(path.name + ".tmp")  # a viewer never sees half a file
        tmp.write_text(json.dumps(document, separators=(",", ":")))
        tmp.replace(path)
    return path


# -- command line --------------------------------------------------------------------
def main(argv: list[str], prog: str = "pimm trace") -> int:
    parser = ToolParser(prog=prog, description="Read a run's structured trace (structured_logging.enabled=True).")
    commands = parser.add_subparsers(dest="command", metavar="{summarize,export}", parser_class=ToolParser)
    commands.required = True
    summary = commands.add_parser("summarize", help="per-phase durations, slowest rank and step, open spans, provenance")
    summary.add_argument("run", metavar="RUN", help="the run directory (save_path)")
    exporter = commands.add_parser("export", help="Chrome/Perfetto trace JSON (chrome://tracing, ui.perfetto.dev)")
    exporter.add_argument("run", metavar="RUN", help="the run directory (save_path)")
    exporter.add_argument("-o", "--output", metavar="OUT", help="output file (default RUN/trace/trace.json)")
    exporter.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    if args.command == "summarize":
        print(summarize(args.run), end="")
    else:
        path = export(args.run, args.output, args.overwrite)
        print(f"wrote {path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0
