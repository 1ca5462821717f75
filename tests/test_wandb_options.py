"""W&B options (upstream pimm's runtime keys), tested offline: every key reaches
the run W&B records (read back from the offline run's ``.wandb`` file), an
unknown ``wandb_*`` key is one error line naming the nearest known key, and a
failed run's exception reaches TensorBoard text and the W&B summary."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from pimm.engines.observe.wandb_options import check_wandb_keys, wandb_init_options
from pimm.utils.config_dict import ConfigDict
from pimm.utils.errors import ConfigError
from tests.support import inprocess
from tests.support.run import run_tool, write_toy_config

HOOKS = '[dict(type="InformationWriter", log_frequency=2), dict(type="ClsEvaluator", num_classes=2), ' \
        'dict(type="CheckpointSaver")]'


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def wandb_records(save_path: Path, runs: int = 1) -> list:
    """The records of ``runs`` finished offline W&B runs (W&B's service may still
    be writing the file when ``finish()`` returns: wait for each run's exit record)."""
    deadline = time.monotonic() + 60
    while True:
        records = _read_wandb_files(save_path)
        if len(of_kind(records, "exit")) >= runs or time.monotonic() > deadline:
            return records
        time.sleep(0.2)


def _read_wandb_files(save_path: Path) -> list:
    """Every record of the run's offline ``.wandb`` files (oldest run first), as protobuf Records.
    The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of chunks
    (u32 crc, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    records = []
    for path in sorted(save_path.glob("wandb/offline-run-*/run-*.wandb")):
        raw, pos, chunk = path.read_bytes(), 7, b""
        while pos + 7 <= len(raw):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
            pos += 7
            if kind == 0:  # block padding
                pos += 32768 - pos % 32768 if pos % 32768 else 0
                continue
            chunk += raw[pos:pos + length]
            pos += length
            if kind in (1, 4):
                records.append(pb.Record.FromString(chunk))
                chunk = b""
    return records


def of_kind(records, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def history(records) -> dict[int, dict]:
    """``{W&B step: {key: value}}`` of the logged rows."""
    rows = {}
    for row in of_kind(records, "history"):
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in row.item}
        rows.setdefault(row.step.num, {}).update(items)
    return rows


def summary(records) -> dict:
    out = {}
    for update in of_kind(records, "summary"):
        for item in update.update:
            out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def tensorboard_texts(save_path: Path) -> dict[str, list[tuple[int, str]]]:
    """``{tag: [(step, text)]}`` of the text summaries in the run's TensorBoard files."""
    from tensorboardX.proto.event_pb2 import Event

    found: dict = {}
    for path in sorted((save_path / "tensorboard").glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "text":
                    found.setdefault(value.tag.split("/")[0], []).append(
                        (event.step, value.tensor.string_val[0].decode()))
    return found


def train(tmp_path: Path, *options: str, hooks: str = HOOKS, epoch: int = 1):
    trainer = inprocess.make_trainer(tmp_path, hooks, options=["use_wandb=True", *options], epoch=epoch)
    trainer.train()
    return trainer


# -- every upstream key reaches the W&B run --------------------------------------------------------
def test_every_key_reaches_the_offline_run(tmp_path):
    trainer = train(tmp_path, "wandb_run_name=toy-a", "wandb_group=sweep1", "wandb_job_type=train",
                    "wandb_run_id=myrun42", "launch_command=pimm submit configs/toy.py --gpus 4",
                    "wandb_tags=['baseline','cpu']", "log_step_offset=1000", "wandb_project=proj")
    records = wandb_records(trainer.save_path)
    (run,) = of_kind(records, "run")[:1]
    assert (run.run_id, run.display_name, run.run_group, run.job_type, run.project) == (
        "myrun42", "toy-a", "sweep1", "train", "proj")
    assert run.notes == "pimm submit configs/toy.py --gpus 4"
    assert list(run.tags) == ["baseline", "cpu"]
    # The offset applies to W&B steps only: metrics.jsonl keeps the run's own steps.
    rows = history(records)
    losses = {r["step"]: r["train/loss"] for r in inprocess.records(trainer.save_path) if "train/loss" in r}
    assert set(losses) == {1, 2, 3, 4}
    logged = {step for step, row in rows.items() if "train/loss" in row}
    assert 1004 in logged and logged <= {step + 1000 for step in losses}  # dashboards get windows of steps
    assert all(min(losses.values()) <= rows[step]["train/loss"] <= max(losses.values()) for step in logged)
    assert "val/acc" in rows[1004]
    # The checkpoint carries the run id the run really used.
    assert trainer.writer.state_dict()["wandb_run_id"] == "myrun42"


def test_defaults_name_the_run_after_save_path_and_resume_continues_its_id(tmp_path):
    first = train(tmp_path)
    (run,) = of_kind(wandb_records(first.save_path), "run")
    assert run.display_name == "run" and run.run_group == "" and run.notes == ""
    resumed = train(tmp_path, "resume=True", "epoch=2", epoch=2)
    records = wandb_records(resumed.save_path, runs=2)
    assert [r.run_id for r in of_kind(records, "run")] == [run.run_id, run.run_id]  # the same W&B run, continued
    assert max(history(records)) == 8


# -- a failed run's exception reaches the dashboards -------------------------------------------------
def test_a_failure_reaches_tensorboard_text_and_the_wandb_summary(tmp_path):
    hooks = HOOKS.replace("[", '[dict(type="RaiseAtStep", step=3), ', 1)
    trainer = inprocess.make_trainer(tmp_path, hooks, options=["use_wandb=True"], epoch=1)
    with pytest.raises(RuntimeError, match="boom at step 3"):
        trainer.train()
    assert trainer.outcome == "failed"
    ((step, text),) = tensorboard_texts(trainer.save_path)["failure"]
    assert step == 3 and "RuntimeError: boom at step 3" in text and "Traceback" in text
    found = summary(wandb_records(trainer.save_path))
    assert "RuntimeError: boom at step 3" in found["exception"] and found["failed_at_step"] == 3


def test_a_failure_without_wandb_still_reaches_tensorboard(tmp_path):
    hooks = HOOKS.replace("[", '[dict(type="RaiseAtStep", step=2), ', 1)
    trainer = inprocess.make_trainer(tmp_path, hooks, epoch=1)
    with pytest.raises(RuntimeError):
        trainer.train()
    ((step, text),) = tensorboard_texts(trainer.save_path)["failure"]
    assert step == 2 and "boom at step 2" in text
    assert not (trainer.save_path / "wandb").exists()


# -- bad keys and values -------------------------------------------------------------------------------
def test_an_unknown_wandb_key_names_the_nearest_known_one():
    with pytest.raises(ConfigError, match=r"unknown W&B key 'wandb_grup'; did you mean 'wandb_group'\?"):
        check_wandb_keys(ConfigDict(wandb_grup="a"))
    with pytest.raises(ConfigError, match=r"'wandb_runname'; did you mean 'wandb_run_name'"):
        check_wandb_keys(ConfigDict(wandb_runname="a"))
    check_wandb_keys(ConfigDict(wandb_group="a", use_wandb=True, wandb_project="p"))


@pytest.mark.parametrize("option, message", [
    ("wandb_resume=sometimes", "wandb_resume='sometimes' is invalid: it takes one of 'allow', 'must'"),
    ("wandb_run_id=a/b", "a W&B run id takes letters"),
    ("log_step_offset=-1", "log_step_offset=-1 is invalid"),
    ("wandb_tags=3", "wandb_tags=3 is invalid"),
])
def test_bad_values_are_config_errors(tmp_path, option, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        inprocess.make_trainer(tmp_path, HOOKS, options=[option])


def test_the_command_line_refuses_an_unknown_wandb_key_in_one_line(tmp_path):
    config = write_toy_config(tmp_path, tmp_path / "run", "\nwandb_jobtype = 'train'\n")
    result = run_tool("train", config)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert lines == ["error: unknown W&B key 'wandb_jobtype'; did you mean 'wandb_job_type'? (known: "
                     + ", ".join(["wandb_project", "wandb_entity", "wandb_run_name", "wandb_group", "wandb_job_type",
                                  "wandb_tags", "wandb_run_id", "wandb_resume", "launch_command", "log_step_offset",
                                  "use_wandb"]) + ")"]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_init_options_map_every_key():
    cfg = ConfigDict(wandb_project="p", wandb_entity="team", wandb_run_name=None, wandb_group="g", wandb_job_type="j",
                     wandb_tags=["t"], wandb_run_id="id1", wandb_resume="must", launch_command="cmd",
                     log_step_offset=7)
    options = wandb_init_options(cfg, "/x/runs/exp3", config={"a": 1})
    assert options == dict(project="p", entity="team", name="exp3", group="g", job_type="j", tags=["t"], id="id1",
                           resume="must", notes="cmd", config={"a": 1}, step_offset=7)
    bare = wandb_init_options(ConfigDict(wandb_project="p"), "/x/runs/exp3")
    assert bare == dict(project="p", name="exp3", resume="allow", step_offset=0)


def test_a_fork_gets_its_own_run_and_an_explicit_id_wins_over_the_checkpoints(tmp_path):
    first = train(tmp_path / "a", epoch=2)
    (original,) = of_kind(wandb_records(first.save_path), "run")
    chosen = sorted((first.save_path / "checkpoints").iterdir())[0]
    fork = train(tmp_path / "b", f"resume={chosen}", epoch=2)  # another run's checkpoint: a new W&B run
    (forked,) = of_kind(wandb_records(fork.save_path), "run")
    assert forked.run_id != original.run_id and fork.writer.wandb_run_id == forked.run_id
    assert min(history(wandb_records(fork.save_path))) > 4  # its W&B history starts after the checkpoint
    resumed = train(tmp_path / "a", "resume=True", "epoch=3", "wandb_run_id=chosen-by-me", epoch=3)
    runs = of_kind(wandb_records(resumed.save_path, runs=2), "run")
    assert [r.run_id for r in runs] == [original.run_id, "chosen-by-me"]
