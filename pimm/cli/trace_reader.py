"""Read a run's structured trace (``RUN/trace/rank*-*.jsonl``) and its
provenance (``RUN/attempts.jsonl``), tolerating what a killed run leaves.

Files are read rank by rank in ``seq`` order; each file's first record (``ph``
``M``) says which process wrote it, so rotated files of one process are joined
and a resumed run's files form a new process. Lines that do not parse as a
JSON object (the last line cut by a kill, or garbage) are skipped and
reported with their file and line number. The record format is documented
in ``pimm/engines/observe/tracing.py`` and ``docs/observability.md``; this module
does not import it (that would import torch through ``pimm.engines``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from pimm.utils.errors import UserError

from .jsonl import BadLine, read_jsonl

__all__ = ["BadLine", "Process", "Trace", "read_attempts", "read_trace", "run_directory"]

_FILE_RE = re.compile(r"^rank(\d+)-(\d+)\.jsonl$")  # the tracer's file names


@dataclass
class Process:
    """One process of one attempt: its metadata and records in file order."""

    rank: int
    attempt: int | None = None
    pid: int | None = None
    host: str | None = None
    job: str | None = None
    world_size: int | None = None
    start: float | None = None
    files: list[Path] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)

    @property
    def label(self) -> str:
        parts = [f"rank {self.rank}"]
        if self.attempt is not None:
            parts.append(f"attempt {self.attempt}")
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.host:
            parts.append(f"host {self.host}")
        if self.job:
            parts.append(f"job {self.job}")
        return ", ".join(parts)

    def open_spans(self) -> list[dict]:
        """``B`` records without their ``X`` (same name and start): what was still running."""
        open_by_key: dict[tuple, dict] = {}
        for record in self.records:
            if record.get("ph") == "B":
                open_by_key[(record.get("name"), record.get("ts"))] = record
            elif record.get("ph") == "X":
                open_by_key.pop((record.get("name"), record.get("ts")), None)
        return list(open_by_key.values())

    def last_record(self) -> dict | None:
        """The record that ends last (``ts + dur``)."""
        timed = [r for r in self.records if isinstance(r.get("ts"), (int, float))]
        return max(timed, key=lambda r: r["ts"] + (r.get("dur") or 0), default=None)


@dataclass
class Trace:
    directory: Path
    processes: list[Process]
    files: list[Path]
    bad_lines: list[BadLine]

    @property
    def num_records(self) -> int:
        return sum(len(p.records) for p in self.processes)


def run_directory(run: str | Path) -> Path:
    path = Path(run)
    if not path.is_dir():
        raise UserError(f"{run}: no such run directory; give a save_path of a pimm run")
    return path


def read_trace(run: str | Path) -> Trace:
    """Every process's records from ``RUN/trace`` (an empty Trace when there is none)."""
    directory = run_directory(run) / "trace"
    named = []
    if directory.is_dir():
        for path in directory.iterdir():
            match = _FILE_RE.match(path.name)
            if match:
                named.append((int(match.group(1)), int(match.group(2)), path))
    named.sort()
    processes: dict[tuple, Process] = {}
    last_of_rank: dict[int, Process] = {}
    bad: list[BadLine] = []
    for rank, _, path in named:
        records, file_bad = read_jsonl(path)
        bad.extend(file_bad)
        records = [r for r in records if "ph" in r]  # any other object is not a trace record
        meta = records[0] if records and records[0].get("ph") == "M" else None
        if meta is not None:
            key = (rank, meta.get("attempt"), meta.get("pid"), meta.get("host"))
            if key not in processes:
                processes[key] = Process(
                    rank=rank, attempt=meta.get("attempt"), pid=meta.get("pid"), host=meta.get("host"),
                    job=meta.get("job"), world_size=meta.get("world_size"), start=meta.get("ts"),
                )
            process = processes[key]
            records = records[1:]
        else:  # metadata line lost: the file continues the rank's previous process
            process = last_of_rank.get(rank)
            if process is None:
                process = processes.setdefault((rank, None, None, None), Process(rank=rank))
        process.files.append(path)
        process.records.extend(records)
        last_of_rank[rank] = process
    # Attempt by attempt (a resumed run's processes after the first run's), rank order within.
    ordered = sorted(processes.values(), key=lambda p: (
        p.attempt if isinstance(p.attempt, int) else -1, p.rank, p.start if p.start is not None else float("-inf")))
    return Trace(directory, ordered, [p for _, _, p in named], bad)


def read_attempts(run: str | Path) -> tuple[list[dict], list[BadLine]]:
    """Records of ``RUN/attempts.jsonl`` (empty when the file does not exist)."""
    path = run_directory(run) / "attempts.jsonl"
    if not path.is_file():
        return [], []
    return read_jsonl(path)
