"""A recording stand-in for the ``wandb`` package (install with
``monkeypatch.setitem(sys.modules, "wandb", fake_wandb)``).

It keeps what a W&B server would show: each run's rows ``(step, data)``.
Like W&B, a row whose explicit ``step`` is below the run's current step is
dropped (and counted in ``dropped``); ``init(resume_from="<id>?_step=N")``
rewinds the run as W&B's rewind does: rows after step N are removed and
logging continues at step N + 1. ``use_client(rewind=False)`` acts as a client older than
0.17.1 (no ``resume_from``). ``runs`` lists every ``init`` call's run, ``servers`` the
history per run id (a resumed run continues it).
"""

from __future__ import annotations

import re

runs: list["FakeRun"] = []
servers: dict[str, list[tuple[int, dict]]] = {}


def reset() -> None:
    runs.clear()
    servers.clear()
    use_client(rewind=True)


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
            match = re.fullmatch(r"(?P<id>[\w-]+)\?_step=(?P<step>\d+)", resume_from)
            assert match, resume_from
            self.id, to_step = match["id"], int(match["step"])
            rows = servers.setdefault(self.id, [])
            rows[:] = [row for row in rows if row[0] <= to_step]
            self.step = to_step + 1
        else:
            self.id = kwargs.get("id") or f"fake{len(runs)}"
            rows = servers.setdefault(self.id, [])
            # resume="allow": W&B continues after the last step it has
            self.step = max((row[0] for row in rows), default=-1) + 1
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


def _init_with_rewind(id=None, resume=None, resume_from=None, **kwargs) -> FakeRun:
    if resume is not None and resume_from is not None:
        raise ValueError("`resume` and `resume_from` are mutually exclusive")
    run = FakeRun(id=id, resume=resume, **({"resume_from": resume_from} if resume_from else {}), **kwargs)
    runs.append(run)
    return run


def _init_without_rewind(id=None, resume=None, **kwargs) -> FakeRun:
    if "resume_from" in kwargs:
        raise TypeError("init() got an unexpected keyword argument 'resume_from'")
    run = FakeRun(id=id, resume=resume, **kwargs)
    runs.append(run)
    return run


init = _init_with_rewind


def use_client(rewind: bool) -> None:
    """Act as a wandb client with (>= 0.17.1) or without ``resume_from``."""
    global init
    init = _init_with_rewind if rewind else _init_without_rewind


def history(run_id: str, key: str) -> list[tuple[int, float]]:
    """``(step, value)`` of ``key`` in the run's rows, in logging order."""
    return [(step, data[key]) for step, data in servers.get(run_id, []) if key in data]
