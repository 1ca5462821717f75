"""Every tag a hook publishes reaches TensorBoard and W&B: one point per
logging window per tag, equal to that window's reduction (by the tag's own
reduce op) of exactly the values ``metrics.jsonl`` holds, whatever the hook
phase and priority.

Both dashboards are read back from the files they wrote: TensorBoard's event
files (TFRecord framing, tensorboardX's protobufs, CRCs checked) and the W&B
offline run's ``.wandb`` transaction log (W&B's block format, its
``Record`` protobufs).
"""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import pytest
import torch

from pimm.engines import HOOKS, HookBase
from tests.support.inprocess import make_trainer, records

STEPS_PER_EPOCH, EPOCHS, LOG_FREQUENCY = 4, 3, 3
#: a flush ends a window: InformationWriter's cadence and each epoch end (evaluation, checkpoint)
BOUNDARIES = sorted({s for s in range(1, STEPS_PER_EPOCH * EPOCHS + 1)
                     if s % LOG_FREQUENCY == 0 or s % STEPS_PER_EPOCH == 0})
OPS = {"train/early_norm": "mean", "train/early_min": "min",
       "train/late_peak": "max", "train/late_total": "sum", "train/late_last": "last",
       "train/loss": "mean", "train/lr": "mean"}


@HOOKS.register_module(force=True)
class EarlyNormProbe(HookBase):
    """A dense series from ``after_backward`` (this step's gradient norm), mean and min."""

    def after_backward(self):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.trainer.model.parameters()
                                                     if p.grad is not None]))
        self.trainer.metrics.publish({"train/early_norm": norm, "train/early_min": norm * 2},
                                     reduce={"train/early_min": "min"}, dense=True,
                                     step=self.trainer.global_step + 1)


@HOOKS.register_module(force=True)
class LatePeakProbe(HookBase):
    """A dense series from ``after_step`` (after the step counter moved), max, sum and last."""

    def after_step(self):
        loss = self.trainer.comm_info["loss"].detach()
        wobble = 1.0 + 0.5 * math.sin(self.trainer.global_step)  # not monotone: max, last and mean differ
        self.trainer.metrics.publish({"train/late_peak": loss * wobble, "train/late_total": loss,
                                      "train/late_last": loss * wobble},
                                     reduce={"train/late_peak": "max", "train/late_total": "sum",
                                             "train/late_last": "last"}, dense=True)


def _reduce(op: str, values: list[float]) -> float:
    if op == "last":
        return values[-1]
    return {"min": min, "max": max, "sum": sum}.get(op, lambda v: sum(v) / len(v))(values)


def expected_points(rows: list[dict], tag: str) -> dict[int, float]:
    """``{window end: reduction}`` computed from metrics.jsonl alone."""
    out, start = {}, 0
    for end in BOUNDARIES:
        values = [r[tag] for r in rows if tag in r and start < r["step"] <= end and r[tag] is not None]
        if values:
            out[end] = _reduce(OPS[tag], values)
        start = end
    return out


# ----------------------------------------------------------------------------- readers


def _masked_crc(data: bytes) -> int:
    from tensorboardX.crc32c import crc32c

    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_tensorboard(directory: Path) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file under ``directory``."""
    from tensorboardX.proto.event_pb2 import Event

    points: dict[str, list[tuple[int, float]]] = {}
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {directory}"
    for path in files:
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[pos + 8:pos + 12])[0] == _masked_crc(header)
            payload = data[pos + 12:pos + 12 + length]
            assert struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])[0] == _masked_crc(payload)
            pos += 16 + length
            event = Event.FromString(payload)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    points.setdefault(value.tag, []).append((event.step, value.simple_value))
    return points


def read_wandb_offline(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[int]]:
    """``{key: [(step, value), ...]}`` and the history rows' steps in order
    (``"exit"`` after them once the run's exit record is written), from an offline run's ``run-*.wandb`` log:
    32 KiB blocks of chunks (crc32 4 bytes, length 2, type 1: full, first,
    middle, last) after a 7-byte header, each record a ``wandb.proto`` Record."""
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    points: dict[str, list[tuple[int, float]]] = {}
    rows: list[int] = []
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # padding to the end of the block
            pos += left
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record, pending = Record.FromString(pending), b""
            if record.WhichOneof("record_type") == "exit":  # the run's last record: the log is complete
                rows.append("exit")
            if record.WhichOneof("record_type") == "history":
                rows.append(record.history.step.num)
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):
                        points.setdefault(key, []).append((record.history.step.num, json.loads(item.value_json)))
    return points, rows


# ----------------------------------------------------------------------------- the test


@pytest.mark.parametrize("early, late", [(10, 90), (90, 10)], ids=["late-after-writer", "late-before-writer"])
def test_every_tag_reaches_tensorboard_and_wandb_once_per_window(tmp_path, monkeypatch, early, late):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    hooks = (f'[dict(type="EarlyNormProbe", priority={early}), dict(type="LatePeakProbe", priority={late}), '
             f'dict(type="InformationWriter", log_frequency={LOG_FREQUENCY}), '
             'dict(type="ClsEvaluator", num_classes=2), dict(type="CheckpointSaver")]')
    trainer = make_trainer(tmp_path, hooks, extra="use_wandb = True\nenable_tensorboard = True\n", epoch=EPOCHS)
    trainer.train()
    trainer.close()
    rows = records(trainer.save_path)
    assert max(r["step"] for r in rows) == STEPS_PER_EPOCH * EPOCHS
    tensorboard = read_tensorboard(trainer.save_path / "tensorboard")
    (run_dir,) = (trainer.save_path / "wandb").glob("offline-run-*")
    wandb_points, wandb_rows = read_wandb_offline(run_dir)
    deadline = time.monotonic() + 60
    while "exit" not in wandb_rows and time.monotonic() < deadline:  # W&B's service may still be writing
        time.sleep(0.5)
        wandb_points, wandb_rows = read_wandb_offline(run_dir)
    assert wandb_rows[-1] == "exit"
    wandb_rows = wandb_rows[:-1]
    for name, points in (("TensorBoard", tensorboard), ("W&B", wandb_points)):
        for tag in OPS:
            expected = expected_points(rows, tag)
            assert len(expected) == len(BOUNDARIES), (tag, expected)  # every window has values of every tag
            got = points.get(tag, [])
            assert [step for step, _ in got] == sorted(expected), (name, tag, got)  # one point per window
            for step, value in got:
                assert value == pytest.approx(expected[step], rel=1e-6), (name, tag, step)
        # evaluations are not dense: written at their own step, once
        assert [step for step, _ in points["val/acc"]] == [STEPS_PER_EPOCH * e for e in range(1, EPOCHS + 1)]
    # W&B's history rows: one per step, steps only growing (W&B drops a step lower than one it has)
    assert wandb_rows == sorted(set(wandb_rows)) and len(wandb_rows) >= len(BOUNDARIES)


def test_a_window_is_reduced_per_tag_even_when_the_last_record_lacks_it():
    """The regression behind the issue: a window whose last record came from another publisher."""
    from pimm.engines.observe.writers import DashboardWindow

    window = DashboardWindow()
    records = [{"step": 1, "epoch": 1, "a": 1.0}, {"step": 1, "epoch": 1, "b": 5.0},
               {"step": 2, "epoch": 1, "a": 3.0}, {"step": 2, "epoch": 1, "b": 4.0, "c": float("nan")},
               {"step": 2, "epoch": 1, "val/x": 0.5}]
    kinds = [(True, "mean"), (True, {"b": "max"}), (True, "mean"), (True, {"b": "max"}), (False, "mean")]
    assert window.add(records, kinds) == [(2, {"val/x": 0.5})]  # the window may still get values of step 2
    late = [{"step": 2, "epoch": 1, "b": 9.0}, {"step": 3, "epoch": 1, "a": 10.0}]
    assert window.add(late, [(True, "max"), (True, "mean")]) == [(2, {"a": 2.0, "b": 9.0})]
    assert window.close() == [(3, {"a": 10.0})]
