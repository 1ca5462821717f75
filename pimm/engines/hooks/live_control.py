"""LiveControl: steer a running training through ``save_path/control.json``.

Write a JSON object with an integer ``revision`` and the changes::

    {"revision": 3, "lr": 1e-4, "eval_every_n_steps": 500, "note": "plateau"}

Every ``poll_every`` steps (at the end of each step whose global step is a
multiple of ``poll_every``) rank 0 reads the file and broadcasts what it
found, so every rank applies the same change at the same step. A revision is
applied once, when it is higher than the last applied one; a change read at
step ``s`` takes effect from step ``s + 1``. Keys:

* ``lr``: the learning rate of the default param group from now on. The
  schedule is scaled, not overridden: :func:`pimm.engines.scale_lr` multiplies
  it by ``lr / current lr``, so warm-up, decay and the ratios between param
  groups continue, scaled.
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

Every value is checked before anything is applied (ranges in ``LIMITS``,
documented in docs/hooks/live-control.md): a number outside its range, a
revision that is not an int of at most 2**53 - 1, an lr change that would
leave the schedule's scale range or make an lr non-finite, a file that is not
a regular file (a FIFO is opened non-blocking and refused, never read) or is
larger than ``MAX_FILE_BYTES``: a warning, and a ``"refused"`` line in the
audit. A refused change is never applied and never replayed.

Resume. The lr scale is the scheduler's state (saved and restored with it);
the hook's state (the last applied revision and the list of applied changes
with their steps) is in every checkpoint; on resume the config rebuilds the
evaluation and log intervals ("config wins"), so the hook re-applies those
recorded changes in ``after_load_checkpoint``: the resumed run has the values
the uninterrupted run had. A change applied after the newest checkpoint (the run
was killed before the next one) is not in that state, but it is in the audit
file: the resumed run re-applies it at the step where it was first applied
(marked ``"replayed": true`` in the audit; a recorded change that fails
today's checks, e.g. one written by an older pimm that broke the run, is
audited as refused and skipped), and it does not read
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
import math
import uuid
from pathlib import Path

from pimm.engines.hooks.base import HookBase
from pimm.engines.hooks.control_file import (AUDIT_FILE, SETTINGS, ControlFileError, check_changes, parse_control,
                                             read_control_file)
from pimm.engines.hooks.information_writer import InformationWriter
from pimm.engines.hooks.on_demand import validate_on_demand
from pimm.engines.registries import HOOKS
from pimm.engines.optim.scheduler import MAX_LR_SCALE, MIN_LR_SCALE, _GroupStateMixin, scale_lr
from pimm.utils import comm
from pimm.utils.errors import ConfigError
from pimm.utils.files import append_jsonl, read_jsonl
from pimm.engines.optim.parts import single_optimizer_problem
from pimm.utils.domains import FilePath, PosInt

__all__ = ["LiveControl", "parse_control", "read_control_file", "AUDIT_FILE"]


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@HOOKS.register_module()
class LiveControl(HookBase):
    """``poll_every``: steps between reads of the file; ``file``: its name in
    ``save_path`` (or an absolute path)."""

    # After the evaluators and writers of a step (a change read at step s acts
    # from step s + 1), before CheckpointSaver (LOW), so a checkpoint taken at
    # step s holds the change.
    priority = "BELOW_NORMAL"

    domains = dict(poll_every=PosInt, file=FilePath)

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
        self._lr_in_scheduler = True  # False for a state saved before the scheduler kept the lr scale

    # -- state ----------------------------------------------------------
    def state_dict(self) -> dict:
        """The last applied revision, the run's id and the applied changes."""
        return {"revision": self.revision, "lineage": self.lineage, "history": [dict(h) for h in self.history],
                "lr_in_scheduler": True}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s content (re-applied in ``after_load_checkpoint``)."""
        self.revision = state.get("revision", 0)
        self.lineage = state.get("lineage")
        self.history = [dict(h) for h in state.get("history", [])]
        self._lr_in_scheduler = bool(state.get("lr_in_scheduler", False))
        self._restored = True

    @property
    def control_path(self) -> Path:
        """Where the hook reads its requests."""
        return Path(self.trainer.save_path) / self.file

    @property
    def audit_path(self) -> Path:
        """The append-only record of applied and refused changes."""
        return Path(self.trainer.save_path) / AUDIT_FILE

    # -- phases ---------------------------------------------------------
    def after_load_checkpoint(self) -> None:
        """Re-apply the restored changes the config rebuilt; queue those after the checkpoint."""
        if not self._restored:  # a warm start: nothing of this hook was restored
            return
        kept = []
        for entry in self.history:  # the config rebuilt the intervals: redo this run's changes
            changes = entry.get("changes", {})
            # Before the scheduler kept the lr scale (older checkpoints), the lr was redone from here.
            lr_scale = None if self._lr_in_scheduler else entry.get("lr_scale")
            problem = self._problem(changes, lr_scale if "lr" in changes else None, replay=True)
            if problem:
                self._refuse(entry.get("revision"), changes, f"restored change ignored: {problem}", replayed=True)
                continue
            self._apply_settings(changes, lr_scale)
            kept.append(entry)
        self.history = kept
        if kept:
            revisions = ", ".join(str(h["revision"]) for h in kept)
            self.trainer.logger.info(f"LiveControl: restored the changes of revision(s) {revisions} (the lr scale "
                                     "with the scheduler's state, the intervals re-applied over the config's)")
        records = comm.broadcast_object(self._recorded_after_checkpoint() if comm.is_main_process() else None)
        step = self.trainer.global_step
        for record in records:
            if record["step"] <= step:  # applied after the checkpoint of its own step was taken
                self._apply(record, replayed=True, actions=False)
            else:
                self._replay.append(record)

    def before_train(self) -> None:
        """Give the run its audit id (kept across resumes)."""
        if self.lineage is None:
            self.lineage = comm.broadcast_object(uuid.uuid4().hex)

    def after_step(self) -> None:
        """Replay a recorded change due at this step, or poll the file."""
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
    def _warn_once(self, key, message: str) -> bool:
        if key in self._warned:
            return False
        self._warned.add(key)
        self.trainer.logger.warning(f"LiveControl: {message}")
        return True

    def _audit(self, record: dict) -> None:
        if comm.is_main_process():
            append_jsonl(self.audit_path, {
                "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "step": self.trainer.global_step, **record, "run": self.lineage})

    def _refuse(self, revision, changes, reason: str, key=None, replayed: bool = False) -> None:
        """One warning per distinct content, and a "refused" audit line: never applied, never replayed."""
        shown = revision if _is_int(revision) and len(str(revision)) <= 20 else None
        where = f" revision {shown}" if shown is not None else ""
        if self._warn_once(key if key is not None else (reason, shown, replayed), f"{self.file}{where} {reason}"):
            self._audit({"revision": shown, "refused": reason, **({"changes": changes} if changes else {}),
                         **({"replayed": True} if replayed else {})})

    def _read_request(self) -> dict | None:
        path = self.control_path
        try:
            raw = read_control_file(path)
        except ControlFileError as err:
            self._refuse(None, None, f"ignored: {err}", key=("unusable", str(err)))
            return None
        except OSError as err:
            self._warn_once(("unreadable", str(err)), f"cannot read {path} ({err.strerror}); it is ignored")
            return None
        if raw is None:
            return None
        digest = hashlib.sha1(raw).hexdigest()
        try:
            request = parse_control(raw)
        except ControlFileError as err:
            self._refuse(None, None, f"ignored: {err}", key=digest)
            return None
        revision, changes = request["revision"], request["changes"]
        if revision <= self.revision:
            applied = next((h["changes"] for h in self.history if h["revision"] == revision), None)
            if applied != changes:
                self._refuse(revision, changes, f"ignored: it is not above the last applied revision "
                                                f"{self.revision}; raise 'revision' to apply it", key=digest)
            return None
        problem = self._problem(changes, self._lr_factor(changes))
        if problem:
            self._refuse(revision, changes, f"ignored: {problem}", key=digest)
            return None
        return request

    def _lr_factor(self, changes: dict) -> float | None:
        if "lr" not in changes or self.trainer.optimizer is None:  # several optimizers: refused in _problem
            return None
        current = self.trainer.optimizer.param_groups[0]["lr"]
        return changes["lr"] / current if current > 0 and math.isfinite(current) else None

    def _problem(self, changes: dict, lr_scale: float | None, replay: bool = False) -> str | None:
        """Why ``changes`` (with the lr factor it would apply) cannot be applied now, or None."""
        trainer = self.trainer
        try:
            check_changes(changes)
        except ControlFileError as err:
            return str(err)
        if "lr" in changes and (lr_scale is not None or not replay):
            several = single_optimizer_problem(trainer, "'lr'")
            if several:
                return several
            scheduler = getattr(trainer, "scheduler", None)
            if not isinstance(scheduler, _GroupStateMixin):
                return f"'lr' needs one of pimm's schedulers, not {type(scheduler).__name__}"
            if lr_scale is None:
                return "'lr' cannot scale a schedule whose lr is 0 at this step; try again at a later step"
            scale = scheduler.lr_scale * lr_scale if isinstance(lr_scale, (int, float)) else math.nan
            if not (math.isfinite(scale) and MIN_LR_SCALE <= scale <= MAX_LR_SCALE):
                return (f"'lr' {changes['lr']:g} would scale the configured schedule by {scale:g}, outside "
                        f"[{MIN_LR_SCALE:g}, {MAX_LR_SCALE:g}]")
        if "eval_every_n_steps" in changes and not getattr(trainer, "evaluators", None):
            return "'eval_every_n_steps' needs an evaluator hook, and this run has none"
        if "log_frequency" in changes and not self._writers():
            return "'log_frequency' needs an InformationWriter hook, and this run has none"
        return None

    def _recorded_after_checkpoint(self) -> list[dict]:
        """This run's audit records of revisions the restored state lacks, by step (refused ones never)."""
        records = {}
        for record in read_jsonl(self.audit_path):
            if (isinstance(record, dict) and record.get("run") == self.lineage and not record.get("refused")
                    and _is_int(record.get("revision")) and record["revision"] > self.revision
                    and _is_int(record.get("step")) and isinstance(record.get("changes"), dict)):
                records.setdefault(record["revision"], record)
        return sorted(records.values(), key=lambda r: (r["step"], r["revision"]))

    # -- applying (every rank) --------------------------------------------
    def _writers(self) -> list:
        return [h for h in self.trainer.hooks if isinstance(h, InformationWriter)]

    def _settings(self) -> dict:
        trainer = self.trainer
        evaluators, writers = getattr(trainer, "evaluators", None), self._writers()
        return {"lr": trainer.optimizer.param_groups[0]["lr"] if trainer.optimizer is not None else None,
                "eval_every_n_steps": evaluators[0].every_n_steps if evaluators else None,
                "log_frequency": writers[0].log_frequency if writers else None}

    def _apply_settings(self, changes: dict, lr_scale: float | None) -> None:
        trainer = self.trainer
        if "lr" in changes and lr_scale is not None:
            scale_lr(trainer.optimizer, trainer.scheduler, lr_scale)
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
        if "lr" in changes and lr_scale is None and not replayed:
            lr_scale = self._lr_factor(changes)
        # Checked again on every rank (rank 0 checked the file; a replayed record was never checked by
        # this version): the same state gives the same answer everywhere.
        problem = self._problem(changes, lr_scale) if "lr" in changes or replayed else None
        if problem:
            self._refuse(revision, changes, f"{'recorded change ' if replayed else ''}ignored: {problem}",
                         replayed=replayed)
            return
        # Recorded before it takes effect: a kill after this point cannot lose it.
        self._audit({"revision": revision, "changes": changes, "previous": previous, "lr_scale": lr_scale,
                     **({"replayed": True} if replayed else {})})
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
            parts.append(f"lr {previous['lr']:.3e} -> {after['lr']:.3e} (schedule scaled x{lr_scale:.4g})")
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
