"""Reading checkpoints back: verifying a folder against its manifest, loading
its state files as data, finding the newest usable one and handing each
participant its state. A mixin of :class:`~pimm.engines.state.manager.CheckpointManager`,
which owns the folder listing (``committed``, ``step_folders``) and the manifest reader it uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pimm.engines.state.safe_load import UnsafeCheckpointError, load_state_file
from pimm.engines.state.sharded import SHARDED_DIR, saved_structure, sharded_loader
from pimm.utils import comm
from pimm.utils.errors import CheckpointError
from pimm.engines.state.checkpoint_folders import COMMON, MANIFEST, LoadedCheckpoint
from pimm.engines.state.durable_files import _file_crc32

__all__ = ["CheckpointLoading"]


class CheckpointLoading:
    """Verify, load and restore committed checkpoints (see the module docstring)."""

    def verify(self, path: Path) -> str:
        """``"ok"`` when the checkpoint folder ``path`` is committed and every file
        matches its manifest entry (size, CRC-32); else why it cannot be used."""
        path = Path(path)
        if not (path / MANIFEST).is_file():
            return "no COMMITTED manifest: an interrupted save or a partial copy"
        manifest = self._read_manifest(path)
        if not manifest or "files" not in manifest:
            return "its COMMITTED manifest is unreadable"
        for fname, expected in manifest["files"].items():
            actual = (path / fname).stat().st_size if (path / fname).exists() else None
            if actual != expected["size"]:
                return f"{fname} has {actual} bytes, the manifest says {expected['size']}"
            if _file_crc32(path / fname) != expected["crc32"]:
                return f"{fname} fails its CRC-32 check (corrupted on disk)"
        return "ok"

    def _try_load(self, path: Path, rank: int) -> LoadedCheckpoint:
        verdict = self.verify(path)
        if verdict != "ok":
            raise ValueError(verdict)
        manifest = self._read_manifest(path)
        common = self.load_state(path / COMMON)
        rank_file = path / f"rank{rank:05d}.pth"
        rank_state = self.load_state(rank_file) if rank_file.exists() else None
        return LoadedCheckpoint(path, manifest, common, rank_state)

    def load_state(self, path: Path) -> Any:
        """One state file of a checkpoint, loaded as data (an :class:`UnsafeCheckpointError`
        when it holds anything else and :attr:`trust_code` is off)."""
        return load_state_file(path, trust_code=self.trust_code, logger=self.logger)

    def _attempt(self, path: Path) -> tuple[LoadedCheckpoint | None, str | None, str | None]:
        """(the loaded checkpoint, why it cannot be used, why it was refused as more than data)."""
        try:
            return self._try_load(path, comm.get_rank()), None, None
        except UnsafeCheckpointError as err:
            return None, str(err), str(err)
        except Exception as err:  # a damaged file may fail in many ways
            said = isinstance(err, (ValueError, CheckpointError))  # their message names the file and the damage
            return None, str(err) if said else f"{type(err).__name__}: {err}", None

    @staticmethod
    def _refusal(refused: str | None) -> str:
        """The first rank's refusal (one line naming the file and the type), agreed on every rank."""
        return next(line for line in comm.all_gather_object(refused) if line)

    def load(self, path: str | Path) -> LoadedCheckpoint:
        """The checkpoint folder ``path`` (anywhere), verified and read on every
        rank; a :class:`CheckpointError` saying why when any rank cannot use it."""
        loaded, error, refused = self._attempt(Path(path))
        if comm.any_rank(refused is not None):
            raise CheckpointError(f"resume={str(path)!r}: {self._refusal(refused)}")
        if comm.any_rank(loaded is None):
            raise CheckpointError(f"resume={str(path)!r} cannot be used: {error or 'unreadable on another rank'}; "
                                  "nothing was changed (pick another checkpoint folder, or resume=True for the newest "
                                  "usable one)")
        return loaded

    def load_latest(self) -> LoadedCheckpoint | None:
        """The newest checkpoint that every rank can read, or None. The ones
        passed over (damaged, uncommitted) are in :attr:`rejected` with the
        reason, and logged. A checkpoint refused because it holds more than
        data is not damage: that stops the resume (a :class:`CheckpointError`
        naming the file, the type and the older checkpoints) instead of
        silently continuing from an older one."""
        candidates = comm.broadcast_object([str(p) for p in reversed(self.step_folders())])
        self.rejected = []
        for index, candidate in enumerate(candidates):
            path = Path(candidate)
            loaded, error, refused = self._attempt(path)
            if comm.any_rank(refused is not None):
                older = next((p for p in candidates[index + 1:] if self.verify(Path(p)) == "ok"), None)
                hint = (f" To continue from the checkpoint before it instead: resume='{older}' (moves this one "
                        "aside, deletes nothing)." if older else "")
                raise CheckpointError(f"resume=True stopped at {path.name} (no fallback to an older checkpoint): "
                                      f"{self._refusal(refused)}.{hint}")
            if comm.any_rank(loaded is None):
                reason = error or "unreadable on another rank"
                self.rejected.append((path, reason))
                self.logger.warning(f"Checkpoint {path.name} cannot be resumed from ({reason}); trying the previous one")
                continue
            return loaded
        return None

    def restore(self, loaded: LoadedCheckpoint, context: Any = None, skip_rank_states: bool = False) -> None:
        """Hand every participant its state with ``restore(state, context)``, in
        registration order (the order is documented on
        :class:`~pimm.engines.state.participants.Participant`); per-rank states
        are skipped when ``skip_rank_states`` (another world size), and such a
        participant then gets ``restore(None, context)``. Sharded participants
        come first and read their part of ``sharded/`` (a collective)."""
        saved_sharded = loaded.manifest.get("sharded", [])
        if self._sharded:
            if not saved_sharded:
                raise CheckpointError(
                    f"checkpoint {loaded.path.name} was written by a run with parallel.strategy='ddp' (whole-model "
                    "state); resume it with parallel.strategy='ddp'")
            folder = loaded.path / SHARDED_DIR
            structure = saved_structure(folder)
            for name, participant in self._sharded.items():
                participant.restore_sharded(sharded_loader(folder, name), structure.get(name, {}), context)
        elif saved_sharded and any(name in self._shared for name in saved_sharded):
            raise CheckpointError(
                f"checkpoint {loaded.path.name} was written by a run with parallel.strategy='fsdp' (sharded state); "
                "resume it with parallel.strategy='fsdp' (any number of processes)")
        for name, participant in self._shared.items():
            if name in loaded.common:
                participant.restore(loaded.common[name], context)
        for name, participant in self._per_rank.items():
            state = None if skip_rank_states or loaded.rank_state is None else loaded.rank_state.get(name)
            participant.restore(state, context)
