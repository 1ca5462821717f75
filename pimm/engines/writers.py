"""Scalar logging to ``metrics.jsonl``, TensorBoard and W&B.

Hot-path friendly: ``add_scalars`` only appends (device tensors stay on the
device); ``flush`` moves every buffered tensor to the host in one transfer,
averages it over ranks in one collective, and writes. All ranks buffer and
flush in lockstep (the collective needs them); only rank 0 writes files.

On resume the writer rewinds to the checkpoint: lines of ``metrics.jsonl``
written after it are moved to ``metrics.rewound.jsonl`` (nothing is
deleted), TensorBoard purges later steps, and W&B continues the same run id.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from pimm.utils import comm

__all__ = ["MetricsWriter"]

METRICS_FILE = "metrics.jsonl"
REWOUND_FILE = "metrics.rewound.jsonl"


class MetricsWriter:
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
        self._pending: list[tuple[int, int, dict[str, Any]]] = []
        self._jsonl = None
        self._tb = None
        self._wandb_run = None
        self._purge_step: int | None = None
        self.wandb_run_id: str | None = None
        self.last_step = 0
        if self.use_wandb and self.is_main:
            # Chosen here, not by wandb.init, so the first checkpoint already carries it.
            self.wandb_run_id = uuid.uuid4().hex[:12]

    # -- buffering ------------------------------------------------------
    def add_scalars(self, scalars: dict[str, Any], step: int, epoch: int, dense: bool = False) -> None:
        """Queue ``tag: value`` pairs for ``step``. Tensor values are averaged over
        ranks at flush time; python numbers are written as given.

        ``dense=True`` marks a per-step series (the training loss): every value
        goes to ``metrics.jsonl``, while TensorBoard and W&B get the mean over
        each flushed window at its last step, as detectron2 and mmengine log —
        a dashboard event per step would cost more than the step itself on
        small models."""
        self._pending.append((step, epoch, scalars, dense))

    def flush(self) -> list[dict]:
        """Write everything buffered; returns the records written (on every rank)."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        tensors = [v for _, _, scalars, _ in pending for v in scalars.values() if isinstance(v, torch.Tensor)]
        values = iter(())
        if tensors:
            # One stack and one host transfer for the whole window.
            stacked = torch.stack([t.detach().reshape(()) for t in tensors]).float()
            values = iter(comm.all_reduce(stacked, op="mean").tolist())
        records, dense_flags = [], []
        for step, epoch, scalars, dense in pending:
            record = {"step": step, "epoch": epoch}
            for tag, value in scalars.items():
                record[tag] = next(values) if isinstance(value, torch.Tensor) else value
            records.append(record)
            dense_flags.append(dense)
        if self.is_main:
            self._write(records, dense_flags)
        return records

    def _write(self, records: list[dict], dense_flags: list[bool]) -> None:
        self._open()
        lines = "".join(json.dumps(r) + "\n" for r in records)
        self._jsonl.write(lines)
        self._jsonl.flush()
        self.last_step = max(self.last_step, max(r["step"] for r in records))
        if self._tb is None and self._wandb_run is None:
            return
        for step, scalars in _dashboard_events(records, dense_flags):
            if self._tb is not None:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
            if self._wandb_run is not None:
                self._wandb_run.log(scalars, step=step)

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
        self.flush()
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
        self.rewind(state["jsonl_bytes"], state["last_step"])
        if state.get("wandb_run_id"):
            self.wandb_run_id = state["wandb_run_id"]

    def rewind(self, jsonl_bytes: int, last_step: int) -> None:
        """Forget everything logged after a checkpoint taken at ``last_step``."""
        self._pending.clear()
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

    def close(self, flush: bool = True) -> None:
        """Flush and close. ``flush=False`` (after a failure) drops pending values:
        flushing is a collective that other ranks may never join."""
        try:
            if flush:
                self.flush()
        finally:
            if self._jsonl is not None:
                self._jsonl.close()
                self._jsonl = None
            if self._tb is not None:
                self._tb.close()
                self._tb = None
            if self._wandb_run is not None:
                self._wandb_run.finish()
                self._wandb_run = None


def _dashboard_events(records: list[dict], dense_flags: list[bool]):
    """``(step, scalars)`` for the dashboards: each run of consecutive dense
    records collapses into its mean at the run's last step."""
    window: list[dict] = []

    def collapse():
        tags = [k for k in window[-1] if k not in ("step", "epoch") and _is_number(window[-1][k])]
        means = {t: sum(r[t] for r in window if t in r) / sum(1 for r in window if t in r) for t in tags}
        return window[-1]["step"], means

    for record, dense in zip(records, dense_flags):
        if dense:
            window.append(record)
            continue
        if window:
            yield collapse()
            window = []
        yield record["step"], {k: v for k, v in record.items() if k not in ("step", "epoch") and _is_number(v)}
    if window:
        yield collapse()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
