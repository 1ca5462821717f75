"""The sinks behind the metric channel: ``metrics.jsonl``, TensorBoard and W&B.

:class:`~pimm.engines.metrics.MetricChannel` buffers and reduces; this class
only writes what it is handed, on rank 0. ``metrics.jsonl`` gets every record
(floats with full precision; a non-finite value is written as ``null`` so
every line stays valid JSON). TensorBoard and W&B get each flushed window of
a dense per-step series reduced to one point at the window's last step, as
detectron2 and mmengine log: a dashboard event per step would cost more than
the step itself on small models.

On resume the writer rewinds to the checkpoint: lines of ``metrics.jsonl``
written after it are moved to ``metrics.rewound.jsonl`` (nothing is
deleted), TensorBoard purges later steps, and W&B continues the same run id.
"""

from __future__ import annotations

import json
import logging
import math
import os
import uuid
from pathlib import Path
from typing import Any

from pimm.utils import comm

__all__ = ["MetricsWriter", "METRICS_FILE", "REWOUND_FILE"]

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"


class MetricsWriter:
    """Rank 0's outputs for flushed metrics: ``metrics.jsonl`` (every record,
    non-finite values as ``null``), TensorBoard (one event per logging window)
    and, with ``use_wandb``, a W&B run whose id is chosen here so that the first
    checkpoint carries it and a resume continues the same run. On other ranks it
    writes nothing.

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
        self._tb = None
        self._wandb_run = None
        self._purge_step: int | None = None
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
        lines = "".join(json.dumps(_json_safe(r)) + "\n" for r in records)
        self._jsonl.write(lines)
        self._jsonl.flush()
        self.last_step = max(self.last_step, max(r["step"] for r in records))
        if self._tb is None and self._wandb_run is None:
            return
        for step, scalars in _dashboard_events(records, kinds):
            if self._tb is not None and scalars:
                self._add_tb_scalars(scalars, step)
            if self._wandb_run is not None:
                self._wandb_run.log(scalars, step=step)

    def _add_tb_scalars(self, scalars: dict[str, float], step: int) -> None:
        # One event holding every scalar of the window: tensorboardX sends each
        # event through a multiprocessing queue and a writer thread, so one
        # add_scalar per tag cost ~100 us each on the training thread.
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in scalars.items()]
        self._tb._get_file_writer().add_summary(Summary(value=values), step)

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

    def _open(self) -> None:
        if self._jsonl is not None:
            return
        self.save_path.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.save_path / METRICS_FILE, "a")
        if self.enable_tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.save_path / "tensorboard"), purge_step=self._purge_step)
        if self.use_wandb:
            import wandb

            self._wandb_run = wandb.init(
                id=self.wandb_run_id, resume="allow", dir=str(self.save_path), **self.wandb_init
            )

    # -- resume ---------------------------------------------------------
    def state_dict(self) -> dict:
        """The metrics.jsonl offset and last step (synced to disk), the W&B run id."""
        if self._jsonl is not None:
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
        path = self.save_path / METRICS_FILE
        return {
            "jsonl_bytes": path.stat().st_size if self.is_main and path.exists() else 0,
            "last_step": self.last_step,
            "wandb_run_id": self.wandb_run_id,
        }

    def load_state_dict(self, state: dict) -> None:
        """Rewind to the checkpoint's offset (metrics logged after it are dropped); reattach the W&B run."""
        self.rewind(state["jsonl_bytes"], state["last_step"])
        if state.get("wandb_run_id"):
            self.wandb_run_id = state["wandb_run_id"]

    def rewind(self, jsonl_bytes: int, last_step: int) -> None:
        """Forget everything logged after a checkpoint taken at ``last_step``."""
        self.last_step = last_step
        self._purge_step = last_step + 1
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

    def close(self) -> None:
        """Flush and close every sink."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


_WINDOW_REDUCE = {"min": min, "max": max, "last": lambda values: values[-1]}


def _dashboard_events(records: list[dict], kinds: list[tuple]):
    """``(step, scalars)`` for the dashboards: each run of consecutive dense
    records collapses to one point at the run's last step (by the tag's
    reduce op: min, max, last; the mean otherwise)."""
    window: list[dict] = []
    window_reduce: Any = "mean"

    def collapse():
        out = {}
        for tag in window[-1]:
            if tag in ("step", "epoch") or not _is_number(window[-1][tag]):
                continue
            values = [r[tag] for r in window if _is_number(r.get(tag))]
            op = window_reduce if isinstance(window_reduce, str) else window_reduce.get(tag, "mean")
            out[tag] = _WINDOW_REDUCE.get(op, lambda v: sum(v) / len(v))(values)
        return window[-1]["step"], out

    for record, (dense, reduce) in zip(records, kinds):
        if dense:
            window.append(record)
            window_reduce = reduce
            continue
        if window:
            yield collapse()
            window = []
        yield record["step"], {k: v for k, v in record.items() if k not in ("step", "epoch") and _is_number(v)}
    if window:
        yield collapse()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _json_safe(record: dict) -> dict:
    """Non-finite floats become null: bare NaN/Infinity are not JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
