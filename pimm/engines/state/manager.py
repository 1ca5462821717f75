"""Crash-safe, resumable checkpoints: collect every participant's state, publish
atomically, restore the newest complete one.

Layout of ``save_path/checkpoints``::

    step000000120-epoch0003/      one committed checkpoint
        common.pth                rank 0: model, optimizer, scheduler, scaler,
                                  train state, writer, config
        rank00000.pth ...         per rank: RNG streams, loader position, hooks
        sharded/                  under FSDP only: model and optimizer shards
                                  (Distributed Checkpoint: __<rank>_<n>.distcp, .metadata)
        COMMITTED                 JSON manifest (sizes, CRC-32s), written last
    .tmp-step000000140-epoch0003/ a save in progress (never resumed from)

A save writes into a ``.tmp-`` folder, fsyncs every file, has rank 0 write
the manifest (each file's size and CRC-32) and renames the folder into place. The
rename is atomic, so a kill at any moment leaves either the old set of
checkpoints or the new one; resume only looks at folders with a manifest
whose files all have the recorded sizes and checksums and load, falling back to the
previous checkpoint otherwise. Old checkpoints are deleted (by the retention
policy) only after the new one is committed.

Saving the same step again heals: a committed folder that fails its check,
or a step folder without a manifest, is moved aside (``.damaged-...``, kept
for inspection, never resumed from) and the step is written anew.

Saving blocks training only while the states are copied (CUDA tensors into
pinned host buffers reused from save to save, :mod:`.snapshot`); a background
writer (``async_write``) then writes the files, and rank 0 commits once every
rank's file is on disk (each other rank leaves a done-marker; no collective runs
beside training). One write is in flight at a time, and the end of training
and a pre-emption wait for it, so "complete or ignored" holds unchanged: a
crash during the background write leaves the previous checkpoints as they were.

Files are read back as data, never as code (:mod:`pimm.engines.state.safe_load`):
a checkpoint whose state names any other type is refused (one line naming the
file and the type), and :meth:`CheckpointManager.load_latest` stops there
instead of falling back to an older checkpoint: such a folder is intact as
written, not damaged.

Every rank calls every participant's ``state_dict()`` (gathering a sharded
state is a collective); rank 0 writes the shared states, every rank its own.
Participants registered with ``scope="sharded"`` (FSDP's model and optimizer,
:mod:`pimm.engines.state.sharded`) are written by every rank through
Distributed Checkpoint, on the training thread (DCP's save is a collective),
before the rest; their files are checksummed into the same manifest.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from pimm.engines.state.checkpoint_loading import CheckpointLoading
from pimm.engines.state.participants import as_participant
from pimm.engines.state.safe_load import non_data_parts
from pimm.engines.state.snapshot import SnapshotBuffers
from pimm.engines.state.sharded import SHARDED_DIR, own_shard_files, save_sharded
from pimm.utils import comm
from pimm.utils.run_lock import check_held
# Also importable from here, as before the split (tests patch manager._save_synced and _ChecksummingFile).
from pimm.engines.state.checkpoint_folders import (_NAME, COMMON, MANIFEST, LoadedCheckpoint,  # noqa: F401
                                                   Retention, _step_of, checkpoint_name)
from pimm.engines.state.durable_files import (_WRITING, _Aborted, _ChecksummingFile, _file_crc32,  # noqa: F401
                                              _fsync_dir, _naming, _save_synced, _write_json_synced)

__all__ = ["CheckpointManager", "Retention", "atomic_torch_save", "LoadedCheckpoint", "checkpoint_name"]


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` that never leaves a half-written file at ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    _save_synced(obj, tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


class CheckpointManager(CheckpointLoading):
    """Saves and restores named participants (the
    :class:`~pimm.engines.state.participants.Participant` protocol, or anything
    with ``state_dict`` / ``load_state_dict``). ``scope="shared"`` participants are replicated across
    ranks and written once, by rank 0; ``scope="rank"`` ones are written by
    every rank. Participants are restored in registration order."""

    def __init__(self, directory: str | Path, retention: Retention | None = None,
                 logger: logging.Logger | None = None, async_write: bool = False, commit_timeout_s: float = 1800.0):
        self.directory = Path(directory)
        self.retention = retention or Retention()
        self.logger = logger or logging.getLogger("pimm")
        self.async_write = async_write
        self.commit_timeout_s = commit_timeout_s
        self.last_blocking_s = 0.0  # how long the training thread waited in the last save
        self._writer: threading.Thread | None = None
        self._write_error: BaseException | None = None
        self.tracer = None  # records the background write as a span on its own thread
        self._shared: dict[str, Any] = {}
        self._per_rank: dict[str, Any] = {}
        self._sharded: dict[str, Any] = {}
        self.rejected: list[tuple[Path, str]] = []  # what the last load_latest() could not use, and why
        #: Called on rank 0's writer (thread) just before the manifest commits a
        #: checkpoint: work the checkpoint depends on that need not block training
        #: (the fsync of metrics.jsonl, whose length the checkpoint records).
        self.before_commit: list[Callable[[], None]] = []
        self.snapshot_buffers = SnapshotBuffers()  # pinned host buffers for CUDA states, reused across saves
        # The opt-in (trust_checkpoint_code) for checkpoints written before states were plain data:
        # a file refused as data is then loaded in full, with a warning (pimm.engines.state.safe_load).
        self.trust_code = False
        self._warned: set[tuple[str, tuple]] = set()  # (participant, types) already warned about at a save
        self._abort = threading.Event()  # set by abort(): no save commits any more

    # -- participants ---------------------------------------------------
    def register(self, name: str, participant: Any, scope: str = "shared") -> None:
        """Save ``participant`` under ``name``; a plain ``load_state_dict`` object is
        adapted to the :class:`~pimm.engines.state.participants.Participant`
        protocol here, once (sharded ones follow their own: ``restore_sharded``)."""
        scopes = {"shared": self._shared, "rank": self._per_rank, "sharded": self._sharded}
        if scope not in scopes:
            raise ValueError(f"scope must be 'shared', 'rank' or 'sharded', got {scope!r}")
        if name in self.participants():
            raise ValueError(f"checkpoint participant {name!r} is registered twice")
        scopes[scope][name] = participant if scope == "sharded" else as_participant(participant)

    def participants(self) -> dict[str, Any]:
        """Every registered participant by name (sharded, shared, per rank)."""
        return {**self._sharded, **self._shared, **self._per_rank}

    @staticmethod
    def _collect(participants: dict[str, Any]) -> dict:
        return {name: p.state_dict() for name, p in participants.items()}

    # -- listing --------------------------------------------------------
    def step_folders(self) -> list[Path]:
        """Every ``step...-epoch...`` folder, committed or not, oldest first."""
        if not self.directory.is_dir():
            return []
        found = []
        for child in self.directory.iterdir():
            match = _NAME.match(child.name)
            if match and child.is_dir():
                found.append(((int(match.group(1)), int(match.group(2))), child))
        return [path for _, path in sorted(found)]

    def committed(self) -> list[Path]:
        """Committed checkpoint folders, oldest first."""
        return [path for path in self.step_folders() if (path / MANIFEST).is_file()]

    def has_checkpoints(self) -> bool:
        """Whether any step folder exists (committed or not)."""
        return bool(self.step_folders())

    # -- saving ---------------------------------------------------------
    def save(self, global_step: int, epoch: int, extra_manifest: dict | None = None,
             after_commit: tuple[tuple[Any, Path], ...] = ()) -> Path:
        """Collective: every rank must call it at the same step.

        The training thread blocks only while every participant's state is
        copied (tensors to CPU, the rest deep-copied); writing, the manifest,
        the atomic rename, retention and then ``after_commit`` files (``(obj,
        path)`` pairs written atomically by rank 0, e.g. ``model_last.pth``)
        happen on a background writer when ``async_write`` is on. One write is
        in flight at a time: the next ``save`` (or :meth:`wait`) waits for it."""
        self.wait()
        handoff = self._parked_writer() if self.async_write else None
        final, job = None, None
        try:
            final, job = self._prepare(global_step, epoch, extra_manifest, after_commit)
        finally:
            if handoff is not None:
                handoff.put(job)  # None (nothing to write, or the copy failed): the writer just ends
        if job is not None and handoff is None:
            self._write(*job)
        return final

    def _parked_writer(self) -> queue.SimpleQueue:
        """Start the background writer before the states are copied, parked on a
        hand-off queue. A thread started with its job already in hand runs that
        job's Python work (pickling) at once and keeps the GIL for a whole switch
        interval before ``Thread.start`` returns: 4.5-9 ms of a save's blocking
        time, measured. A parked thread starts in ~0.1 ms and picks the job up
        when the training thread next releases the GIL."""
        handoff: queue.SimpleQueue = queue.SimpleQueue()

        def run() -> None:
            job = handoff.get()
            if job is not None:
                self._write_guarded(*job)

        self._writer = threading.Thread(target=run, name="checkpoint-writer")
        self._writer.start()
        return handoff

    def _prepare(self, global_step: int, epoch: int, extra_manifest: dict | None,
                 after_commit: tuple) -> tuple[Path, tuple | None]:
        """The blocking part of :meth:`save`: the states copied, the temporary
        folder made; returns the final folder and the writer's job (None when
        this step is already committed and intact)."""
        rank = comm.get_rank()
        name = checkpoint_name(global_step, epoch)
        final = self.directory / name
        tmp = self.directory / f".tmp-{name}"
        start = time.perf_counter()
        # On every rank: gathering may be a collective (sharded states).
        shared = self._collect(self._shared)  # on every rank: gathering may be a collective
        sharded = self._collect(self._sharded)
        # The copies training can no longer change: CUDA tensors into reused pinned buffers,
        # one wait for all of them (pimm.engines.state.snapshot).
        snapshot = self.snapshot_buffers.snapshot()
        shared = snapshot.freeze(shared, ("shared",)) if rank == 0 else None
        per_rank = snapshot.freeze(self._collect(self._per_rank), ("rank",))
        after = tuple((snapshot.freeze(obj, ("after", i)), path) for i, (obj, path) in enumerate(after_commit)
                      ) if rank == 0 else ()
        snapshot.finish()
        existing = comm.broadcast_object(self.verify(final) if rank == 0 and final.exists() else None)
        if existing == "ok":
            return final, None  # this step is already committed and intact
        if rank == 0:
            if existing is not None:
                aside = self._move_aside(final)
                self.logger.warning(f"Checkpoint {final.name} was unusable ({existing}); moved it to "
                                    f"{aside.name} and saving step {global_step} again")
            self.directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a save that was killed: partial by definition
                shutil.rmtree(tmp)
            tmp.mkdir()
            if sharded:
                (tmp / SHARDED_DIR).mkdir()
        comm.synchronize()
        if sharded:
            save_sharded(sharded, tmp / SHARDED_DIR)  # every rank its shards (a collective)
            del sharded
        self.last_blocking_s = time.perf_counter() - start
        manifest = {"global_step": global_step, "epoch": epoch, "world_size": comm.get_world_size(),
                    **({"sharded": list(self._sharded)} if self._sharded else {}), **(extra_manifest or {})}
        return final, (tmp, final, rank, shared, per_rank, manifest, after, start)

    def wait(self) -> None:
        """Block until the write in flight (if any) is committed; re-raise its error."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        error, self._write_error = self._write_error, None
        if error is not None:
            raise error

    def abort(self, join_timeout_s: float = 30.0) -> None:
        """Abandon the save in flight (a second Ctrl-C): the background writer stops
        at its next chunk or check and commits nothing, and rank 0 removes the
        temporary folders, so no partial checkpoint is left (committed ones are
        untouched). No later save of this manager commits either."""
        self._abort.set()
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join(join_timeout_s)
        self._write_error = None
        if comm.get_rank() == 0 and self.directory.is_dir():
            for stale in self.directory.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)

    def _check_not_aborted(self, final: Path) -> None:
        if self._abort.is_set():
            raise _Aborted(f"checkpoint {final.name} abandoned before its commit")

    def _write_guarded(self, *job) -> None:
        try:
            self._write(*job)
        except BaseException as err:  # surfaced on the training thread by wait()
            self._write_error = err

    def _write(self, tmp: Path, final: Path, rank: int, shared, per_rank, manifest: dict, after_commit,
               start: float) -> None:
        """Each rank writes its file (and, but rank 0, a done-marker); rank 0 then writes the
        shared state, waits for every rank's marker and commits. No collective
        runs here, so it can run beside training."""
        rank_file = f"rank{rank:05d}.pth"
        self._check_not_aborted(final)
        _WRITING.abort = self._abort
        entries = {rank_file: _save_synced(per_rank, tmp / rank_file)}
        self._warn_unless_data(per_rank, tmp / rank_file)
        if "sharded" in manifest:
            entries.update(_entries(tmp, own_shard_files(tmp / SHARDED_DIR, rank)))
        if rank != 0:  # rank 0 waits for this marker before it commits
            _write_json_synced(entries, tmp / f"{rank_file}.done")
            return
        # Rank 0's own entries need no marker: it is the one that reads them (one file, fsync
        # and rename less per save).
        files = {COMMON: _save_synced(shared, tmp / COMMON), **entries}
        self._warn_unless_data(shared, tmp / COMMON)
        world = manifest["world_size"]
        deadline = time.monotonic() + self.commit_timeout_s
        for other in range(1, world):
            marker = tmp / f"rank{other:05d}.pth.done"
            while not marker.exists():
                self._check_not_aborted(final)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"checkpoint {final.name}: rank {other} did not finish writing its file "
                                       f"within {self.commit_timeout_s:g}s")
                time.sleep(0.005)
            files.update(json.loads(marker.read_text()))
            marker.unlink()
        if "sharded" in manifest:  # DCP's .metadata, and any shard file no rank claimed
            files.update(_entries(tmp, [p for p in sorted((tmp / SHARDED_DIR).rglob("*"))
                                        if p.is_file() and p.relative_to(tmp).as_posix() not in files]))
        for prepare in self.before_commit:
            prepare()
        _write_json_synced({**manifest, "time": time.time(), "files": files}, tmp / MANIFEST)
        _fsync_dir(tmp)
        check_held(self.directory)  # never commit into a directory another run took over (exit 2)
        self._check_not_aborted(final)
        os.replace(tmp, final)
        _fsync_dir(self.directory)
        self.apply_retention()
        for obj, path in after_commit:
            atomic_torch_save(obj, path)
        self.logger.info(f"Saved checkpoint {final} ({time.perf_counter() - start:.2f}s)")
        if self.tracer is not None:
            self.tracer.complete("checkpoint_commit", self.tracer.now() - int((time.perf_counter() - start) * 1e9),
                                 thread="checkpoint-writer" if self.async_write else None)

    def _warn_unless_data(self, state: dict, path: Path) -> None:
        """Warn (once per participant and type) when a state just written is more than data:
        a resume would refuse it (pimm.engines.state.safe_load)."""
        for name, refused in non_data_parts(state, path).items():
            if (name, tuple(refused)) in self._warned:
                continue
            self._warned.add((name, tuple(refused)))
            self.logger.warning(
                f"Checkpoint participant {name!r} saves {', '.join(refused)} in {path.name}, which a resume loads only "
                "with trust_checkpoint_code=True: its state_dict() should return plain data (tensors, numbers, "
                "strings, lists, tuples, dicts; a hook's NumPy arrays and scalars and deques are kept as data too)")

    def _move_aside(self, path: Path) -> Path:
        index = 1
        while (aside := path.with_name(f".damaged-{path.name}-{index}")).exists():
            index += 1
        os.replace(path, aside)
        return aside

    def apply_retention(self) -> None:
        """Delete committed checkpoints the retention policy does not keep (rank 0).
        Called after each commit, and at start-up of a resumed run (leftovers of
        an earlier policy follow the current one). Checkpoints the last
        :meth:`load_latest` rejected as unusable are left alone (neither counted
        nor deleted: a re-save of their step moves them aside). A deletion first
        renames the folder out of the ``step...`` namespace, so a kill halfway
        never leaves a half-deleted folder that looks committed."""
        for stale in [*self.directory.glob(".tmp-*"), *self.directory.glob(".deleting-*")]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed save or deletion
        # Still unusable? (A re-save of the step heals the folder; then it counts again.)
        self.rejected = [(path, why) for path, why in self.rejected if path.exists() and self.verify(path) != "ok"]
        rejected = {path for path, _ in self.rejected}
        paths = [path for path in self.committed() if path not in rejected]
        if self.retention.keep_all or len(paths) <= max(1, self.retention.keep_last):
            return  # every one survives: no manifest to read (the early saves of every run)
        committed = [(path, self._read_manifest(path)) for path in paths]
        keep = self.retention.survivors(committed)
        for path, _ in committed:
            if path not in keep:
                doomed = path.with_name(f".deleting-{path.name}")
                os.replace(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    @staticmethod
    def _read_manifest(path: Path) -> dict:
        try:
            with open(path / MANIFEST) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return {}

def _entries(root: Path, paths: list[Path]) -> dict:
    """Manifest entries (size, CRC-32) of files already on disk, keyed by their path under ``root``."""
    return {path.relative_to(root).as_posix(): {"size": path.stat().st_size, "crc32": _file_crc32(path)}
            for path in paths}

