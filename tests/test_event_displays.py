"""Event displays reach TensorBoard: the evaluators of the ring and point-cloud
tasks log their first validation events as images at every evaluation
(``log_images``, 0 turns it off)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from tests.support.run import ROOT, run_tool

pytestmark = pytest.mark.slow


def tensorboard_images(run: Path) -> dict[str, list[int]]:
    """``{tag: [steps]}`` of the image summaries in a run's TensorBoard event files."""
    from tensorboardX.proto.event_pb2 import Event

    found: dict[str, list[int]] = {}
    for path in sorted((run / "tensorboard").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("image"):
                    assert value.image.width > 100 and value.image.height > 100
                    assert value.image.encoded_image_string[:4] == b"\x89PNG"
                    found.setdefault(value.tag, []).append(event.step)
    return found


def test_ring_and_point_evaluators_log_their_events(tmp_path):
    rings = tmp_path / "rings.py"
    rings.write_text(f"""
_base_ = {str(ROOT / 'configs' / 'rings' / 'cls-cnn.py')!r}
save_path = {str(tmp_path / 'rings')!r}
epoch = 2
batch_size = 32
data = dict(train=dict(num_events=64), val=dict(num_events=40), test=dict(num_events=8))
""")
    assert run_tool("train", rings).returncode == 0
    images = tensorboard_images(tmp_path / "rings")
    assert images == {"val_events/ClsEvaluator/0": [2, 4], "val_events/ClsEvaluator/1": [2, 4]}

    points = tmp_path / "points.py"
    points.write_text(f"""
_base_ = {str(ROOT / 'configs' / 'lartpc' / 'semseg-sparseunet.py')!r}
save_path = {str(tmp_path / 'points')!r}
epoch = 1
batch_size = 4
model = dict(backbone=dict(channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,)))
scheduler = dict(type="CosineWarmupLR", warmup_steps=0)
data = dict(train=dict(num_events=8), val=dict(num_events=3), test=dict(num_events=2))
hooks = [dict(type="SemSegEvaluator", num_classes=5, log_images=1), dict(type="CheckpointSaver")]
""")
    result = run_tool("train", points)
    assert result.returncode == 0, result.stderr[-2000:]
    assert tensorboard_images(tmp_path / "points") == {"val_events/SemSegEvaluator/0": [2]}

    off = run_tool("train", rings, f"save_path={tmp_path / 'off'}", "hooks.ClsEvaluator.log_images=0")
    assert off.returncode == 0 and tensorboard_images(tmp_path / "off") == {}
