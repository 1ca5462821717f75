"""Crash-safe, resumable checkpoints: collect every participant's state, publish
atomically, restore the newest complete one.

Layout of ``save_path/checkpoints``::

    step000000120-epoch0003/      one committed checkpoint
        common.pth                rank 0: model, optimizer, scheduler, scaler,
                                  train state, writer, config
        rank00000.pth ...         per rank: RNG streams, loader position, hooks
        COMMITTED                 JSON manifest (sizes, CRC-32s), written last
    .tmp-step000000140-epoch0003/ a save in progress (never resumed from)

A save writes into a ``.tmp-`` folder, fsyncs every file, has rank 0 write
the manifest (each file's size and CRC-32) and renames the folder into place. The
rename is atomic, so a kill at any moment leaves either the old set of
checkpoints or the new one; resume only looks at folders with a manifest
whose files all have the recorded sizes and checksums and load, falling back to the
previous checkpoint otherwise. Old checkpoints are deleted only after the
new one is committed.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any

import torch

from pimm.utils import comm

__all__ = ["CheckpointManager", "atomic_torch_save", "LoadedCheckpoint"]

_NAME = re.compile(r"^step(\d{9})-epoch(\d{4,})$")
MANIFEST = "COMMITTED"
COMMON = "common.pth"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _ChecksummingFile:
    """Write-only file wrapper that keeps a CRC-32 of everything written, so a
    checkpoint's checksum costs no second read."""

    def __init__(self, fh):
        self.fh, self.crc, self.size = fh, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        return self.fh.write(data)

    def flush(self) -> None:
        self.fh.flush()


def _save_synced(obj: Any, path: Path) -> dict:
    with open(path, "wb") as fh:
        out = _ChecksummingFile(fh)
        torch.save(obj, out)
        fh.flush()
        os.fsync(fh.fileno())
        return {"size": out.size, "crc32": out.crc}


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` that never leaves a half-written file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    _save_synced(obj, tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class LoadedCheckpoint:
    def __init__(self, path: Path, manifest: dict, common: dict, rank_state: dict | None):
        self.path, self.manifest, self.common, self.rank_state = path, manifest, common, rank_state


class CheckpointManager:
    """Saves and restores named participants (anything with ``state_dict`` /
    ``load_state_dict``). ``per_rank`` participants are saved by every rank,
    the others by rank 0 only (they are replicated across ranks)."""

    def __init__(self, directory: str | Path, keep_last: int = 2, logger: logging.Logger | None = None):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.logger = logger or logging.getLogger("pimm")
        self._common: dict[str, Any] = {}
        self._per_rank: dict[str, Any] = {}

    # -- participants ---------------------------------------------------
    def register(self, name: str, participant: Any, per_rank: bool = False) -> None:
        (self._per_rank if per_rank else self._common)[name] = participant

    @staticmethod
    def _collect(participants: dict[str, Any]) -> dict:
        return {name: p.state_dict() for name, p in participants.items()}

    # -- listing --------------------------------------------------------
    def committed(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _NAME.match(child.name)
            if match and (child / MANIFEST).is_file():
                found.append(((int(match.group(1)), int(match.group(2))), child))
        return [path for _, path in sorted(found)]

    def has_checkpoints(self) -> bool:
        return bool(self.committed())

    # -- saving ---------------------------------------------------------
    def save(self, global_step: int, epoch: int, extra_manifest: dict | None = None) -> Path | None:
        """Collective: every rank must call it at the same step."""
        rank, world = comm.get_rank(), comm.get_world_size()
        name = f"step{global_step:09d}-epoch{epoch:04d}"
        final = self.directory / name
        tmp = self.directory / f".tmp-{name}"
        already = comm.broadcast_object(final.is_dir() and (final / MANIFEST).is_file())
        if already:
            return final
        start = time.perf_counter()
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed: partial by definition
                shutil.rmtree(tmp)
            tmp.mkdir()
        comm.synchronize()
        files = {f"rank{rank:05d}.pth": _save_synced(self._collect(self._per_rank), tmp / f"rank{rank:05d}.pth")}
        if rank == 0:
            files[COMMON] = _save_synced(self._collect(self._common), tmp / COMMON)
        all_files = comm.all_gather_object(files)
        if rank == 0:
            manifest = {
                "global_step": global_step,
                "epoch": epoch,
                "world_size": world,
                "time": time.time(),
                "files": {k: v for part in all_files for k, v in part.items()},
                **(extra_manifest or {}),
            }
            with open(tmp / MANIFEST, "w") as fh:
                json.dump(manifest, fh, indent=1)
                fh.flush()
                os.fsync(fh.fileno())
            _fsync_dir(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.directory)
            self._apply_retention()
            self.logger.info(f"Saved checkpoint {final} ({time.perf_counter() - start:.2f}s)")
        comm.synchronize()
        return final

    def _apply_retention(self) -> None:
        kept = self.committed()
        if self.keep_last is None or self.keep_last <= 0:
            return
        keep = set(kept[-self.keep_last:])
        best = [p for p in kept if self._read_manifest(p).get("is_best")]
        if best:
            keep.add(best[-1])
        for path in kept:
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
        for stale in self.directory.glob(".tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

    @staticmethod
    def _read_manifest(path: Path) -> dict:
        try:
            with open(path / MANIFEST) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

    # -- loading --------------------------------------------------------
    def _try_load(self, path: Path, rank: int) -> LoadedCheckpoint:
        manifest = self._read_manifest(path)
        if not manifest or "files" not in manifest:
            raise ValueError("manifest missing or unreadable")
        for fname, expected in manifest["files"].items():
            actual = (path / fname).stat().st_size if (path / fname).exists() else None
            if actual != expected["size"]:
                raise ValueError(f"{fname} has {actual} bytes, manifest says {expected['size']}")
            if _file_crc32(path / fname) != expected["crc32"]:
                raise ValueError(f"{fname} fails its CRC-32 check (corrupted on disk)")
        common = torch.load(path / COMMON, map_location="cpu", weights_only=False)
        rank_file = path / f"rank{rank:05d}.pth"
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False) if rank_file.exists() else None
        return LoadedCheckpoint(path, manifest, common, rank_state)

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that every rank can read, or None. Corrupt ones
        are reported and skipped."""
        rank = comm.get_rank()
        candidates = comm.broadcast_object([str(p) for p in reversed(self.committed())])
        for candidate in candidates:
            path = Path(candidate)
            try:
                loaded, error = self._try_load(path, rank), None
            except Exception as err:  # a damaged file may fail in many ways
                loaded, error = None, err
            if comm.any_rank(loaded is None):
                if error is not None:
                    self.logger.warning(
                        f"Checkpoint {path} is damaged ({error}); falling back to the previous one"
                    )
                continue
            return loaded
        return None

    def restore(self, loaded: LoadedCheckpoint, skip: set[str] = frozenset()) -> None:
        for name, participant in self._common.items():
            if name not in skip and name in loaded.common:
                participant.load_state_dict(loaded.common[name])
        if loaded.rank_state is not None:
            for name, participant in self._per_rank.items():
                if name not in skip and name in loaded.rank_state:
                    participant.load_state_dict(loaded.rank_state[name])
