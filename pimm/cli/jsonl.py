"""Read a JSON-lines file the way a killed writer may have left it.

Each line is one JSON object. A line that is not (the last line cut by a
kill mid-write, or garbage) is skipped and reported, never fatal: the tools
that read run files must work on a crashed run, which is when they are needed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pimm.utils.errors import UserError

__all__ = ["BadLine", "read_jsonl"]


@dataclass
class BadLine:
    path: Path
    line: int  # 1-based
    reason: str  # "cut" (the last line, without its newline: a kill mid-write) or "garbled"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} ({self.reason})"


def read_jsonl(path: str | Path) -> tuple[list[dict], list[BadLine]]:
    """The JSON objects of ``path`` in order, and the lines that were not one."""
    path = Path(path)
    try:
        lines = path.read_bytes().split(b"\n")
    except OSError as err:
        raise UserError(f"{path}: cannot read ({err.strerror or err})") from None
    cut_tail = lines[-1] != b""  # a complete file ends with a newline
    if not cut_tail:
        lines.pop()
    records, bad = [], []
    for number, raw in enumerate(lines, start=1):
        try:
            record = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif raw.strip():
            bad.append(BadLine(path, number, "cut" if cut_tail and number == len(lines) else "garbled"))
    return records, bad
