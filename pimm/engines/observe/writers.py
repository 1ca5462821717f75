"""The sinks behind the metric channel: ``metrics.jsonl``, TensorBoard and W&B.

:class:`~pimm.engines.observe.metrics.MetricChannel` buffers and reduces; this class
only writes what it is handed, on rank 0. ``metrics.jsonl`` gets every record
(floats with full precision; a non-finite value is written as ``null`` so
every line stays valid JSON). TensorBoard and W&B get each logging window of
a dense per-step series reduced to one point per tag at the window's last
step, as detectron2 and mmengine log: a dashboard event per step would cost
more than the step itself on small models.

Dashboard windows: each flush ends a window at the largest step it wrote
(``(previous end, end]``); every tag is reduced by its own op (``mean``,
``sum``, ``min``, ``max``, ``last``) over exactly its finite values of
``metrics.jsonl`` in that step range, whoever published them and in which
hook phase. Because a hook running after the flush in the same step may
still publish for that step, a window reaches the dashboards at the next
flush that goes past its end (or at a checkpoint, or when the writer
closes). Records that are not dense are written at their own step.

On resume the writer rewinds to the checkpoint: lines of ``metrics.jsonl``
written after it are moved to ``metrics.rewound.jsonl`` (nothing is
deleted), TensorBoard purges later steps, and W&B continues the same run id,
rewound to the checkpoint's step (:mod:`pimm.engines.observe.wandb_options`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from itertools import repeat
from pathlib import Path
from typing import Any

from pimm.engines.loop.hook_contract import SummaryWriterCalls
from pimm.engines.observe.metrics import is_number, reduce_values, tag_op
from pimm.utils import comm

__all__ = ["MetricsWriter", "METRICS_FILE", "REWOUND_FILE"]

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"


class MetricsWriter(SummaryWriterCalls):
    """Rank 0's outputs for flushed metrics: ``metrics.jsonl`` (every record,
    non-finite values as ``null``), TensorBoard (one event per logging window)
    and, with ``use_wandb``, a W&B run whose id is chosen here so that the first
    checkpoint carries it and a resume continues the same run. On other ranks it
    writes nothing. Hooks written for upstream call TensorBoard's ``add_scalar``,
    ``add_scalars``, ``add_image``, ``add_histogram`` on it
    (:class:`~pimm.engines.loop.hook_contract.SummaryWriterCalls`).

    Args:
        save_path: the run directory.
        enable_tensorboard: write ``save_path/tensorboard``.
        use_wandb: also log to W&B (offline with ``WANDB_MODE=offline``).
        wandb_init: extra ``wandb.init`` arguments.
    """
    def __init__(
        self,
        save_path: str | Path,
        enable_tensorboard: bool = True,
        use_wandb: bool = False,
        wandb_init: dict | None = None,
        logger: logging.Logger | None = None,
    ):
        self.save_path = Path(save_path)
        self.is_main = comm.is_main_process()
        self.enable_tensorboard = enable_tensorboard
        self.use_wandb = use_wandb
        self.wandb_init = dict(wandb_init or {})
        self.logger = logger or logging.getLogger("pimm")
        self._jsonl = None
        self._unsynced: list[int] = []  # dup'd descriptors of metrics.jsonl awaiting their fsync
        self._tb = None
        self._wandb_run = None
        self._purge_step: int | None = None
        self._window = DashboardWindow()
        self.wandb_run_id: str | None = None
        self.last_step = 0
        if self.use_wandb and self.is_main:
            # Chosen here, not by wandb.init, so the first checkpoint already carries it.
            self.wandb_run_id = uuid.uuid4().hex[:12]

    def write(self, records: list[dict], kinds: list[tuple]) -> None:
        """Write reduced records (the channel's sink). ``kinds[i]`` is ``(dense, reduce)``."""
        if not self.is_main:
            return
        self._open()
        lines = _jsonl(records)
        try:
            self._jsonl.write(lines)
            self._jsonl.flush()
        except OSError as err:  # a write error carries no file name: give it one for the error line
            raise OSError(err.errno, err.strerror, str(self.save_path / METRICS_FILE)) from err
        self.last_step = max(self.last_step, max([r["step"] for r in records]))  # a list: no generator resumed per record
        if self._tb is None and self._wandb_run is None:
            return
        self._emit(self._window.add(records, kinds))

    def _emit(self, events: list[tuple[int, dict[str, float]]]) -> None:
        for step, scalars in events:
            if not scalars:
                continue
            if self._tb is not None:
                self._add_tb_scalars(scalars, step)
            if self._wandb_run is not None:
                self._wandb_run.log(scalars, step=step)

    def _add_tb_scalars(self, scalars: dict[str, float], step: int) -> None:
        self._tb.add_scalars(scalars, step)  # one event holding every scalar of the window

    @property
    def logs_images(self) -> bool:
        """Whether an image would go anywhere (TensorBoard or W&B, rank 0)."""
        return self.is_main and (self.enable_tensorboard or self.use_wandb)

    def add_images(self, images: dict[str, Any], step: int) -> None:
        """``{tag: (H, W, 3) uint8 array}`` to TensorBoard and W&B (rank 0)."""
        if not self.logs_images or not images:
            return
        self._open()
        for tag, image in images.items():
            if self._tb is not None:
                self._tb.add_image(tag, image, step, dataformats="HWC")
        if self._wandb_run is not None:
            import wandb

            self._wandb_run.log({tag: wandb.Image(image) for tag, image in images.items()}, step=step)

    def open(self) -> None:
        """Open the sinks now (rank 0; otherwise the first write opens them)."""
        if self.is_main:
            self._open()

    def _open(self) -> None:
        if self._jsonl is not None:
            return
        self.save_path.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.save_path / METRICS_FILE, "a")
        if self.enable_tensorboard:
            from pimm.engines.observe.tensorboard_file import TensorBoardFile

            self._tb = TensorBoardFile(self.save_path / "tensorboard", purge_step=self._purge_step, logger=self.logger)
        if self.use_wandb:
            from pimm.engines.observe.wandb_options import start_wandb_run

            self._wandb_run = start_wandb_run(self.wandb_init, self.wandb_run_id, self.save_path,
                                              rewind=self._wandb_rewind, logger=self.logger)
            self.wandb_run_id = self._wandb_run.id  # wandb_run_id, when set, wins: checkpoints carry it

    # -- resume ---------------------------------------------------------
    #: When True, :meth:`state_dict` leaves the fsync of ``metrics.jsonl`` to
    #: :meth:`sync_pending`, which the trainer hands to its checkpoint manager
    #: (``before_commit``): the disk wait then happens on the checkpoint's writer
    #: thread, still before the checkpoint that records the file's length commits,
    #: instead of blocking the training step.
    defer_fsync = False

    def sync_pending(self) -> None:
        """fsync ``metrics.jsonl`` as far as the last :meth:`state_dict` wrote it
        (safe from another thread: each state_dict handed over its own descriptor)."""
        while self._unsynced:
            fd = self._unsynced.pop()
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def state_dict(self) -> dict:
        """The resume point: bytes of ``metrics.jsonl``, last step, W&B run id.
        The open dashboard window is written out here, so that a resumed run
        (whose TensorBoard purges only later steps) never draws it twice."""
        if self._jsonl is not None:
            self._emit(self._window.close())
            self._jsonl.flush()
            if self.defer_fsync:  # done by the checkpoint's writer before its commit (sync_pending)
                self._unsynced.append(os.dup(self._jsonl.fileno()))
            else:
                os.fsync(self._jsonl.fileno())
        path = self.save_path / METRICS_FILE
        return {
            "jsonl_bytes": path.stat().st_size if self.is_main and path.exists() else 0,
            "last_step": self.last_step,
            "wandb_run_id": self.wandb_run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        """Rewind to a checkpoint's :meth:`state_dict`."""
        self.rewind(state["jsonl_bytes"], state["last_step"])
        if state.get("wandb_run_id"):
            self.wandb_run_id = state["wandb_run_id"]
            self._wandb_rewind = (state["wandb_run_id"], state["last_step"])  # W&B rewinds there too

    def rewind(self, jsonl_bytes: int, last_step: int) -> None:
        """Forget everything logged after a checkpoint taken at ``last_step``."""
        self.last_step = last_step
        self._purge_step = last_step + 1
        self._window = DashboardWindow(end=last_step if last_step else None)
        if not self.is_main:
            return
        path = self.save_path / METRICS_FILE
        if not path.exists() or path.stat().st_size <= jsonl_bytes:
            return
        with open(path, "rb+") as fh:
            fh.seek(jsonl_bytes)
            tail = fh.read()
            with open(self.save_path / REWOUND_FILE, "ab") as out:
                out.write(tail)
                out.flush()
                os.fsync(out.fileno())
            fh.truncate(jsonl_bytes)
        moved = tail.count(b"\n")
        self.logger.info(
            f"Rewound {METRICS_FILE} to the checkpoint at step {last_step}; "
            f"{moved} later line(s) moved to {REWOUND_FILE}"
        )

    def record_exception(self, exc: BaseException, step: int) -> None:
        """A failed run's exception, on rank 0: TensorBoard text ``failure`` at
        ``step`` and the W&B summary's ``exception``; the W&B run ends marked failed."""
        if not self.is_main or not (self.enable_tensorboard or self.use_wandb):
            return
        import traceback

        text = "".join(traceback.format_exception(exc)).rstrip()
        self._open()
        if self._tb is not None:
            self._tb.add_text("failure", "```\n" + text + "\n```", step)
        if self._wandb_run is not None:
            self._wandb_run.record_failure(text, step)
            self._failed = True

    _failed = False
    _wandb_rewind: tuple[str, int] | None = None  # (run id, step) of the checkpoint a resume starts from

    def close(self) -> None:
        """Write the open dashboard window, then close every sink."""
        self.sync_pending()
        if self._jsonl is not None:
            self._emit(self._window.close())
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish(exit_code=1 if self._failed else None)
            self._wandb_run = None


class DashboardWindow:
    """The dense values of the logging window not yet on the dashboards.

    :meth:`add` takes each flush's records and returns the dashboard events
    ``(step, {tag: value})`` that are complete: a window ``(start, end]``
    (``end`` the largest step flushed so far) is complete once a flush goes
    past ``end``; dense values at or before ``end`` that arrive later (a hook
    publishing after the flush in the same step) still join it."""

    def __init__(self, end: int | None = None):
        self.end = end
        self._values: dict[str, tuple[str, list[float]]] = {}  # tag -> (reduce op, values in step order)

    def add(self, records: list[dict], kinds: list[tuple]) -> list[tuple[int, dict[str, float]]]:
        """Fold in one flush; the events it completes, in step order."""
        newest = max([r["step"] for r in records])
        closes = self.end is not None and newest > self.end
        later: dict[str, tuple[str, list[float]]] = {}
        events: list[tuple[int, dict[str, float]]] = []
        isfinite = math.isfinite
        for record, (dense, reduce) in zip(records, kinds):
            if not dense:
                scalars = {k: v for k, v in record.items() if k not in ("step", "epoch") and is_number(v)}
                events.append((record["step"], scalars))
                continue
            into = later if closes and record["step"] > self.end else self._values
            for tag, value in record.items():
                # is_number, with the common float first (this runs for every value of every flush)
                if tag == "step" or tag == "epoch" or \
                        not (isfinite(value) if value.__class__ is float else is_number(value)):
                    continue
                entry = into.get(tag)
                if entry is None:
                    into[tag] = entry = (tag_op(reduce, tag), [])
                entry[1].append(value)
        if closes:
            events.extend(self.close())
            self._values = later
        self.end = newest if self.end is None else max(self.end, newest)
        events.sort(key=lambda event: event[0])  # W&B drops a step lower than one it already has
        return events

    def close(self) -> list[tuple[int, dict[str, float]]]:
        """The open window as one event (none if it is empty); a new one starts."""
        values, self._values = self._values, {}
        if not values or self.end is None:
            return []
        return [(self.end, {tag: reduce_values(op, vals) for tag, (op, vals) in values.items()})]


def _finite_chunks():
    """The C encoder behind json.dumps, refusing NaN/Infinity (ValueError)
    instead of writing them (not JSON). json.dumps builds a new one at every
    call; this one is built once, as every logged step's record goes through
    it. None where the C encoder is missing."""
    settings = json.JSONEncoder(allow_nan=False)
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    return make(None, settings.default, json.encoder.encode_basestring_ascii, None, settings.key_separator,
                settings.item_separator, False, False, False)


_FINITE_CHUNKS = _finite_chunks()


def _jsonl(records: list[dict]) -> str:
    """``metrics.jsonl`` lines of ``records``; a non-finite value is written as null."""
    if _FINITE_CHUNKS is not None:
        try:  # every record encoded in C: no Python call per record
            return "\n".join(map("".join, map(_FINITE_CHUNKS, records, repeat(0)))) + "\n"
        except ValueError:  # a non-finite float somewhere in this flush
            pass
    return "".join(json.dumps(_json_safe(r)) + "\n" for r in records)


def _json_safe(record: dict) -> dict:
    """Non-finite floats become null: bare NaN/Infinity are not JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
