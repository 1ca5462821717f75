"""The W&B run's options: which runtime keys exist, their checks, and how they
become ``wandb.init`` arguments.

The keys are upstream pimm's (its trainer reads them from the config):

* ``wandb_project``, ``wandb_run_name`` (default: the save_path's folder
  name), ``wandb_group``, ``wandb_job_type``: passed to ``wandb.init``;
* ``wandb_run_id``: the W&B run id. Unset, pimm draws one when the run
  starts and keeps it in every checkpoint, so ``resume=True`` continues the
  same W&B run; set, it wins (also over a checkpoint's);
* ``wandb_resume``: W&B's resume mode (``"allow"``, ``"must"``, ``"never"``,
  ``"auto"``); pimm's default is ``"allow"``, which a resumed run needs to
  continue its own W&B run;
* ``launch_command``: written to the run's notes (the Overview tab shows it
  first; upstream's ``pimm submit`` records the command that started the job);
* ``log_step_offset``: added to every step W&B receives (a run continuing
  another one on a dashboard); training, checkpoints, ``metrics.jsonl`` and
  TensorBoard keep the run's own steps;
* ``wandb_entity``, ``wandb_tags``: the W&B team and the run's tags.

Any other ``wandb_*`` key in a config is an error naming the nearest known
key: a misspelt ``wandb_grup`` must not silently log ungrouped runs.

Every row carries ``train/global_step`` (the training step, plus
``log_step_offset``), declared as the step metric of every other key, as
upstream logs. On resume the W&B run is rewound to the checkpoint's step
(``wandb.init(resume_from="<id>?_step=<N>")``, W&B >= 0.17.1): the rows the
killed attempt logged after the checkpoint are dropped from its history
(W&B keeps them in an archived segment) and the replayed steps are logged
again. A client without ``resume_from`` falls back to ``resume="allow"``: the
run continues, the tail rows stay, and the replayed steps up to the last one
W&B already has are dropped by W&B; a warning says so (upgrade wandb).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

from pimm.utils.errors import ConfigError
from pimm.utils.redaction import redact_secrets

__all__ = ["WANDB_RESUME_MODES", "STEP_METRIC", "check_wandb_keys", "wandb_init_options", "start_wandb_run",
           "supports_rewind", "WandbRun"]

#: The x-axis of every W&B chart pimm logs (upstream's name).
STEP_METRIC = "train/global_step"

WANDB_RESUME_MODES = ("allow", "must", "never", "auto")

# Keys of the writer's init dict that are pimm's, not wandb.init's.
_STEP_OFFSET = "step_offset"


def _optional_str(key: str, value):
    if value is None:
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} is invalid: it takes a non-empty string or None")
    return value


def _run_id(key: str, value):
    value = _optional_str(key, value)
    if value is not None and any(c in value for c in "/\\#?%: "):
        raise ConfigError(f"{key}={value!r} is invalid: a W&B run id takes letters, digits, '-' and '_' only")
    return value


def _resume_mode(key: str, value):
    if value is None or value in WANDB_RESUME_MODES:
        return value
    raise ConfigError(f"{key}={value!r} is invalid: it takes one of {', '.join(map(repr, WANDB_RESUME_MODES))} "
                      "or None (W&B's resume mode; None: 'allow')")


def _tags(key: str, value):
    if value is None:
        return value
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a list of strings like ['baseline'] or None")
    return list(value)


def _step_offset(key: str, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{key}={value!r} is invalid: it takes an integer >= 0 (added to every W&B step)")
    return value


def _project(key: str, value):
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}={value!r} is invalid: it takes a non-empty string")
    return value


#: ``(name, default, check, doc)`` of every W&B runtime key; pimm/engines/run/runtime.py lists them in its table.
WANDB_KEYS = (
    ("wandb_project", "pimm", _project, "W&B project"),
    ("wandb_entity", None, _optional_str, "W&B team or user (None: your default entity)"),
    ("wandb_run_name", None, _optional_str, "W&B run name (None: the save_path folder's name)"),
    ("wandb_group", None, _optional_str, "W&B run group"),
    ("wandb_job_type", None, _optional_str, "W&B job type"),
    ("wandb_tags", None, _tags, "W&B run tags, e.g. ['baseline']"),
    ("wandb_run_id", None, _run_id,
     "W&B run id (None: drawn at the start and kept in checkpoints, so a resume continues the same run)"),
    ("wandb_resume", None, _resume_mode, "W&B resume mode: 'allow' (None), 'must', 'never' or 'auto'"),
    ("launch_command", None, _optional_str, "the command that launched the job, shown as the W&B run's notes"),
    ("log_step_offset", 0, _step_offset,
     "added to every step sent to W&B (metrics.jsonl and TensorBoard keep the run's own steps)"),
)
_KNOWN = tuple(name for name, *_ in WANDB_KEYS) + ("use_wandb",)


def check_wandb_keys(cfg) -> None:
    """Refuse a ``wandb_*`` key that pimm does not know, naming the nearest known one."""
    for key in cfg:
        if isinstance(key, str) and key.startswith("wandb_") and key not in _KNOWN:
            close = difflib.get_close_matches(key, _KNOWN, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown W&B key {key!r}{hint} (known: {', '.join(_KNOWN)})")


def wandb_init_options(cfg, save_path: str | Path, config: dict | None = None) -> dict:
    """The writer's ``wandb_init`` dict from a validated config: ``wandb.init``
    arguments plus pimm's own ``step_offset`` (taken out again by
    :func:`start_wandb_run`). ``id`` is present only when ``wandb_run_id`` is set."""
    options: dict[str, Any] = dict(project=cfg.wandb_project, name=cfg.get("wandb_run_name") or Path(save_path).name,
                                   resume=cfg.get("wandb_resume") or "allow")
    for key, arg in (("wandb_entity", "entity"), ("wandb_group", "group"), ("wandb_job_type", "job_type"),
                     ("wandb_tags", "tags"), ("wandb_run_id", "id"), ("launch_command", "notes")):
        if cfg.get(key) is not None:
            options[arg] = cfg[key]
    if config is not None:
        options["config"] = config
    options = redact_secrets(options)  # the W&B run keeps its config and notes: no secret goes there
    options[_STEP_OFFSET] = int(cfg.get("log_step_offset") or 0)
    return options


class WandbRun:
    """The started ``wandb`` run as the writer uses it: ``log(data, step)`` adds
    the step offset, ``record_failure(text)`` puts a failure in the run's
    summary, ``finish()`` ends it. ``id`` is the run's id."""

    def __init__(self, run, step_offset: int = 0):
        self.run = run
        self.step_offset = step_offset
        self.id = run.id
        define = getattr(run, "define_metric", None)
        if define is not None:
            define(STEP_METRIC, hidden=True)
            define("*", step_metric=STEP_METRIC)

    def log(self, data: dict, step: int) -> None:
        """Log ``data`` at the run's ``step`` (W&B receives ``step + log_step_offset``,
        also as ``train/global_step``)."""
        step = step + self.step_offset
        self.run.log({**data, STEP_METRIC: step}, step=step)

    def record_failure(self, text: str, step: int) -> None:
        """The failure's description in the run summary (``exception``, ``failed_at_step``)."""
        self.run.summary["exception"] = text
        self.run.summary["failed_at_step"] = step + self.step_offset

    def finish(self, exit_code: int | None = None) -> None:
        """End the run (``exit_code=1`` marks it failed on the dashboard)."""
        self.run.finish(exit_code=exit_code)


def supports_rewind(wandb_module) -> bool:
    """Whether this ``wandb`` client takes ``resume_from`` (W&B >= 0.17.1)."""
    import inspect

    try:
        return "resume_from" in inspect.signature(wandb_module.init).parameters
    except (TypeError, ValueError):
        return False


def start_wandb_run(init: dict, run_id: str | None, save_path: str | Path,
                    rewind: tuple[str, int] | None = None, logger=None) -> WandbRun:
    """``wandb.init`` with the writer's ``init`` options; the run id is
    ``wandb_run_id`` when set, else ``run_id`` (drawn by the writer or restored
    from a checkpoint). ``rewind=(run id, step)``: a resume from the
    checkpoint at that step of that run, which rewinds the W&B run there (see
    the module docstring) when it is the run being continued."""
    import wandb

    kwargs = dict(init)
    step_offset = kwargs.pop(_STEP_OFFSET, 0)
    kwargs["id"] = kwargs.get("id") or run_id
    kwargs.setdefault("dir", str(save_path))
    if rewind is not None and rewind[0] == kwargs["id"]:
        if supports_rewind(wandb):
            kwargs.pop("resume", None)  # W&B: resume and resume_from exclude each other
            kwargs["resume_from"] = f"{kwargs['id']}?_step={rewind[1] + step_offset}"
        elif logger is not None:
            logger.warning(f"W&B: this wandb client cannot rewind a run (resume_from needs wandb >= 0.17.1): run "
                           f"{kwargs['id']} keeps the rows logged after the checkpoint at step {rewind[1]}, and W&B "
                           "drops the replayed steps it already has; upgrade wandb for a history that matches "
                           "metrics.jsonl")
    if "resume_from" not in kwargs:
        kwargs.setdefault("resume", "allow")
    return WandbRun(wandb.init(**kwargs), step_offset=step_offset)
