"""A strict reader of the Chrome trace-event format (the JSON Object Format of
"Trace Event Format", the document Perfetto and chrome://tracing read), for
checking pimm's export independently of pimm's own trace reader.

Checked: the document is ``{"traceEvents": [...]}``; every event has a
``ph``, ``pid`` and ``tid``; timed events have an integer ``ts``; complete
events (``X``) an integer ``dur`` >= 0; and on each thread (``pid``, ``tid``)
the complete events form a proper tree: a slice either lies wholly inside the
slice that encloses it or starts at or after that slice's end. Viewers draw a
slice that crosses its parent's end on a wrong level, or drop it.
"""

from __future__ import annotations

import json
from pathlib import Path

TIMED = {"X", "B", "E", "i", "I", "C", "b", "e", "n"}


def load(path: str | Path) -> list[dict]:
    document = json.loads(Path(path).read_text())
    if not isinstance(document, dict) or not isinstance(document.get("traceEvents"), list):
        raise AssertionError("not a Chrome trace: expected an object with a traceEvents list")
    for index, event in enumerate(document["traceEvents"]):
        missing = [k for k in ("ph", "pid", "tid") if k not in event]
        if missing:
            raise AssertionError(f"event {index} lacks {missing}: {event}")
        if event["ph"] in TIMED and type(event.get("ts")) is not int:
            raise AssertionError(f"event {index} has a non-integer ts: {event}")
        if event["ph"] == "X" and (type(event.get("dur")) is not int or event["dur"] < 0):
            raise AssertionError(f"event {index} has a bad dur: {event}")
    return document["traceEvents"]


def crossings(events: list[dict]) -> list[tuple[dict, dict]]:
    """Pairs (enclosing slice, slice that starts inside it and ends after it)."""
    threads: dict[tuple, list[dict]] = {}
    for event in events:
        if event["ph"] == "X":
            threads.setdefault((event["pid"], event["tid"]), []).append(event)
    bad = []
    for slices in threads.values():
        # Parents first: earlier start, and at equal starts the longer one.
        slices.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for event in slices:
            while stack and event["ts"] >= stack[-1]["ts"] + stack[-1]["dur"]:
                stack.pop()  # it starts at or after the top's end: a following slice
            if stack and event["ts"] + event["dur"] > stack[-1]["ts"] + stack[-1]["dur"]:
                bad.append((stack[-1], event))
                continue
            stack.append(event)
    return bad
