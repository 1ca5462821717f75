"""Upstream pimm's config keys: ``hooks_override``, ``PIMM_LAUNCH_COMMAND`` and the
run records ``resolved_config.json`` / ``run_metadata.json`` beside ``config.py``
(``eval_epoch``: tests/test_upstream_runtime.py)."""

from __future__ import annotations

import json

import pytest

import pimm.cli
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError
from tests.support import forkserver
from tests.support.run import run_tool, write_toy_config

pimm.cli.register_all()  # the evaluators (ClsEvaluator)

SMALL = """
epoch = 1
data = dict(train=dict(type="ToyDataset", num_samples=32), val=dict(type="ToyDataset", num_samples=16, seed=1))
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=4),
         dict(type="ClsEvaluator", num_classes=2), dict(type="CheckpointSaver", save_freq=5),
         dict(type="CheckpointSaver", save_freq=6)]
"""


def _load(tmp_path, extra, options=()):
    from pimm.engines.run.launch import load_config

    path = write_toy_config(tmp_path, tmp_path / "run", SMALL + extra)
    return load_config(str(path), list(options), world_size=1)[0]


def _of_type(cfg, name):
    return [h for h in cfg.hooks if h["type"] == name]


def test_hooks_override_sets_options_on_every_hook_of_the_type(tmp_path):
    cfg = _load(tmp_path, 'hooks_override = dict(CheckpointSaver=dict(keep_last=3), '
                          'InformationWriter={"log_frequency": 2})\n')
    assert [h["keep_last"] for h in _of_type(cfg, "CheckpointSaver")] == [3, 3]
    assert [h["save_freq"] for h in _of_type(cfg, "CheckpointSaver")] == [5, 6]
    assert _of_type(cfg, "InformationWriter")[0]["log_frequency"] == 2
    assert "hooks_override" not in cfg and "\nhooks_override =" not in cfg.dump()


def test_the_command_line_wins_over_hooks_override(tmp_path):
    cfg = _load(tmp_path, "hooks_override = dict(InformationWriter=dict(log_frequency=2))\n",
                ["hooks.InformationWriter.log_frequency=7"])
    assert _of_type(cfg, "InformationWriter")[0]["log_frequency"] == 7


def test_hooks_override_reaches_a_base_configs_hooks(tmp_path):
    base = write_toy_config(tmp_path, tmp_path / "run", SMALL)
    child = tmp_path / "child.py"
    child.write_text(f"_base_ = {str(base)!r}\nhooks_override = dict(CheckpointSaver=dict(keep_best=False))\n")
    cfg = Config.fromfile(child)
    assert [h["keep_best"] for h in _of_type(cfg, "CheckpointSaver")] == [False, False]


def test_hooks_override_reaches_a_hook_only_the_runtime_base_provides(tmp_path):
    # cls-cnn's own hooks list holds no CheckpointSaver or LiveControl: they are named defaults.
    child = tmp_path / "child.py"
    child.write_text("_base_ = 'pimm://_base_/default_runtime.py'\nhooks = [dict(type='CheckpointSaver', save_freq=9)]\n"
                     "hooks_override = dict(CheckpointSaver=dict(keep_last=4), LiveControl=dict(poll_every=7))\n")
    cfg = Config.fromfile(child)
    assert _of_type(cfg, "CheckpointSaver") == [dict(type="CheckpointSaver", save_freq=9, keep_last=4)]
    assert cfg.default_hooks["live_control"]["poll_every"] == 7
    assert cfg.default_hooks["checkpoint"]["keep_last"] == 2  # replaced by the list's saver: left alone


@pytest.mark.parametrize("extra, message", [
    ("hooks_override = dict(CheckpointSaver=dict(save_frq=3))\n",
     r"hooks_override: .*no parameter 'save_frq'.*did you mean '.*save_freq'"),
    ("hooks_override = dict(CheckpointSaver=3)\n", r"hooks_override\['CheckpointSaver'\] must be a dict"),
    ("hooks_override = [1]\n", r"hooks_override must be a dict\(HookType=dict\(option=value\)\)"),
])
def test_bad_hooks_override_is_one_error_naming_it(tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        _load(tmp_path, extra)


def test_a_type_not_in_the_hooks_is_one_line_and_exit_2(tmp_path):
    path = write_toy_config(tmp_path, tmp_path / "run", SMALL + "hooks_override = dict(WandbNamer=dict(extra='x'))\n")
    done = run_tool("train", path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["error: hooks_override: hook type 'WandbNamer' is not in the config's hooks (CheckpointLoader, "
                     "CheckpointSaver, ClsEvaluator, InformationWriter, IterationTimer, LiveControl, OnDemandValidation, "
                     "ProgressBar); add dict(type='WandbNamer') to hooks or drop it from hooks_override"], done.stderr
    assert not (tmp_path / "run").exists()


def test_launch_command_and_run_records_beside_config_py(tmp_path, monkeypatch):
    monkeypatch.setenv("PIMM_LAUNCH_COMMAND", "pimm submit --config-file toy.py --time 4:00:00")
    path = write_toy_config(tmp_path, tmp_path / "run", SMALL)
    done = run_tool("train", path, "optimizer.lr=0.02")
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    config = Config.fromfile(run / "config.py")
    assert config.launch_command == "pimm submit --config-file toy.py --time 4:00:00"
    resolved = json.loads((run / "resolved_config.json").read_text())
    assert resolved["launch_command"] == config.launch_command
    assert resolved["optimizer"] == {"type": "AdamW", "lr": 0.02} and resolved["save_path"] == str(run)
    assert json.loads((run / "model_config.json").read_text()) == resolved["model"]
    metadata = json.loads((run / "run_metadata.json").read_text())
    assert set(metadata) == {"created_at", "launch_command", "command", "cwd", "host", "config_file",
                             "config_file_abs", "cli_options", "cli_option_keys", "save_path", "resume", "git"}
    assert metadata["launch_command"] == config.launch_command
    assert metadata["cli_options"] == {"optimizer.lr": 0.02} and metadata["cli_option_keys"] == ["optimizer.lr"]
    assert metadata["config_file_abs"] == str(path.resolve()) and metadata["resume"] is False
    assert metadata["command"][0].endswith("train.py")
    # A resume (launched another way) of the same config keeps the run's metadata (how it was started);
    # config.py, rewritten in place, holds the command of this attempt (the one to run again), as upstream.
    monkeypatch.setenv("PIMM_LAUNCH_COMMAND", "pimm train --resume run")
    done = run_tool("train", path, "optimizer.lr=0.02", "resume=True")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "run_metadata.json").read_text()) == metadata
    assert Config.fromfile(run / "config.py").launch_command == "pimm train --resume run"
    assert json.loads((run / "resolved_config.json").read_text())["resume"] is True
    assert not list(run.glob("*.prev*"))
    # Another config (a longer run) sets the records aside with config.py, never overwrites them.
    done = run_tool("train", path, "optimizer.lr=0.02", "resume=True", "epoch=2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((run / "resolved_config.json").read_text())["epoch"] == 2
    assert json.loads((run / "run_metadata.prev1.json").read_text()) == metadata
    assert sorted(p.name for p in run.glob("*.prev*")) == ["config.prev1.py", "model_config.prev1.json",
                                                            "resolved_config.prev1.json", "run_metadata.prev1.json"]


def test_pimm_submit_exports_its_command_to_the_job(tmp_path):
    import subprocess
    import sys

    from tests.support.run import ROOT, env

    pytest.importorskip("submitit")
    path = write_toy_config(tmp_path, tmp_path / "run", SMALL)
    argv = ["--config-file", str(path), "--time", "01:00:00", "--dry-run", "--options", "optimizer.lr=0.02"]
    done = forkserver.run([sys.executable, "-m", "pimm.tools.submit", *argv], capture_output=True, text=True,
                          env=env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    exports = [line for line in done.stdout.splitlines() if line.startswith("export PIMM_LAUNCH_COMMAND=")]
    assert len(exports) == 1
    echoed = subprocess.run(["bash", "-c", exports[0] + '; printf %s "$PIMM_LAUNCH_COMMAND"'], capture_output=True,
                            text=True).stdout
    assert echoed.split() == ["pimm", "submit", *argv]
