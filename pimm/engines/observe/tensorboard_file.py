"""A TensorBoard event file appended on the calling thread.

Why not tensorboardX's ``SummaryWriter``: it hands every event to a
``multiprocessing.Queue`` whose feeder thread pickles it into a pipe for a
third thread that appends it to the file. pimm writes one small event per
logging window, and on a small model those wake-ups and GIL hand-overs cost
about 5 % of the training step (``bench/overhead_services.py``). Here the
event is framed (TFRecord: length, masked CRC-32C of the length, payload,
masked CRC-32C of the payload) and appended with one unbuffered ``write``
call, so it is in the file when the call returns: a killed run keeps every
event written before the kill. tensorboardX still builds the summaries
(protobufs, image encoding, histogram bins) and masks the CRC
(``record_writer.masked_crc32c``).

The file is created exclusively (``events.out.tfevents.<time>.<host>.<pid>``,
a counter appended when that name exists), so a resumed run never overwrites
the event file of the run before it. A write that fails (a full disk) is one
log line; the file then takes no more events (``metrics.jsonl`` has every
value).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import math
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TensorBoardFile", "tensorflow_bin_edges"]


class TensorBoardFile:
    """Append TensorBoard events to a new file in ``logdir``.

    Args:
        logdir: the folder (created if missing).
        purge_step: steps from this one on, written by an earlier event file of
            the same folder, are hidden by TensorBoard (a resumed run).
        logger: where a write failure is reported, once.
    """

    def __init__(self, logdir: str | Path, purge_step: int | None = None, logger: logging.Logger | None = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog
        from tensorboardX.record_writer import masked_crc32c

        self.logdir = Path(logdir)
        self.logger = logger or logging.getLogger("pimm")
        self._masked_crc = masked_crc32c
        self._event = Event
        self._fd: int | None = None
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.path = self._create_file()
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self._write(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def _create_file(self) -> Path:
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        for attempt in range(1000):
            path = self.logdir / (stem if attempt == 0 else f"{stem}.{attempt}")
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
                return path
            except FileExistsError:
                continue
        raise FileExistsError(f"{self.logdir}: no free event-file name after 1000 tries ({stem}.*)")

    # -- events ---------------------------------------------------------
    def add_summary(self, summary: Any, step: int) -> None:
        """Append one ``Summary`` protobuf as the event of ``step``."""
        self._write(self._event(wall_time=time.time(), step=int(step), summary=summary))

    def add_scalars(self, scalars: dict[str, float], step: int) -> None:
        """Every ``{tag: value}`` in one event at ``step``."""
        from tensorboardX.proto.summary_pb2 import Summary

        self.add_summary(Summary(value=[Summary.Value(tag=tag, simple_value=float(value))
                                        for tag, value in scalars.items()]), step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar as its own event."""
        self.add_scalars({tag: value}, step)

    def add_image(self, tag: str, image: Any, step: int, dataformats: str = "CHW") -> None:
        """An image (``dataformats`` as TensorBoard's), PNG-encoded by tensorboardX."""
        from tensorboardX.summary import image as image_summary

        self.add_summary(image_summary(tag, image, dataformats=dataformats), step)

    def add_histogram(self, tag: str, values: Any, step: int, bins: Any = "tensorflow") -> None:
        """A histogram of ``values``. ``bins`` is numpy's (a count, edges or a rule
        such as ``"auto"``), or ``"tensorflow"`` (the default of TensorBoard's
        ``SummaryWriter.add_histogram``): TensorFlow's fixed exponential buckets.
        The conversion into buckets (``tensorboardX.summary.histogram``) knows only
        numpy's rules, so that name is resolved here."""
        from tensorboardX.summary import histogram

        if isinstance(bins, str) and bins == "tensorflow":
            bins = tensorflow_bin_edges()
        self.add_summary(histogram(tag, values, bins), step)

    def add_text(self, tag: str, text: str, step: int) -> None:
        """A text entry (markdown in TensorBoard's text tab)."""
        from tensorboardX.summary import text as text_summary

        self.add_summary(text_summary(tag, text), step)

    # -- file -----------------------------------------------------------
    def _write(self, event: Any) -> None:
        if self._fd is None:
            return
        payload = event.SerializeToString()
        header = struct.pack("<Q", len(payload))
        record = b"".join((header, struct.pack("<I", self._masked_crc(header)), payload,
                           struct.pack("<I", self._masked_crc(payload))))
        try:
            written = os.write(self._fd, record)
            if written != len(record):  # a short write on a regular file: the disk filled mid-record
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            self._fail(err)

    def _fail(self, err: OSError) -> None:
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):
            os.close(fd)
        self.logger.error(f"TensorBoard: cannot write {self.logdir}: {err}; no more events are written there "
                          "(metrics.jsonl has every value)")

    def close(self) -> None:
        """fsync and close; later events are dropped."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            except OSError as err:
                self._fail(err)
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)


@functools.lru_cache(maxsize=1)
def tensorflow_bin_edges() -> np.ndarray:
    """TensorFlow's default histogram bucket edges: ``0`` and ``+-1e-12 * 1.1**k``
    up to ``1e20``, so one set of buckets fits any magnitude (1549 edges)."""
    exponents = np.arange(int(math.ceil(math.log(1e32) / math.log(1.1))))
    positive = 1e-12 * np.power(1.1, exponents)
    positive = positive[positive < 1e20]
    return np.concatenate([-positive[::-1], [0.0], positive])
