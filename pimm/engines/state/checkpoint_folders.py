"""What a checkpoint folder is called and holds: the ``stepNNNNNNNNN-epochNNNN``
names, the manifest and shared-state file names, which committed folders a
save keeps (:class:`Retention`) and a checkpoint as read back
(:class:`LoadedCheckpoint`). The layout itself is described in
:mod:`pimm.engines.state.manager`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MANIFEST", "COMMON", "checkpoint_name", "Retention", "LoadedCheckpoint"]

_NAME = re.compile(r"^step(\d{9})-epoch(\d{4,})$")
MANIFEST = "COMMITTED"
COMMON = "common.pth"


def checkpoint_name(global_step: int, epoch: int) -> str:
    """The folder name of the checkpoint of ``global_step`` in ``epoch``."""
    return f"step{global_step:09d}-epoch{epoch:04d}"


@dataclass
class Retention:
    """Which committed checkpoints survive a save. The newest is always kept
    (resume needs it); on top of it the ``keep_last - 1`` before it, the newest
    one that was the best, every one whose step is a multiple of
    ``keep_every`` (kept forever), or all of them (``keep_all``).

    The modes people ask for: best only = ``keep_last=1, keep_best=True``;
    last N = ``keep_last=N, keep_best=False``; all = ``keep_all=True``; every
    K-th forever = ``keep_every=K`` (with any of the others)."""

    keep_last: int = 2
    keep_best: bool = True
    keep_every: int | None = None
    keep_all: bool = False

    def survivors(self, committed: list[tuple[Path, dict]]) -> set[Path]:
        """``committed``: (folder, manifest) pairs, oldest first."""
        if self.keep_all:
            return {path for path, _ in committed}
        keep = {path for path, _ in committed[-max(1, self.keep_last):]}
        if self.keep_best:
            best = [path for path, manifest in committed if manifest.get("is_best")]
            keep.update(best[-1:])
        if self.keep_every:
            # The step from the folder name: it is there even when a manifest cannot be read.
            keep.update(path for path, _ in committed if _step_of(path) % self.keep_every == 0)
        return keep


def _step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


class LoadedCheckpoint:
    """A committed checkpoint as read for a restore: its folder (``path``), the
    verified ``manifest``, the ``common`` state written once by rank 0 and this
    rank's own ``rank_state`` (None when the checkpoint has no file for it).
    """
    def __init__(self, path: Path, manifest: dict, common: dict, rank_state: dict | None):
        self.path, self.manifest, self.common, self.rank_state = path, manifest, common, rank_state
