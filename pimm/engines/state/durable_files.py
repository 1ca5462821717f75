"""Writing a checkpoint file so that it is either whole on disk or absent:
fsynced files and folders, a CRC-32 computed while the bytes are written
(no second read), an abort that stops a background write between two chunks,
and errors that name the file. Used by :mod:`pimm.engines.state.manager`.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import zlib
from pathlib import Path
from typing import Any

import torch



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


class _Aborted(Exception):
    """The save was abandoned (:meth:`CheckpointManager.abort`): nothing is committed."""


class _ChecksummingFile:
    """Write-only file wrapper that keeps a CRC-32 of everything written, so a
    checkpoint's checksum costs no second read; a set ``abort`` event stops the
    write at its next chunk."""

    def __init__(self, fh, abort: threading.Event | None = None):
        self.fh, self.crc, self.size, self.abort = fh, 0, 0, abort
        self.error: OSError | None = None  # the OS error of a failed write (torch.save may hide it)

    def write(self, data) -> int:
        if self.abort is not None and self.abort.is_set():
            raise _Aborted("checkpoint save abandoned")
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        try:
            return self.fh.write(data)
        except OSError as err:
            self.error = self.error or err
            raise

    def flush(self) -> None:
        try:
            self.fh.flush()
        except OSError as err:
            self.error = self.error or err
            raise


# The abort event of the save this thread is writing (set by CheckpointManager._write), read by
# _save_synced: the file writer stops at its next chunk once the save is abandoned.
_WRITING = threading.local()


def _save_synced(obj: Any, path: Path) -> dict:
    out = None
    try:
        with open(path, "wb") as fh:
            out = _ChecksummingFile(fh, getattr(_WRITING, "abort", None))
            torch.save(obj, out)
            fh.flush()
            os.fsync(fh.fileno())
            return {"size": out.size, "crc32": out.crc}
    except Exception as err:
        raise _naming(path, err, out.error if out is not None else None) from err


def _naming(path: Path, err: BaseException, seen: OSError | None = None) -> BaseException:
    """The OS error behind a failed write, naming ``path``: torch.save reports a
    full disk as ``RuntimeError: ... unexpected pos``, and a failed write() or
    flush() names no file. Anything else is returned as it is."""
    cause = seen or (err if isinstance(err, OSError) else None)
    if cause is None and isinstance(err, RuntimeError):
        try:
            stats = os.statvfs(path.parent)
            if stats.f_bavail == 0:
                cause = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            pass
    if cause is None or cause.errno is None:
        return err
    return OSError(cause.errno, cause.strerror or os.strerror(cause.errno), str(path))


def _write_json_synced(obj: Any, path: Path) -> None:
    """Write, fsync, then rename into place: a reader polling for ``path`` (rank
    0 waiting for another rank's done-marker) never sees it half-written."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as fh:
            json.dump(obj, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        raise _naming(path, err) from err


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc
