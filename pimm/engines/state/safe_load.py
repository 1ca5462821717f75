"""Reading checkpoint files back as data, never as code.

A ``.pth`` file is a pickle, and unpickling can call any function the file
names: a checkpoint folder that someone else wrote (a colleague's run being
forked, a folder copied from another cluster) could run code on the machine
that resumes from it. So every file pimm reads back is loaded with
``torch.load(..., weights_only=True)``: tensors, numbers, strings, ``None``,
lists, tuples, dicts and ``OrderedDict`` only, plus the types in
:data:`ALLOWED_TYPES` (a short, reviewed allowlist of pimm's own types; empty
today: every state pimm saves is plain). A file that names anything else is
refused with one line naming the file and the type (:class:`UnsafeCheckpointError`,
exit 2), before anything in it is built.

``trust_code=True`` is the explicit opt-in for checkpoints written before pimm
saved plain states (their RNG states hold NumPy arrays): the file is first
tried as data and, only if that is refused, loaded with the full unpickler,
with a warning naming the file and what it trusted.

A save checks its own files the same way (:func:`non_data_parts`): a
participant whose ``state_dict()`` holds anything else (a NumPy scalar from a
user's hook, say) is named in a warning at the save, not discovered at the
resume.

Distributed Checkpoint's ``.metadata`` file (FSDP runs) is a plain pickle of
torch's own metadata classes; :func:`read_dcp_metadata` reads it with an
unpickler that knows only those (:data:`DCP_METADATA_GLOBALS`), and
:func:`safe_load_planner` loads the small non-tensor values of a sharded
state (param-group settings) with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import pickle
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from pimm.utils.errors import CheckpointError

__all__ = ["ALLOWED_TYPES", "UnsafeCheckpointError", "NotACheckpointError", "load_state_file", "non_data_parts",
           "offending_global",
           "read_dcp_metadata", "dcp_failure",
           "safe_file_system_reader", "safe_load_planner", "TRUST_HINT"]

# pimm's own types a checkpoint may hold (each one reviewed: building it runs no
# code beyond setting fields). Empty: every state pimm writes is plain data.
ALLOWED_TYPES: tuple[type, ...] = ()

# What the refusal suggests for the run's own old checkpoints (the CLI tool passes its flag).
TRUST_HINT = "trust_checkpoint_code=True"

# torch's refusals name the global ("GLOBAL numpy._core.multiarray._reconstruct was not an
# allowed global", "unsupported GLOBAL posix.system whose module posix is blocked").
_GLOBAL = re.compile(r"GLOBAL\s+([A-Za-z_][\w.]*)")


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds something other than data (a type outside the
    allowlist); nothing in it was built or run."""

    def __init__(self, path: Path, global_name: str, trust_hint: str | None = TRUST_HINT):
        self.path, self.global_name = Path(path), global_name
        opt_in = (f" If you wrote this checkpoint yourself with a pimm from before checkpoints were loaded as data, "
                  f"{trust_hint} loads it (it runs whatever the file contains)" if trust_hint else "")
        super().__init__(
            f"{path} refused: it refers to {global_name}, and a checkpoint may hold only data (tensors, numbers, "
            f"strings, lists, dicts), never code; nothing in it was loaded or run.{opt_in}")


class NotACheckpointError(CheckpointError):
    """A file read back as a checkpoint is not one torch wrote whole: empty,
    text, truncated or foreign (``reason`` says which). torch's own message
    is not relayed: for such a file it advises loading with the full
    unpickler, which cannot help and would run whatever the file holds."""

    def __init__(self, path: Path, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path} is not a checkpoint: {reason}; nothing in it was loaded")


_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since torch 1.6 is a zip archive


def _what_it_is(path: Path) -> str:
    """Why ``path`` is not a readable torch file, from its first bytes."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(512)
    except OSError as err:
        return f"it cannot be read ({err.strerror or err})"
    if not head:
        return "the file is empty"
    if head.startswith(_ZIP_MAGIC):
        return "its archive is damaged (truncated or corrupted: a partial copy or a full disk?)"
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and all(ch.isprintable() or ch in "\n\r\t" for ch in text):
        return "it is a text file"
    return "it is not a file written by torch.save"


def offending_global(err: BaseException) -> str | None:
    """The global (``module.name``) a weights-only load refused, from torch's message; None if it names none."""
    match = _GLOBAL.search(str(err))
    return match.group(1) if match else None


def load_state_file(path: str | Path, trust_code: bool = False, logger: logging.Logger | None = None,
                    trust_hint: str = TRUST_HINT) -> Any:
    """``torch.load(path)`` as data (see the module docstring); an
    :class:`UnsafeCheckpointError` when the file holds anything else, unless
    ``trust_code`` (then it is loaded in full, with a warning)."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(ALLOWED_TYPES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except OSError:
        raise  # no such file, a directory, no permission: the caller names it
    except Exception as err:  # a damaged or foreign file fails in many ways (KeyError, EOFError, RuntimeError...)
        name = offending_global(err) if isinstance(err, pickle.UnpicklingError) else None
        if name is None:
            raise NotACheckpointError(path, _what_it_is(path)) from None
        if not trust_code:
            raise UnsafeCheckpointError(path, name, trust_hint) from None
    (logger or logging.getLogger("pimm")).warning(
        f"Loading {path} with the full unpickler ({TRUST_HINT.split('=')[0]}): it refers to {name}, which a "
        "checkpoint written by this pimm never does; only do this for checkpoints you trust")
    return torch.load(path, map_location="cpu", weights_only=False)  # the documented opt-in (trust_code)


def non_data_parts(state: dict, path: Path) -> dict[str, list[str]]:
    """``{participant: [global, ...]}`` for the top-level entries of ``state``
    (just written to ``path``) that a load as data would refuse; empty when the
    file is plain. The written file's pickle is scanned (no second save) and
    only a refused file is taken apart by participant. A state made only of the
    plainest types (:func:`_plainly_data`) is answered without reading the file:
    the scan re-reads and walks the whole pickle, about 1 ms a file on the
    writer thread, with the GIL held."""
    if _plainly_data(state) or not torch.serialization.get_unsafe_globals_in_checkpoint(path):
        return {}
    parts = []
    for name, value in state.items():
        if isinstance(value, list) and all(isinstance(v, dict) and "type" in v for v in value):
            parts += [(f"{name}: {v['type']}", v) for v in value]  # the hooks, one by one
        else:
            parts.append((str(name), value))
    found = {}
    for name, value in parts:
        blob = io.BytesIO()
        torch.save(value, blob)
        blob.seek(0)
        refused = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(blob))
        if refused:
            found[name] = refused
    return found


_PLAIN_LEAVES = (str, bytes, int, float, bool, type(None), torch.dtype)


def _plainly_data(value: Any, depth: int = 0) -> bool:
    """True when ``value`` is built only of exact dicts, lists and tuples of
    strings, numbers, ``None``, dtypes and plain tensors (and ``OrderedDict``s of them): a subset of what a
    weights-only load accepts, so no scan could find anything in it. False
    means "scan the file", not "refused" (an ``OrderedDict``, a parameter)."""
    kind = type(value)
    if kind in _PLAIN_LEAVES or kind is torch.Tensor:
        return True
    if depth > 64:
        return False
    if kind is dict or kind is OrderedDict:  # a module's state_dict is an OrderedDict with a _metadata attribute
        return all(type(k) in _PLAIN_LEAVES and _plainly_data(v, depth + 1) for k, v in value.items()) and (
            kind is dict or _plainly_data(dict(vars(value)), depth + 1))
    if kind is list or kind is tuple:
        return all(_plainly_data(v, depth + 1) for v in value)
    return False


# -- Distributed Checkpoint (FSDP's sharded/ folder) ---------------------------------
@functools.lru_cache(maxsize=1)
def _dtype_names() -> frozenset[str]:
    return frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))


# Everything DCP's FileSystemWriter pickles into ``.metadata``: its own dataclasses, a
# path (the checkpoint id), sizes, dtypes and the layout lookup. Building any of them runs no user code.
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
})


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler that resolves only :data:`DCP_METADATA_GLOBALS` and torch's dtypes."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and name in _dtype_names()):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.path, f"{module}.{name}", trust_hint=None)

    def persistent_load(self, pid):
        raise UnsafeCheckpointError(self.path, "a persistent reference", trust_hint=None)


_DAMAGED_ADVICE = ("nothing was loaded; use an earlier checkpoint of the run (resume='<its folder>', or "
                   "weight=<its folder>)")


def read_dcp_metadata(folder: str | Path):
    """DCP's ``.metadata`` of ``folder``, read without running code."""
    path = Path(folder) / ".metadata"
    with open(path, "rb") as fh:
        data = fh.read()
    try:
        return _MetadataUnpickler(io.BytesIO(data), path).load()
    except CheckpointError:
        raise
    except Exception as err:  # truncated or overwritten: unpickling fails in many ways
        raise CheckpointError(f"{path} is damaged: Distributed Checkpoint's metadata cannot be read "
                              f"({type(err).__name__}); {_DAMAGED_ADVICE}") from None


