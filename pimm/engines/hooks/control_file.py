"""The format of LiveControl's ``control.json``: what a file may hold, how it is
read, and the range every value must be in (docs/hooks/live-control.md lists
them). Everything here is pure: no trainer, no side effects beyond reading
the file."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

__all__ = ["AUDIT_FILE", "KEYS", "SETTINGS", "LIMITS", "MAX_FILE_BYTES", "ControlFileError", "check_changes",
           "check_revision", "parse_control", "read_control_file"]

AUDIT_FILE = "control_audit.jsonl"
SETTINGS = ("lr", "eval_every_n_steps", "log_frequency")
ACTIONS = ("evaluate", "checkpoint", "stop")
KEYS = ("revision", "note", *SETTINGS, *ACTIONS)
# The accepted ranges (inclusive). An lr outside [1e-10, 100] is a typo, not a
# learning rate, and at the extremes it underflows to 0 (which no relative
# change can undo) or overflows to inf; revisions stay exact in every JSON
# reader (2**53 - 1); intervals and texts stay printable and countable.
LIMITS = {"lr": (1e-10, 100.0), "revision": (1, 2**53 - 1), "eval_every_n_steps": (1, 10**9),
          "log_frequency": (1, 10**9), "text": 1000}
MAX_FILE_BYTES = 64 * 1024


class ControlFileError(ValueError):
    """control.json cannot be applied (the message says why)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _in(key: str, value) -> bool:
    low, high = LIMITS[key]
    return low <= value <= high


def _text(value) -> bool:
    return isinstance(value, str) and len(value) <= LIMITS["text"]


def _lr_ok(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and _in("lr", value))


CHECKS = {
    "lr": (_lr_ok, "a number from {:g} to {:g}".format(*LIMITS["lr"])),
    "eval_every_n_steps": (lambda v: v is None or (_is_int(v) and _in("eval_every_n_steps", v)),
                           "an integer from 1 to {} or null".format(LIMITS["eval_every_n_steps"][1])),
    "log_frequency": (lambda v: _is_int(v) and _in("log_frequency", v),
                      "an integer from 1 to {}".format(LIMITS["log_frequency"][1])),
    "evaluate": (lambda v: isinstance(v, bool), "true or false"),
    "checkpoint": (lambda v: isinstance(v, bool), "true or false"),
    "stop": (lambda v: isinstance(v, bool) or (_text(v) and v.strip() != ""),
             f"true, false or a reason string of at most {LIMITS['text']} characters"),
    "note": (_text, f"a string of at most {LIMITS['text']} characters"),
}


def check_changes(changes: dict) -> None:
    """ControlFileError naming the first key whose value is out of its range."""
    unknown = sorted(set(changes) - set(KEYS))
    if unknown:
        raise ControlFileError(f"unknown key(s) {unknown}; it takes {', '.join(KEYS)}")
    for key, (ok, what) in CHECKS.items():
        if key in changes and not ok(changes[key]):
            shown = repr(changes[key])
            raise ControlFileError(f"{key!r} must be {what}, got {shown if len(shown) <= 40 else shown[:37] + '...'}")


def check_revision(revision) -> None:
    """ControlFileError unless ``revision`` is an int in LIMITS["revision"]."""
    if not _is_int(revision) or not _in("revision", revision):
        shown = repr(revision)
        raise ControlFileError(f"'revision' must be an integer from 1 to {LIMITS['revision'][1]}, got "
                               f"{shown if len(shown) <= 40 else shown[:37] + '...'}")


def parse_control(raw: bytes) -> dict:
    """``{"revision": int, "changes": {...}}`` from the file's bytes, or
    ControlFileError naming the problem."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:  # also an int of more than 4300 digits
        raise ControlFileError(f"it is not valid JSON ({str(err)[:200]})") from None
    if not isinstance(data, dict):
        raise ControlFileError(f"it must hold a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ControlFileError(f"unknown key(s) {unknown}; it takes {', '.join(KEYS)}")
    check_revision(data.get("revision"))
    changes = {k: v for k, v in data.items() if k != "revision"}
    check_changes(changes)
    return {"revision": data["revision"], "changes": changes}


def read_control_file(path: Path) -> bytes | None:
    """The bytes of ``path``, None when it does not exist. Opened without
    blocking (a FIFO would otherwise hang the run until a writer comes) and
    read only when it is a regular file of at most MAX_FILE_BYTES; otherwise
    ControlFileError. Other OS errors propagate."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a directory" if stat.S_ISDIR(info.st_mode) \
                else "not a regular file"
            raise ControlFileError(f"it is {kind}; LiveControl reads only a regular file")
        chunks, size = [], 0
        while size <= MAX_FILE_BYTES:
            chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_FILE_BYTES:
            raise ControlFileError(f"it is larger than {MAX_FILE_BYTES} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)
