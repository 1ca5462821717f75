"""One record per test evaluation: ``save_path/eval/<UTC time>/`` holds
``test_metrics.json`` (what ``save_path/test_metrics.json`` holds, plus when
it was made) and ``test_metrics.csv`` (one row per scalar metric:
``evaluator,metric,value``; nested dicts of numbers are flattened with dots,
lists such as a confusion matrix stay in the JSON only). The directory name is
the UTC time the evaluation finished, ``YYYYmmddTHHMMSSZ`` (upstream pimm's
layout); a second evaluation within the same second gets ``-2``, ``-3``, ...:
a record is never overwritten.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["write_eval_record", "metric_rows"]


def metric_rows(results: dict) -> list[tuple[str, str, float | int | None]]:
    """``(evaluator, metric, value)`` for every scalar of ``{evaluator: metrics}``;
    a non-finite value is None (an empty cell)."""
    rows = []

    def walk(owner: str, prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(owner, f"{prefix}{key}.", item)
        elif isinstance(value, bool):
            rows.append((owner, prefix[:-1], int(value)))
        elif isinstance(value, (int, float)):
            rows.append((owner, prefix[:-1], value if math.isfinite(value) else None))

    for owner, metrics in results.items():
        walk(owner, "", metrics)
    return rows


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_eval_record(save_path: str | os.PathLike, payload: dict, results: dict,
                      now: datetime | None = None) -> Path:
    """Write one evaluation's record under ``save_path/eval/`` and return its
    directory. ``payload``: the JSON document (JSON-safe already);
    ``results``: ``{evaluator: metrics}`` for the CSV."""
    now = now or datetime.now(timezone.utc)
    base = Path(save_path) / "eval"
    base.mkdir(parents=True, exist_ok=True)
    stamp = now.strftime("%Y%m%dT%H%M%SZ")
    for attempt in range(1, 10_000):
        folder = base / (stamp if attempt == 1 else f"{stamp}-{attempt}")
        try:
            folder.mkdir()
            break
        except FileExistsError:
            continue
    else:  # pragma: no cover - ten thousand evaluations in one second
        raise RuntimeError(f"cannot make a new record directory under {base}")
    document = dict(payload, created_at=now.isoformat())
    _write(folder / "test_metrics.json", json.dumps(document, indent=1, allow_nan=False))
    table = io.StringIO()
    writer = csv.writer(table, lineterminator="\n")
    writer.writerow(("evaluator", "metric", "value"))
    for owner, metric, value in metric_rows(results):
        writer.writerow((owner, metric, "" if value is None else repr(value) if isinstance(value, float) else value))
    _write(folder / "test_metrics.csv", table.getvalue())
    return folder
