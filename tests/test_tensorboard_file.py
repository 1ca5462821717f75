"""pimm's synchronous TensorBoard event file (pimm/engines/observe/tensorboard_file.py)."""

import struct

from pimm.engines.observe.tensorboard_file import TensorBoardFile


def records(path):
    data, pos, payloads = path.read_bytes(), 0, []
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        payloads.append(data[pos + 12:pos + 12 + length])
        pos += 12 + length + 4
    assert pos == len(data)
    return payloads


def test_records_are_framed_as_tensorboardx_frames_them(tmp_path):
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import RecordWriter

    events = TensorBoardFile(tmp_path / "tb", purge_step=5)
    events.add_scalars({"train/loss": 0.25, "train/lr": 1e-3}, 7)
    events.add_text("note", "hello", 8)
    events.close()
    payloads = records(events.path)
    reference = RecordWriter(str(tmp_path / "reference"))
    for payload in payloads:
        reference.write(payload)
    reference.close()
    assert (tmp_path / "reference").read_bytes() == events.path.read_bytes()
    decoded = [Event.FromString(p) for p in payloads]
    assert decoded[0].file_version == "brain.Event:2"
    assert [e.step for e in decoded[1:]] == [5, 5, 7, 8]  # the purge marker, then the events
    assert {v.tag: round(v.simple_value, 6) for v in decoded[3].summary.value} == {"train/loss": 0.25,
                                                                                    "train/lr": 0.001}


def test_every_event_is_in_the_file_when_the_call_returns(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    events = TensorBoardFile(tmp_path)
    events.add_scalar("a", 1.0, 3)
    assert [Event.FromString(p).step for p in records(events.path)] == [0, 3]  # not closed, nothing buffered
    events.close()


def test_a_second_file_in_the_same_second_never_overwrites_the_first(tmp_path, monkeypatch):
    import pimm.engines.observe.tensorboard_file as module

    monkeypatch.setattr(module.time, "time", lambda: 1_700_000_000.0)
    first = TensorBoardFile(tmp_path)
    first.add_scalar("a", 1.0, 1)
    first.close()
    before = first.path.read_bytes()
    second = TensorBoardFile(tmp_path)
    second.close()
    assert second.path != first.path and first.path.read_bytes() == before
    assert second.path.name == first.path.name + ".1"
