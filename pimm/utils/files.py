"""File helpers for the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["set_aside", "append_jsonl", "read_jsonl"]


def set_aside(path: str | Path) -> Path | None:
    """Rename an existing ``name.ext`` to the first free ``name.prevN.ext`` so a
    new file can take its place without destroying the old one."""
    path = Path(path)
    if not path.exists():
        return None
    index = 1
    while (aside := path.with_name(f"{path.stem}.prev{index}{path.suffix}")).exists():
        index += 1
    path.rename(aside)
    return aside


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line and fsync it: an append-only record a crash cannot lose
    once this returns (a crash during it leaves at most one cut last line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def read_jsonl(path: str | Path) -> list:
    """The records of a JSON-lines file ([] when it does not exist), skipping a
    line cut short by a crash."""
    path = Path(path)
    records = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
    return records
