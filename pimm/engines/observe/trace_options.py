"""The ``structured_logging`` options and where their files go: the defaults,
the checks a config is refused by, and the naming of the per-rank files
under ``save_path/trace/`` (the tracer itself is :mod:`pimm.engines.observe.tracing`).
"""

from __future__ import annotations

import difflib
import math
import re
from pathlib import Path

from pimm.utils.errors import ConfigError


TRACE_DIR = "trace"
TRACING_DEFAULTS = dict(
    enabled=False,
    trace_hooks=False,  # one span per hook call as well as per hook phase (read by the loop)
    batch_stats_every=1,  # a "batch" counter every N steps; 0 = never (read by the loop)
    max_bytes=32 * 1024 * 1024,  # rotate a rank's file past this size
    max_files=20,  # per rank; the oldest are deleted
    flush_every_s=1.0,  # short spans reach the file at least this often
)
_FILE_RE = re.compile(r"^rank(\d{5,})-(\d{4,})\.jsonl$")

def trace_files(trace_dir: str | Path, rank: int | None = None) -> list[tuple[int, int, Path]]:
    """``(rank, seq, path)`` of the trace files in ``trace_dir``, sorted by rank then seq."""
    found = []
    directory = Path(trace_dir)
    if not directory.is_dir():
        return found
    for path in directory.iterdir():
        match = _FILE_RE.match(path.name)
        if match and (rank is None or int(match.group(1)) == rank):
            found.append((int(match.group(1)), int(match.group(2)), path))
    return sorted(found)

# -- configuration --------------------------------------------------------------
def _check(key: str, value, ok: bool, need: str) -> None:
    if not ok:
        raise ConfigError(f"structured_logging.{key}={value!r} is invalid: it must be {need}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_options(options) -> dict:
    """``structured_logging`` merged over the defaults, each key checked; raises ConfigError."""
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise ConfigError(
            f"structured_logging must be a dict such as dict(enabled=True), got {type(options).__name__}"
        )
    for key in options:
        if key not in TRACING_DEFAULTS:
            near = difflib.get_close_matches(str(key), TRACING_DEFAULTS, n=1)
            hint = f"; did you mean structured_logging.{near[0]}?" if near else ""
            raise ConfigError(
                f"structured_logging.{key} is not an option (known: {', '.join(TRACING_DEFAULTS)}){hint}"
            )
    merged = {**TRACING_DEFAULTS, **options}
    for key in ("enabled", "trace_hooks"):
        _check(key, merged[key], isinstance(merged[key], bool), "True or False")
    value = merged["batch_stats_every"]
    _check("batch_stats_every", value, _is_int(value) and value >= 0, "an integer >= 0 (0: no batch statistics)")
    value = merged["max_bytes"]
    _check("max_bytes", value, _is_int(value) and value >= 4096, "an integer number of bytes >= 4096")
    value = merged["max_files"]
    _check("max_files", value, _is_int(value) and value >= 1, "an integer >= 1")
    value = merged["flush_every_s"]
    _check(
        "flush_every_s", value,
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
        "a number of seconds > 0",
    )
    return merged
