"""A resume runs its own run: the config file + the options the run was
started with (recorded in config.py) + the options given now.

The trap (issue 22, issue 21 defect 15): a run started with ``epoch=4`` and
resumed by a command line without it was rebuilt for 3 epochs: it silently
trained another run or died on a raw ``ValueError: Tried to step ...``. A
refused resume (issue 21 defect 8) must change nothing on disk.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pimm.cli
from tests.support import forkserver
from tests.support.run import ROOT, env, run_tool, train_losses, write_toy_config

pimm.cli.register_all()  # the evaluators the toy config names

KILL = "\nhooks = hooks + [dict(type='KillAtStep', step=10**9, signal_name='SIGKILL')]\n"


def _snapshot(save: Path) -> dict[str, str]:
    """Every file of the run directory but the logs, by content."""
    return {str(p.relative_to(save)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(save.rglob("*")) if p.is_file() and p.name not in ("train.log", "attempts.jsonl")}


def _pimm(*args: str) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-m", "pimm.cli", *args], capture_output=True, text=True, timeout=300,
                          env=env(), cwd=ROOT)


@pytest.mark.slow
def test_a_resume_without_the_start_overrides_continues_the_same_run(tmp_path):
    # The uninterrupted run: 4 epochs of 10 steps (the file says 3).
    (tmp_path / "ref").mkdir()
    ref = run_tool("train", write_toy_config(tmp_path / "ref", tmp_path / "ref-run", KILL), "epoch=4", "optimizer.lr=0.02")
    assert ref.returncode == 0, ref.stderr
    # The same, killed at step 15, then resumed by a command line without epoch and lr.
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, KILL)
    killed = run_tool("train", cfg, "epoch=4", "optimizer.lr=0.02", "hooks.KillAtStep.step=15")
    assert killed.returncode == -9
    header = (save / "config.py").read_text().splitlines()[1]
    assert header.startswith("# options: ") and "epoch=4" in header
    resumed = run_tool("train", cfg, "resume=True")
    assert resumed.returncode == 0, resumed.stderr
    log = (save / "train.log").read_text()
    assert "the options this run was started with, applied again: epoch=4 optimizer.lr=0.02" in log
    # Same steps and losses as the uninterrupted run: the same run, not a 3-epoch one with another lr.
    assert train_losses(save) == train_losses(tmp_path / "ref-run")
    assert max(step for step, _ in train_losses(save)) == 40
    record = (save / "config.py").read_text()
    assert "epoch = 4" in record and "lr=0.02" in record


@pytest.mark.slow
def test_a_schedule_that_no_longer_fits_is_refused_and_nothing_changes(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save)
    assert run_tool("train", cfg, "epoch=4").returncode == 0
    before = _snapshot(save)
    # Before the fix: config.py rewritten (the original moved to config.prev1.py), then a raw ValueError, exit 1.
    refused = run_tool("train", cfg, "resume=True", "epoch=2")
    assert refused.returncode == 2, refused.stderr
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and refused.stderr.strip().splitlines()[-1] == errors[0]
    line = errors[0]
    assert line.startswith("error: resume: the LR schedule now lasts 20")
    assert "already at step 40" in line and "Traceback" not in refused.stderr
    assert _snapshot(save) == before
    # Without the override it is the finished run: nothing to train, exit 0.
    again = run_tool("train", cfg, "resume=True")
    assert again.returncode == 0, again.stderr
    assert "Nothing to train: 4 of 4 epochs" in (save / "train.log").read_text()


@pytest.mark.slow
def test_resume_from_the_run_directory_alone(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save)
    assert run_tool("train", cfg, "epoch=1", "optimizer.lr=0.02").returncode == 0
    cfg.unlink()  # the config file is gone: the run directory is enough
    moved = tmp_path / "moved"
    save.rename(moved)
    out = _pimm("train", "--resume", str(moved), "--options", "epoch=2")
    assert out.returncode == 0, out.stderr
    assert max(step for step, _ in train_losses(moved)) == 20
    text = (moved / "config.py").read_text()
    assert f"save_path = {str(moved)!r}" in text and "lr=0.02" in text and "epoch = 2" in text
    assert "epoch: 1 -> 2" in (moved / "train.log").read_text()
    missing = _pimm("train", "--resume", str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: --resume") and "does not exist" in missing.stderr


def test_print_config_prints_the_resolved_config_and_writes_nothing(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save)
    out = _pimm("train", "--config-file", str(cfg), "--print-config", "--options", "epoch=7", "enable_amp=false",
                "+hooks=[dict(type='EMAHook', decay=0.9)]")
    assert out.returncode == 0, out.stderr
    assert "epoch = 7" in out.stdout and "enable_amp = False" in out.stdout
    assert "dict(type='EMAHook', decay=0.9)" in out.stdout and "dict(type='CheckpointSaver'" in out.stdout
    assert not save.exists()
    # What it prints is a loadable config equal to what the run would use.
    from pimm.utils.config import Config

    printed = tmp_path / "printed.py"
    printed.write_text(out.stdout)
    assert Config.fromfile(printed)["epoch"] == 7


def recorded_run(tmp_path: Path, options: list[str]) -> tuple[Path, Path]:
    """A toy config and a run directory whose config.py records a start with ``options``
    (as tools/train.py writes it), without training: ``(save_path, config file)``."""
    from pimm.engines.run.launch import load_config

    save = tmp_path / "run"
    save.mkdir()
    cfg_file = write_toy_config(tmp_path, save)
    first, _ = load_config(str(cfg_file), options, world_size=1)
    first.dump(save / "config.py")
    return save, cfg_file


def test_a_record_without_the_options_header_is_itself_the_base(tmp_path):
    """Runs recorded before the header existed: the record wins over the file."""
    from pimm.engines.run.launch import load_config

    save, cfg_file = recorded_run(tmp_path, ["epoch=5", "optimizer.lr=0.02"])
    lines = (save / "config.py").read_text().splitlines(keepends=True)
    assert lines[1].startswith("# options: ")
    (save / "config.py").write_text("".join(lines[:1] + lines[2:]))
    resumed, _ = load_config(str(cfg_file), ["resume=True", "batch_size=8"], world_size=1)
    assert resumed.epoch == 5 and resumed.optimizer.lr == 0.02 and resumed.batch_size == 8
    note = resumed.__dict__["_resume_note"]
    assert "kept from the run's record" in note and "batch_size: 16 -> 8" in note


def test_the_recorded_options_survive_repeated_resumes_without_piling_up(tmp_path):
    from pimm.engines.run.launch import load_config

    _, cfg_file = recorded_run(tmp_path, ["epoch=5", "+hooks=[dict(type='EMAHook')]"])
    again, _ = load_config(str(cfg_file), ["resume=True", "+hooks=[dict(type='EMAHook')]", "epoch=6"], world_size=1)
    assert [h["type"] for h in again.hooks].count("EMAHook") == 1  # the same append is not doubled
    assert again.epoch == 6
    header = json.loads(again.dump().splitlines()[1].removeprefix("# options: "))
    assert "epoch=5" not in header and "epoch=6" in header


def test_hook_options_of_one_attempt_are_not_applied_again(tmp_path):
    """A fault injection or a log frequency given to one attempt is not part of the run."""
    from pimm.engines.run.launch import load_config

    _, cfg_file = recorded_run(tmp_path, ["epoch=5", "hooks.InformationWriter.log_frequency=1"])
    again, _ = load_config(str(cfg_file), ["resume=True"], world_size=1)
    assert again.epoch == 5
    assert next(h for h in again.hooks if h["type"] == "InformationWriter")["log_frequency"] == 4
