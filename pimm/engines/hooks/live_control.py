"""LiveControl: steer a running training through ``save_path/control.json``.

Write a JSON object with an integer ``revision`` and the changes::

    {"revision": 3, "lr": 1e-4, "eval_every_n_steps": 500, "note": "plateau"}

Every ``poll_every`` steps (at the end of each step whose global step is a
multiple of ``poll_every``) rank 0 reads the file and broadcasts what it
found, so every rank applies the same change at the same step. A revision is
applied once, when it is higher than the last applied one; a change read at
step ``s`` takes effect from step ``s + 1``. Keys:

* ``lr``: the learning rate of the default param group from now on. The
  schedule is rebased, not overridden: every base value of the schedule
  (each group's ``initial_lr``, OneCycle's ``max_lr``/``min_lr``, an absolute
  ``eta_min``) is multiplied by ``lr / current lr``, so warm-up, decay and the
  ratios between param groups continue, scaled.
* ``eval_every_n_steps``: every evaluator evaluates at each multiple of N
  global steps instead of at epoch ends; ``null`` returns to epoch ends only.
* ``log_frequency``: InformationWriter's log cadence (steps).
* ``evaluate``: true evaluates now (metrics only, as OnDemandValidation).
* ``checkpoint``: true commits a checkpoint now.
* ``stop``: true, or a reason string: a clean stop (final checkpoint, exit 0).
* ``note``: free text, kept in the audit.

Each applied revision is logged to ``train.log``, published to
``metrics.jsonl`` (``control/revision``, ``control/lr``,
``control/eval_every_n_steps`` with 0 for null, ``control/log_frequency``) and
appended by rank 0 to ``save_path/control_audit.jsonl`` (time, step,
revision, changes, previous values) before it takes effect. A missing file is
normal and silent; a malformed one (bad JSON, unknown key, wrong type, a
revision that is not higher) gives one warning per distinct content and
changes nothing.

Resume. The hook's state (the last applied revision and the list of applied
changes with their steps) is in every checkpoint; on resume the config
rebuilds the lr schedule, evaluation and log intervals ("config wins"), so
the hook re-applies its recorded changes, in order and with the same factors,
in ``after_load_checkpoint``: the resumed run has the values the
uninterrupted run had. A change applied after the newest checkpoint (the run
was killed before the next one) is not in that state, but it is in the audit
file: the resumed run re-applies it at the step where it was first applied
(marked ``"replayed": true`` in the audit), and it does not read
``control.json`` until it has passed the last recorded change, so an edited
file cannot reorder history. The guarantee: a resumed run applies exactly the
changes the interrupted run applied, at the same steps, whatever
``control.json`` holds at resume time; with deterministic kernels its weights
are bit-identical to an uninterrupted run that saw those changes. (Without the
audit file the schedule still re-reads ``control.json`` at the same steps,
which repeats the same changes as long as the file was not edited.)
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import uuid
from pathlib import Path

from pimm.engines.hooks.base import HookBase
from pimm.engines.hooks.information_writer import InformationWriter
from pimm.engines.hooks.on_demand import validate_on_demand
from pimm.engines.registries import HOOKS
from pimm.engines.scheduler import OneCycleLR, _ClosedFormLR
from pimm.utils import comm
from pimm.utils.errors import ConfigError
from pimm.utils.files import append_jsonl, read_jsonl

__all__ = ["LiveControl", "parse_control", "rebase_lr", "AUDIT_FILE"]

AUDIT_FILE = "control_audit.jsonl"
SETTINGS = ("lr", "eval_every_n_steps", "log_frequency")
ACTIONS = ("evaluate", "checkpoint", "stop")
KEYS = ("revision", "note", *SETTINGS, *ACTIONS)
# Schedules whose lr is proportional to the base values rebase_lr scales.
REBASABLE = (_ClosedFormLR, OneCycleLR)


class ControlFileError(ValueError):
    """control.json cannot be applied (the message says why)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_control(raw: bytes) -> dict:
    """``{"revision": int, "changes": {...}}`` from the file's bytes, or
    ControlFileError naming the problem."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ControlFileError(f"it is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ControlFileError(f"it must hold a JSON object, not {type(data).__name__}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ControlFileError(f"unknown key(s) {unknown}; it takes {', '.join(KEYS)}")
    if not _is_int(data.get("revision")):
        raise ControlFileError(f"'revision' must be an integer, got {data.get('revision')!r}")
    checks = {
        "lr": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
               "a positive number"),
        "eval_every_n_steps": (lambda v: v is None or (_is_int(v) and v > 0), "a positive integer or null"),
        "log_frequency": (lambda v: _is_int(v) and v > 0, "a positive integer"),
        "evaluate": (lambda v: isinstance(v, bool), "true or false"),
        "checkpoint": (lambda v: isinstance(v, bool), "true or false"),
        "stop": (lambda v: isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
                 "true, false or a reason string"),
        "note": (lambda v: isinstance(v, str), "a string"),
    }
    for key, (ok, what) in checks.items():
        if key in data and not ok(data[key]):
            raise ControlFileError(f"{key!r} must be {what}, got {data[key]!r}")
    return {"revision": data["revision"], "changes": {k: v for k, v in data.items() if k != "revision"}}


def rebase_lr(optimizer, scheduler, scale: float) -> None:
    """Multiply the schedule's base values by ``scale`` and set each group's lr
    to the rebased schedule's value at the current step. Applying the same
    factors in the same order reproduces the same floats (resume relies on it)."""
    for group in optimizer.param_groups:
        for key in ("initial_lr", "max_lr", "min_lr"):
            if key in group:
                group[key] *= scale
    scheduler.base_lrs = [base * scale for base in scheduler.base_lrs]
    if getattr(scheduler, "eta_min", None) is not None:
        scheduler.eta_min *= scale
    for group, lr in zip(optimizer.param_groups, scheduler.get_lr()):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


@HOOKS.register_module()
class LiveControl(HookBase):
    """``poll_every``: steps between reads of the file; ``file``: its name in
    ``save_path`` (or an absolute path)."""

    # After the evaluators and writers of a step (a change read at step s acts
    # from step s + 1), before CheckpointSaver (LOW), so a checkpoint taken at
    # step s holds the change.
    priority = "BELOW_NORMAL"

    def __init__(self, poll_every: int = 10, file: str = "control.json"):
        if not _is_int(poll_every) or poll_every < 1:
            raise ConfigError(f"LiveControl: poll_every={poll_every!r} must be a positive integer")
        if not isinstance(file, str) or not file:
            raise ConfigError(f"LiveControl: file={file!r} must be a file name such as 'control.json'")
        self.poll_every = poll_every
        self.file = file
        self.revision = 0
        self.history: list[dict] = []  # {"step", "revision", "changes", "lr_scale"} per applied revision
        self.lineage: str | None = None  # this run's id in the audit file
        self._replay: list[dict] = []  # audit records to re-apply at their steps after a resume
        self._warned: set = set()
        self._restored = False

    # -- state ----------------------------------------------------------
    def state_dict(self) -> dict:
        return {"revision": self.revision, "lineage": self.lineage, "history": [dict(h) for h in self.history]}

    def load_state_dict(self, state: dict) -> None:
        self.revision = state.get("revision", 0)
        self.lineage = state.get("lineage")
        self.history = [dict(h) for h in state.get("history", [])]
        self._restored = True

    @property
    def control_path(self) -> Path:
        """The control file the user edits."""
        return Path(self.trainer.save_path) / self.file

    @property
    def audit_path(self) -> Path:
        """The audit log of applied changes."""
        return Path(self.trainer.save_path) / AUDIT_FILE

    # -- phases ---------------------------------------------------------
    def after_load_checkpoint(self) -> None:
        if not self._restored:  # a warm start: nothing of this hook was restored
            return
        for entry in self.history:  # the config rebuilt the lr and intervals: redo this run's changes
            self._apply_settings(entry["changes"], entry.get("lr_scale"))
        if self.history:
            revisions = ", ".join(str(h["revision"]) for h in self.history)
            self.trainer.logger.info(f"LiveControl: re-applied the changes of revision(s) {revisions} on top of the "
                                     "configured values (an lr the config restored above is rebased again)")
        records = comm.broadcast_object(self._recorded_after_checkpoint() if comm.is_main_process() else None)
        step = self.trainer.global_step
        for record in records:
            if record["step"] <= step:  # applied after the checkpoint of its own step was taken
                self._apply(record, replayed=True, actions=False)
            else:
                self._replay.append(record)

    def before_train(self) -> None:
        if self.lineage is None:
            self.lineage = comm.broadcast_object(uuid.uuid4().hex)

    def after_step(self) -> None:
        step = self.trainer.global_step
        if self._replay:  # a replayed change stands for the poll that first read it: no other read this step
            while self._replay and self._replay[0]["step"] <= step:
                self._apply(self._replay.pop(0), replayed=True)
            return
        if step % self.poll_every:
            return
        request = comm.broadcast_object(self._read_request() if comm.is_main_process() else None)
        if request is not None:
            self._apply(request)

    # -- reading (rank 0) -----------------------------------------------
    def _warn_once(self, key, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            self.trainer.logger.warning(f"LiveControl: {message}")

    def _read_request(self) -> dict | None:
        path = self.control_path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as err:
            self._warn_once(("unreadable", str(err)), f"cannot read {path} ({err.strerror}); it is ignored")
            return None
        digest = hashlib.sha1(raw).hexdigest()
        try:
            request = parse_control(raw)
        except ControlFileError as err:
            self._warn_once(digest, f"{path.name} ignored: {err}")
            return None
        revision, changes = request["revision"], request["changes"]
        if revision <= self.revision:
            applied = next((h["changes"] for h in self.history if h["revision"] == revision), None)
            if applied != changes:
                self._warn_once(digest, f"{path.name} ignored: revision {revision} is not above the last applied "
                                        f"revision {self.revision}; raise 'revision' to apply it")
            return None
        problem = self._unsupported(changes)
        if problem:
            self._warn_once(digest, f"{path.name} revision {revision} ignored: {problem}")
            return None
        return request

    def _unsupported(self, changes: dict) -> str | None:
        trainer = self.trainer
        if "lr" in changes:
            scheduler = getattr(trainer, "scheduler", None)
            if not isinstance(scheduler, REBASABLE):
                return f"'lr' needs one of pimm's closed-form schedulers, not {type(scheduler).__name__}"
            if trainer.optimizer.param_groups[0]["lr"] <= 0:
                return "'lr' cannot rebase a schedule whose lr is 0 at this step"
        if "eval_every_n_steps" in changes and not getattr(trainer, "evaluators", None):
            return "'eval_every_n_steps' needs an evaluator hook, and this run has none"
        if "log_frequency" in changes and not self._writers():
            return "'log_frequency' needs an InformationWriter hook, and this run has none"
        return None

    def _recorded_after_checkpoint(self) -> list[dict]:
        """This run's audit records of revisions the restored state lacks, by step."""
        records = {}
        for record in read_jsonl(self.audit_path):
            if (isinstance(record, dict) and record.get("run") == self.lineage and _is_int(record.get("revision"))
                    and record["revision"] > self.revision and _is_int(record.get("step"))):
                records.setdefault(record["revision"], record)
        return sorted(records.values(), key=lambda r: (r["step"], r["revision"]))

    # -- applying (every rank) --------------------------------------------
    def _writers(self) -> list:
        return [h for h in self.trainer.hooks if isinstance(h, InformationWriter)]

    def _settings(self) -> dict:
        trainer = self.trainer
        evaluators, writers = getattr(trainer, "evaluators", None), self._writers()
        return {"lr": trainer.optimizer.param_groups[0]["lr"],
                "eval_every_n_steps": evaluators[0].every_n_steps if evaluators else None,
                "log_frequency": writers[0].log_frequency if writers else None}

    def _apply_settings(self, changes: dict, lr_scale: float | None) -> None:
        trainer = self.trainer
        if "lr" in changes:
            rebase_lr(trainer.optimizer, trainer.scheduler, lr_scale)
        if "eval_every_n_steps" in changes:
            for evaluator in trainer.evaluators:
                evaluator.set_interval(changes["eval_every_n_steps"])
        if "log_frequency" in changes:
            for writer in self._writers():
                writer.set_interval(changes["log_frequency"])

    def _apply(self, request: dict, replayed: bool = False, actions: bool = True) -> None:
        trainer = self.trainer
        step, revision, changes = trainer.global_step, request["revision"], request["changes"]
        before = self._settings()
        previous = {key: before[key] for key in SETTINGS if key in changes}
        lr_scale = request.get("lr_scale")  # a replayed record carries the factor it was first applied with
        if "lr" in changes and lr_scale is None:
            lr_scale = changes["lr"] / before["lr"]
        if comm.is_main_process():  # recorded before it takes effect: a kill after this point cannot lose it
            append_jsonl(self.audit_path, {
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "step": step, "revision": revision, "changes": changes, "previous": previous,
                "lr_scale": lr_scale, "run": self.lineage, **({"replayed": True} if replayed else {}),
            })
        self._apply_settings(changes, lr_scale)
        self.revision = revision
        self.history.append({"step": step, "revision": revision, "changes": changes, "lr_scale": lr_scale})
        after = self._settings()
        self._report(step, revision, changes, previous, after, lr_scale, replayed)
        if not actions:
            return
        if changes.get("evaluate"):
            validate_on_demand(trainer, f"control.json revision {revision}")
        if changes.get("checkpoint"):
            trainer.save_checkpoint()
            trainer.logger.info(f"LiveControl: checkpoint of step {step} committed (revision {revision})")
        if changes.get("stop"):
            reason = changes["stop"] if isinstance(changes["stop"], str) else "stop requested"
            trainer.request_stop(f"control.json revision {revision}: {reason}", agreed=True)

    def _report(self, step, revision, changes, previous, after, lr_scale, replayed) -> None:
        parts = []
        if "lr" in changes:
            parts.append(f"lr {previous['lr']:.3e} -> {after['lr']:.3e} (schedule rebased x{lr_scale:.4g})")
        for key in ("eval_every_n_steps", "log_frequency"):
            if key in changes:
                parts.append(f"{key} {previous[key]} -> {changes[key]}")
        parts += [key for key in ("evaluate", "checkpoint") if changes.get(key)]
        if changes.get("stop"):
            parts.append("stop" + (f" ({changes['stop']})" if isinstance(changes["stop"], str) else ""))
        if changes.get("note"):
            parts.append(f"note: {changes['note']}")
        self.trainer.logger.info(f"LiveControl revision {revision} at step {step}{' (replayed)' if replayed else ''}: "
                                 f"{', '.join(parts) or 'no change'}")
        scalars = {"control/revision": revision}
        if "lr" in changes:
            scalars["control/lr"] = after["lr"]
        if "eval_every_n_steps" in changes:
            scalars["control/eval_every_n_steps"] = changes["eval_every_n_steps"] or 0
        if "log_frequency" in changes:
            scalars["control/log_frequency"] = changes["log_frequency"]
        self.trainer.metrics.publish(scalars)