def dcp_failure(err: BaseException, folder: str | Path) -> CheckpointError:
    """The one-line error for DCP's ``CheckpointException`` (a BaseException
    holding each rank's exception and traceback): the first rank's own
    CheckpointError when it raised one, else one naming ``folder``."""
    failures = [cause for cause, _ in getattr(err, "failures", {}).values()]
    for cause in failures:
        if isinstance(cause, CheckpointError):
            return cause
    if failures and all(isinstance(cause, AssertionError) for cause in failures):
        first = str(failures[0]).strip().splitlines()[0] if str(failures[0]).strip() else "a piece does not fit"
        return CheckpointError(f"{folder}: the sharded checkpoint does not fit what it is loaded into ({first}); "
                               "load it with the model and optimizer config that wrote it")
    causes = {type(cause).__name__ for cause in failures} or {type(err).__name__}
    return CheckpointError(f"{folder}: the sharded checkpoint cannot be read ({', '.join(sorted(causes))}); "
                           + _DAMAGED_ADVICE)


def safe_file_system_reader(folder: str | Path):
    """A ``FileSystemReader`` for ``folder`` whose metadata read is :func:`read_dcp_metadata`
    (the shards themselves DCP already loads with ``weights_only=True``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFileSystemReader(dcp.FileSystemReader):
        # No **kwargs: DCP then never falls back to per-rank metadata files, which pimm does not write.
        def read_metadata(self):
            metadata = read_dcp_metadata(folder)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            """DCP's read, naming the shard file that cannot be read (DCP's own error names none)."""
            opened: list = []
            create_stream = self.fs.create_stream

            @contextlib.contextmanager
            def tracked(path, mode):
                opened.append(path)
                with create_stream(path, mode) as stream:
                    yield stream

            self.fs.create_stream = tracked
            try:
                return super().read_data(plan, planner)
            except (CheckpointError, AssertionError):  # DCP asserts that a saved piece fits its place
                raise
            except Exception as err:  # a truncated or overwritten shard fails in torch.load in many ways
                where = opened[-1] if opened else folder
                raise CheckpointError(f"{where} is damaged: this shard of the sharded checkpoint cannot be read "
                                      f"({type(err).__name__}); {_DAMAGED_ADVICE}") from None
            finally:
                del self.fs.create_stream

    return SafeFileSystemReader(str(folder))


def safe_load_planner():
    """DCP's default load planner, but the non-tensor values of a sharded state
    (saved as small ``torch.save`` blobs) load with ``weights_only=True``."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                name = offending_global(err)
                raise UnsafeCheckpointError(Path(f"sharded/ value {read_item.dest_index.fqn}"), name or "non-data",
                                            trust_hint=None) from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
