"""Resuming a run from its newest complete checkpoint.

The trainer calls :func:`restore_latest` once, after everything is built and
before the first hook's ``before_train``; every participant (hooks included)
restores itself through the :class:`~pimm.engines.state.manager.CheckpointManager`.

What wins when the config changed between the runs (the rule, also in
docs/checkpoints.md):

* the checkpoint wins for **state**: weights, optimizer moments and step
  counts, the schedule's progress and its lr scale (``scale_lr``: a hook's
  or LiveControl's lr decision, never reported as a config change), the
  position in training and in the data,
  RNG streams, hook states, the best metric;
* the config wins for **hyperparameters**: each param group's lr, weight
  decay, betas, momentum, ...; the schedule's parameters (its length after
  ``epoch`` was raised, warm-up, milestones); ``clip_grad``, AMP, everything
  else read from the config. Each such change is listed in a warning.

An unchanged config resumes bit-identically. A changed process layout (world
size, batch per rank, accumulation, data workers) continues after the same
number of samples, with a warning naming what can no longer match the
uninterrupted run exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pimm.engines.state.manager import CheckpointManager, LoadedCheckpoint
from pimm.utils.errors import CheckpointError
from pimm.utils.redaction import REDACTED, is_secret_key, redact_secrets

__all__ = ["RestoreContext", "restore_latest", "restore_loaded", "flatten_config", "describe_config_changes"]

# Config sections whose change between runs alters the training itself.
_RELEVANT = ("model", "optimizer", "scheduler", "data", "param_dicts", "batch_size", "grad_accum_steps", "seed",
             "clip_grad", "enable_amp", "amp_dtype", "train")


class RestoreContext:
    """What participants learn and report while they restore."""

    def __init__(self, loaded: LoadedCheckpoint, load_state: Callable[[Path], Any]):
        self.loaded = loaded
        self._load_state = load_state  # reads a state file as data (CheckpointManager.load_state)
        self.path: Path = loaded.path
        self.layout_changed: dict = {}
        self.saved_train_state = None
        self.saved_config_flat: dict = {}
        self.overridden: list[str] = []  # "what: checkpoint -> config"
        self.inexact_parts: list[str] = []
        self.notes: list[str] = []
        # set by the model's participant when the checkpoint used the model's older
        # parameter names (pimm.engines.state.renamed_weights); the optimizer's follows it
        self.renamed_parameters = None
        self._rank0: dict | None = None

    def config_wins(self, what: str, saved, configured) -> None:
        """Report a hyperparameter the config overrides (``saved -> configured``)."""
        self.overridden.append(f"{what}: {saved!r} -> {configured!r}")

    def inexact(self, what: str) -> None:
        """Report a part of the state that cannot be restored exactly."""
        if what not in self.inexact_parts:
            self.inexact_parts.append(what)

    def note(self, text: str) -> None:
        """A line for the resume log."""
        self.notes.append(text)

    def rank0_state(self, name: str):
        """Rank 0's saved state of participant ``name`` (read once, on demand)."""
        if self._rank0 is None:
            path = self.path / "rank00000.pth"
            self._rank0 = self._load_state(path) if path.exists() else {}
        return self._rank0.get(name)


def restore_latest(manager: CheckpointManager, world_size: int, config_flat: dict, logger,
                   allow_fresh: bool = False) -> RestoreContext | None:
    """Restore every participant from the newest usable checkpoint.

    Returns None when there is nothing to resume: no checkpoint at all, or
    none usable and ``allow_fresh``. Checkpoints that exist but none of which
    can be used are a :class:`CheckpointError` listing each one and why: a
    silent restart from step 0 would throw the run away."""
    loaded = manager.load_latest()
    if loaded is None:
        if manager.rejected and not allow_fresh:
            listing = "; ".join(f"{path.name}: {why}" for path, why in manager.rejected)
            raise CheckpointError(
                f"resume=True but no checkpoint in {manager.directory} can be used ({listing}). Nothing was "
                "changed; to start from scratch anyway pass resume='allow_fresh' (the unusable ones are kept)"
            )
        # A WARNING, not a refusal: the first job of a requeue chain passes resume=True into a new
        # save_path on purpose; a typo in save_path must still be visible in the log.
        what = "holds no usable checkpoint" if manager.rejected else "holds no checkpoint"
        logger.warning(f"resume=True but {manager.directory} {what}: starting a fresh run from step 0 (if you "
                       "meant to continue a run, check save_path)")
        return None

    return restore_loaded(manager, loaded, world_size, config_flat, logger)


def restore_loaded(manager: CheckpointManager, loaded: LoadedCheckpoint, world_size: int, config_flat: dict,
                   logger) -> RestoreContext:
    """Restore every participant from ``loaded`` and report what differs."""
    context = RestoreContext(loaded, manager.load_state)
    saved_world = loaded.manifest.get("world_size", world_size)
    manager.restore(loaded, context, skip_rank_states=saved_world != world_size)
    if context.layout_changed:
        what = ", ".join(f"{k} {old} -> {new}" for k, (old, new) in context.layout_changed.items())
        logger.warning(f"Resuming with a different layout ({what}): the run continues from the same sample count, "
                       f"but {' and '.join(context.inexact_parts) or 'the data order'} can no longer match the "
                       "uninterrupted run exactly")
    changes = describe_config_changes(context.saved_config_flat, config_flat)
    if changes:
        logger.warning("Config differs from the checkpoint's in: " + "; ".join(changes))
    if context.overridden:
        logger.warning("The config wins over the checkpoint for these hyperparameters (the checkpoint keeps "
                       "weights, optimizer moments and progress): " + "; ".join(context.overridden))
    for note in context.notes:
        logger.warning(note[0].upper() + note[1:])
    return context


def flatten_config(cfg, prefix: str = "") -> dict[str, str]:
    """``{dotted.key: repr(value)}`` — strings only, so it loads with weights_only;
    secrets redacted (it is saved in every checkpoint)."""
    flat = {}
    items = cfg.items() if isinstance(cfg, dict) else enumerate(cfg)
    for key, value in items:
        path = f"{prefix}{key}"
        if isinstance(value, dict) or (isinstance(value, (list, tuple)) and any(isinstance(v, dict) for v in value)):
            flat.update(flatten_config(value, path + "."))
        elif isinstance(value, str) and is_secret_key(key) and value:
            flat[path] = repr(REDACTED)
        else:
            flat[path] = repr(redact_secrets(value))
    return flat


def describe_config_changes(saved: dict[str, str], current: dict[str, str], limit: int = 12) -> list[str]:
    """The training-relevant keys that differ between ``saved`` and ``current`` flattened configs."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        if key.split(".")[0] not in _RELEVANT or saved.get(key) == current.get(key):
            continue
        changes.append(f"{key}: {saved.get(key, '<unset>')} -> {current.get(key, '<unset>')}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes
