"""``resume="<checkpoint folder>"``: continue from a chosen checkpoint instead
of the newest one.

The folder must be a committed checkpoint (``<save_path>/checkpoints/
step...-epoch...``, or any file inside it); it is verified (every file's
size and CRC-32 against its manifest) on every rank and restored exactly as
``resume=True`` restores the newest one, with the same rule for a changed
config. Anything else is refused in one line and nothing on disk changes.

Two cases:

* **A checkpoint of this run** (under this save_path): the run goes back to
  it. Checkpoints after it belong to the abandoned continuation: they are
  moved (never deleted) to ``checkpoints/superseded-<name>/``, where
  neither ``resume=True`` nor retention sees them, so the newest checkpoint
  is again the one the run continues from. ``metrics.jsonl`` rewinds to the
  checkpoint as on any resume (later lines go to ``metrics.rewound.jsonl``).
* **A checkpoint of another run** (a fork): training continues from it in
  this save_path, which must not hold checkpoints of its own. Its logs
  start at the checkpoint's step and it gets a W&B run of its own (unless
  ``wandb_run_id`` says otherwise); the other run is only read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from pimm.engines.state.manager import MANIFEST, CheckpointManager
from pimm.engines.state.restore import RestoreContext, restore_loaded
from pimm.utils import comm
from pimm.utils.errors import CheckpointError

__all__ = ["is_checkpoint_choice", "resolve_checkpoint", "restore_from"]

_STEP = re.compile(r"^step(\d{9})-epoch(\d{4,})$")


def is_checkpoint_choice(resume) -> bool:
    """Whether a validated ``resume`` value names a checkpoint (not True / 'allow_fresh')."""
    return isinstance(resume, str) and resume != "allow_fresh"


def resolve_checkpoint(value: str | os.PathLike) -> Path:
    """The checkpoint folder ``value`` names (a file inside it names the folder),
    or a one-line :class:`CheckpointError` saying what it is instead."""
    path = Path(os.path.expanduser(str(value))).resolve()
    if path.is_file() and _STEP.match(path.parent.name):
        path = path.parent
    if path.is_file():
        raise CheckpointError(f"resume={str(value)!r} is a file, not a resumable checkpoint: resume takes a checkpoint "
                              "folder like <save_path>/checkpoints/step000000100-epoch0001; to start a new run from "
                              "weights, use weight=<file> instead")
    if not path.is_dir():
        raise CheckpointError(f"resume={str(value)!r}: no such checkpoint folder")
    if not _STEP.match(path.name):
        inner = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        found = CheckpointManager(inner).committed()
        hint = (f"; e.g. the newest: {found[-1]} (or resume=True for the newest usable one)" if found else
                "; it holds no committed checkpoint")
        raise CheckpointError(f"resume={str(value)!r} is not a checkpoint folder (step...-epoch...){hint}")
    return path


def restore_from(manager: CheckpointManager, value, world_size: int, config_flat: dict,
                 logger) -> RestoreContext:
    """Restore every participant from the checkpoint ``value`` names (see the
    module docstring). ``context.foreign`` says whether it belongs to another run."""
    path = resolve_checkpoint(value)
    own = path.parent == manager.directory.resolve()
    if not own and manager.committed():
        raise CheckpointError(
            f"resume={str(value)!r} belongs to another run, but save_path already holds checkpoints of its own "
            f"({manager.directory}); continue another run's checkpoint in a new save_path (nothing was changed)")
    loaded = manager.load(path)
    context = restore_loaded(manager, loaded, world_size, config_flat, logger)
    context.foreign = not own
    if own:
        _supersede_later(manager, path, logger)
    else:
        logger.info(f"Continuing from {path} (another run's checkpoint) in {manager.directory.parent}")
    return context


def _supersede_later(manager: CheckpointManager, chosen: Path, logger) -> None:
    """Move this run's checkpoints after ``chosen`` out of the way (rank 0; never deleted)."""
    chosen_key = _key(chosen.name)
    later = [p for p in manager.step_folders() if _key(p.name) > chosen_key]
    if later and comm.is_main_process():
        aside = manager.directory / f"superseded-{chosen.name}"
        index = 1
        while aside.exists():
            index += 1
            aside = manager.directory / f"superseded-{chosen.name}-{index}"
        aside.mkdir()
        for folder in later:
            os.replace(folder, aside / folder.name)
        committed = [p.name for p in later if (aside / p.name / MANIFEST).is_file()]
        logger.warning(f"Resuming from {chosen.name}: the {len(later)} later checkpoint folder(s) "
                       f"({', '.join(committed) or 'uncommitted'}) were moved to {aside.name}/ (nothing deleted)")
    comm.synchronize()


def _key(name: str) -> tuple[int, int]:
    match = _STEP.match(name)
    return int(match.group(1)), int(match.group(2))

