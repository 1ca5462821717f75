"""A recording stand-in for the ``wandb`` package (install with
``monkeypatch.setitem(sys.modules, "wandb", fake_wandb)``).

It keeps what a W&B server would show: each run's rows ``(step, data)``.
Like W&B, a row whose explicit ``step`` is below the run's current step is
dropped (and counted in ``dropped``); ``init(resume_from="<id>?_step=N")``
rewinds the run as W&B's rewind does: rows after step N are removed and the
run's step is N. ``runs`` lists every ``init`` call's run, ``servers`` the
history per run id (a resumed run continues it).
"""

from __future__ import annotations

import re

runs: list["FakeRun"] = []
servers: dict[str, list[tuple[int, dict]]] = {}
SUPPORTS_REWIND = True


def reset() -> None:
    runs.clear()
    servers.clear()


class Image:
    def __init__(self, data, **_):
        self.data = data


class Histogram:
    def __init__(self, values=None, np_histogram=None, **_):
        self.values = values


class FakeRun:
    def __init__(self, **kwargs):
        self.init_kwargs = kwargs
        resume_from = kwargs.get("resume_from")
        if resume_from is not None:
            if not SUPPORTS_REWIND:
                raise TypeError("init() got an unexpected keyword argument 'resume_from'")
            match = re.fullmatch(r"(?P<id>[\w-]+)\?_step=(?P<step>\d+)", resume_from)
            assert match, resume_from
            self.id, to_step = match["id"], int(match["step"])
            rows = servers.setdefault(self.id, [])
            rows[:] = [row for row in rows if row[0] <= to_step]
            self.step = to_step
        else:
            self.id = kwargs.get("id") or f"fake{len(runs)}"
            rows = servers.setdefault(self.id, [])
            self.step = max((row[0] for row in rows), default=0)
        self.rows = rows
        self.dropped: list[tuple[int, dict]] = []
        self.defined: dict[str, dict] = {}
        self.summary: dict = {}
        self.finished = None

    def define_metric(self, name, step_metric=None, **kwargs):
        self.defined[name] = dict(step_metric=step_metric, **kwargs)

    def log(self, data, step=None, commit=None):
        step = self.step if step is None else int(step)
        if step < self.step:
            self.dropped.append((step, dict(data)))
            return
        self.step = step
        self.rows.append((step, dict(data)))

    def finish(self, exit_code=None):
        self.finished = exit_code


def init(**kwargs) -> FakeRun:
    run = FakeRun(**kwargs)
    runs.append(run)
    return run


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` in the run's rows, in logging order."""
    return [(step, data[key]) for step, data in servers.get(run_id, []) if key in data]
