"""Checkpoint hooks: CheckpointSaver decides *when* to save and which
checkpoints to keep, and configures the trainer's checkpoint manager
(``trainer.checkpointer``) with that policy itself; CheckpointLoader carries
the warm-start key map into the config (``weight_key_map``). The trainer does
the saving and restoring (``trainer.save_checkpoint()``, and the restore
before ``before_train``)."""

from __future__ import annotations

import time

from pimm.engines.loop.hook_contract import take_published_metric
from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.engines.state.manager import Retention
from pimm.utils import comm
from pimm.utils.errors import ConfigError
from pimm.utils.domains import Choice, DictOf, PosInt, Positive, Seq, Steps, Text

__all__ = ["CheckpointSaver", "CheckpointLoader"]


def _positive(name: str, value, allow_none: bool = True, integer: bool = False):
    if value is None and allow_none:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{name} must be {what}{' or None' if allow_none else ''}, got {value!r}")
    return value


# keep=...: (keep_last, keep_best, keep_all)
_NAMED_POLICIES = {"best": (1, True, False), "last": (1, False, False), "all": (1, False, True)}


@HOOKS.register_module()
class CheckpointSaver(HookBase):
    """Resumable checkpoints (each with ``model/model_last.pth``) at every epoch
    end, every ``save_freq`` steps and every ``save_every_minutes`` (or
    ``save_every_seconds``) of wall time since the last save.

    The wall-clock cadence is read every ``time_check_every`` steps and only
    rank 0's clock decides: with several processes its vote travels in the
    stop control's all-reduce of that step (:meth:`StopControl.add_ballot`),
    so every rank saves at the same step and no collective or host sync is
    added to the other steps. ``clock`` (default ``time.monotonic``) is the
    time source, replaceable for tests.

    Which committed checkpoints are kept (deletions happen only after the new
    one is committed; on resume, leftovers follow the same rule):

    * ``keep_last``: the newest N (at least 1: resume needs the newest);
    * ``keep_best``: plus the newest one that was the best so far;
    * ``keep_every``: plus every one whose step is a multiple of K, forever;
    * ``keep_all``: every one.

    * ``keep``: a named policy instead of the above: ``"best"`` keeps the
      best checkpoint and the newest one (resume needs the newest; the two
      are one when the newest is the best), i.e. ``keep_last=1,
      keep_best=True``; ``"last"`` only the newest; ``"all"`` every one.

    ``async_write``: the training thread only copies the state; a background
    writer writes and commits it (one at a time; the end of training and a
    pre-emption wait for it).

    ``evaluator_every_n_steps`` (upstream's argument): with ``evaluate=True``,
    also save every N steps, the steps where a mid-epoch evaluator
    (``every_n_steps=N``) has just scored the model, so ``model_best`` is the
    evaluated weights."""

    # After evaluators (NORMAL) so the epoch-end checkpoint knows the new best.
    priority = "LOW"

    domains = dict(save_freq=Steps, save_every_seconds=Positive | None, keep_last=PosInt, keep_every=Steps,
                   time_check_every=PosInt, keep=Choice("best", "last", "all") | None, evaluator_every_n_steps=Steps,
                   save_every_minutes=Positive | None)

    def __init__(self, save_freq: int | None = None, save_every_seconds: float | None = None, keep_last: int = 2,
                 keep_best: bool = True, keep_every: int | None = None, keep_all: bool = False,
                 time_check_every: int = 10, async_write: bool = True, keep: str | None = None,
                 evaluator_every_n_steps: int | None = None, save_every_minutes: float | None = None):
        if keep is not None:
            if keep not in _NAMED_POLICIES:
                raise ValueError(f"keep must be one of {', '.join(map(repr, _NAMED_POLICIES))} or None, got {keep!r}")
            if keep_all or keep_every is not None:
                raise ValueError(f"keep={keep!r} is a whole retention policy: drop keep_all / keep_every")
            keep_last, keep_best, keep_all = _NAMED_POLICIES[keep]
        self.keep = keep
        self.save_freq = _positive("save_freq", save_freq, integer=True)
        self.save_every_seconds = _positive("save_every_seconds", save_every_seconds)
        self.evaluator_every_n_steps = _positive("evaluator_every_n_steps", evaluator_every_n_steps, integer=True)
        self.save_every_minutes = _positive("save_every_minutes", save_every_minutes)
        if self.save_every_minutes is not None and self.save_every_seconds is not None:
            raise ValueError(f"give one wall-clock cadence: save_every_minutes={save_every_minutes!r} or "
                             f"save_every_seconds={save_every_seconds!r}, not both")
        #: Seconds between wall-clock saves (None: no wall-clock cadence).
        self.interval_s = (self.save_every_minutes * 60.0 if self.save_every_minutes is not None
                           else self.save_every_seconds)
        for name, flag in (("keep_best", keep_best), ("keep_all", keep_all), ("async_write", async_write)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if isinstance(keep_last, int) and not isinstance(keep_last, bool) and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last} (resume needs the newest checkpoint; "
                             "'best only' is keep_last=1, keep_best=True)")
        self.retention = Retention(keep_last=_positive("keep_last", keep_last, allow_none=False, integer=True),
                                   keep_best=keep_best, keep_every=_positive("keep_every", keep_every, integer=True),
                                   keep_all=keep_all)
        self.time_check_every = _positive("time_check_every", time_check_every, allow_none=False, integer=True)
        self.async_write = async_write
        self.clock = time.monotonic
        self._last_save = 0.0

    def before_train(self):
        """Hand the retention policy and write mode to the checkpoint manager, align
        the data loader's snapshots to ``save_freq``; on resume, prune leftovers of
        an earlier policy (rank 0)."""
        trainer = self.trainer
        checkpointer = trainer.checkpointer
        checkpointer.retention = self.retention
        checkpointer.async_write = self.async_write
        trainer.align_data_snapshots(self.save_freq)
        trainer.align_data_snapshots(self.evaluator_every_n_steps)  # several calls: the shortest interval wins
        if trainer.global_step > 0 and comm.is_main_process():  # resumed: leftovers follow this policy
            checkpointer.apply_retention()
        self._last_save = self.clock()
        if self.interval_s and trainer.control.distributed:
            trainer.control.add_ballot(self.time_check_every, self._rank0_time_due, self._save_mid_epoch)
        if self.keep == "best" and self.trainer.metrics.best.name is None:
            self.trainer.logger.warning("CheckpointSaver(keep='best'): no evaluator declares a metric to rank "
                                        "checkpoints by, so only the newest checkpoint is kept")

    def _rank0_time_due(self) -> bool:
        """Rank 0's vote: its clock says a wall-clock save is due (other ranks never vote)."""
        return comm.is_main_process() and self.clock() - self._last_save >= self.interval_s

    def _save_mid_epoch(self) -> None:
        # At the last step of an epoch the epoch-end save follows immediately.
        if self.trainer.iter < self.trainer.iters_per_epoch:
            self.save()

    def after_step(self):
        """Save every ``save_freq`` steps, ``evaluator_every_n_steps`` (with ``evaluate=True``), and
        (one process) when the wall-clock cadence is due; with several processes the stop
        control's check saves on rank 0's word."""
        trainer = self.trainer
        if "current_metric_value" in trainer.comm_info and comm.get_world_size() == 1:
            take_published_metric(trainer)  # model_best holds this step's weights (distributed: at the next save)
        step = trainer.global_step
        due = self.save_freq and step % self.save_freq == 0
        if self.evaluator_every_n_steps and trainer.cfg.evaluate:
            due = due or step % self.evaluator_every_n_steps == 0
        if not due and self.interval_s and not trainer.control.distributed and step % self.time_check_every == 0:
            due = self.clock() - self._last_save >= self.interval_s
        if due:
            self._save_mid_epoch()

    def after_epoch(self):
        """Save at every epoch end."""
        self.save()

    def save(self):
        """Commit a checkpoint now (a collective: every rank calls it at the same step).
        A metric a user evaluator published in ``comm_info`` (upstream's
        ``current_metric_value``) first decides the best model."""
        take_published_metric(self.trainer)
        self.trainer.save_checkpoint()
        self._last_save = self.clock()


@HOOKS.register_module()
class CheckpointLoader(HookBase):
    """Warm-start options for ``weight=PATH``: ``key_map=[(old_prefix, new_prefix), ...]``
    renames the file's keys. It is upstream's spelling of the runtime key
    ``weight_key_map``, which this hook sets in ``modify_config``; the trainer
    reads only the key. Upstream's other spelling works too: ``keywords=`` /
    ``replacement=`` (one rule) or ``replacements={old: new}`` (the longest
    matching prefix wins); ``strict=True`` then requires every model tensor
    from the file and no tensor left over. (``resume=True`` needs no hook: the
    trainer restores every participant before any hook runs.)"""

    priority = "VERY_HIGH"

    domains = dict(key_map=Seq(Seq(Text(empty=True), length=2), what="a list of (old_prefix, new_prefix) pairs"),
                   keywords=Text(empty=True), replacement=Text(empty=True) | None,
                   replacements=DictOf(Text(), Text(empty=True)) | None)

    def __init__(self, key_map=(), keywords="", replacement=None, replacements=None, strict=False):
        try:
            self.key_map = [(str(old), str(new)) for old, new in key_map]
        except (TypeError, ValueError):
            raise ValueError(f"key_map must be a list of (old_prefix, new_prefix) pairs, got {key_map!r}") from None
        if replacements is not None and not isinstance(replacements, dict):
            raise ValueError(f"replacements must be a {{old_prefix: new_prefix}} dict, got {replacements!r}")
        rules = list((replacements or {}).items())
        if keywords:
            rules.append((keywords, keywords if replacement is None else replacement))
        # Upstream matches the keys without their DDP "module." prefix, longest keyword first.
        rules = [(str(old).removeprefix("module."), str(new).removeprefix("module.")) for old, new in rules if old]
        self.key_map += sorted(rules, key=lambda rule: len(rule[0]), reverse=True)
        if not isinstance(strict, bool):
            raise ValueError(f"strict must be True or False, got {strict!r}")
        self.strict = strict

    def modify_config(self, cfg) -> None:
        """Add ``key_map`` to ``cfg.weight_key_map``. Several loaders (upstream's
        configs list one per renamed prefix) and the runtime key combine, the
        longest prefix first; one prefix renamed two ways is an error."""
        if not self.key_map:
            return
        current = [tuple(pair) for pair in cfg.get("weight_key_map") or ()]
        merged = dict(current)
        for old, new in self.key_map:
            if merged.get(old, new) != new:
                raise ConfigError(f"CheckpointLoader(key_map={self.key_map}) contradicts weight_key_map="
                                  f"{[list(pair) for pair in current]}: prefix {old!r} renamed both to "
                                  f"{merged[old]!r} and to {new!r}; give each prefix one rule")
            merged[old] = new
        rules = sorted(merged.items(), key=lambda rule: len(rule[0]), reverse=True)  # stable: ties keep their order
        cfg.weight_key_map = [list(pair) for pair in rules]
