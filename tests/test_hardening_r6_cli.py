"""Hardening round 6 (issue 45): the command line's messages, weight-loading
messages and upstream's module paths.

* Ctrl-C in the first seconds of ``pimm train/test/export/plot`` or
  ``tools/test.py`` is one line and exit 130, not the traceback of an import;
* ``pimm test RUN`` refuses a run that is training (its run lock is held);
* ``pimm --help`` and ``pimm torchrun --help`` name their commands properly;
* ``--config-file pimm://...`` is the config shipped in the package;
* a damaged DCP shard or GRPO rollout record, a text file as weights, a
  checkpoint folder that holds code and non-finite weights are each one line
  naming the file and what to do;
* upstream's ``pimm.utils.warnings``, ``pimm.engines.defaults``,
  ``pimm.models.modules``, ``pimm.utils.events``, ``pimm.utils.checkpoints``,
  ``pimm.engines.launch.launch``, ``pimm.utils.config.DictAction`` and
  ``pimm.utils.logger.get_root_logger`` work as upstream's code uses them.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import pytest
import torch

import pimm.cli
from pimm.utils.errors import CheckpointError, ConfigError, UserError
from tests.support import forkserver
from tests.support.run import ROOT, env, non_log_lines, run_tool, write_toy_config

pimm.cli.register_all()


def one_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr[-3000:]
    lines = non_log_lines(result.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def run_pimm(*args: str, cwd: Path = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return forkserver.run([sys.executable, "-m", "pimm.cli", *args], env=env(), cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished toy run (model_best.pth, model_last.pth, checkpoints, config.py)."""
    root = tmp_path_factory.mktemp("r6run")
    done = run_tool("train", write_toy_config(root, root / "run", "epoch = 1\n"))
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


# -- 1. Ctrl-C while a command is still importing --------------------------------------------------
INTERRUPTS = [
    ("pimm train", ["-m", "pimm.cli", "train", "--config-file", "cfg.py"], "pimm.models"),
    ("pimm test", ["-m", "pimm.cli", "test", "RUN"], "pimm.models"),
    ("pimm export", ["-m", "pimm.cli", "export", "RUN", "OUT"], "torch"),
    ("pimm plot", ["-m", "pimm.cli", "plot", "RUN"], "pimm.cli.plot"),
    ("tools/test.py importing pimm.cli", [str(ROOT / "tools" / "test.py"), "RUN"], "pimm.cli"),
    ("tools/test.py importing the models", [str(ROOT / "tools" / "test.py"), "RUN"], "pimm.models"),
    ("tools/train.py", [str(ROOT / "tools" / "train.py"), "--config-file", "cfg.py"], "pimm.models"),
]


def interrupted_while_importing(tmp_path: Path, command: list[str], module: str, debug: bool = False):
    """Run ``command`` and press Ctrl-C while it imports ``module`` (tests/support/early_interrupt.py)."""
    marker = tmp_path / "importing"
    environ = env()
    if debug:
        environ["PIMM_DEBUG"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.early_interrupt", module, str(marker), "--",
                             *command], cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, f"{module} was never imported"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


@pytest.mark.parametrize("name, command, module", INTERRUPTS, ids=[case[0] for case in INTERRUPTS])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(tmp_path, name, command, module):
    code, out, err = interrupted_while_importing(tmp_path, command, module)
    assert code == 130, (code, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "interrupted" in lines[0], err


def test_ctrl_c_during_start_up_shows_the_traceback_with_pimm_debug(tmp_path):
    code, _, err = interrupted_while_importing(tmp_path, ["-m", "pimm.cli", "train", "--config-file", "x.py"],
                                               "pimm.models", debug=True)
    assert code == 130 and "Traceback" in err and "KeyboardInterrupt" in err
    assert err.rstrip().splitlines()[-1] == "error: interrupted during start-up (nothing was written)"


# -- 2. pimm test on a run that is training -------------------------------------------------------
def test_pimm_test_refuses_a_run_whose_lock_a_live_process_holds(finished):
    from pimm.utils.run_lock import RunLock

    before = (finished / "test_metrics.json").exists()
    with RunLock(finished, command="python tools/train.py --config-file toy_cfg.py"):
        line = one_error(run_pimm("test", str(finished)))
    assert f"pid {os.getpid()}" in line and "in use by another run" in line
    assert "python tools/train.py --config-file toy_cfg.py" in line and "save_path=DIR" in line
    assert (finished / "test_metrics.json").exists() == before  # nothing was written into the live run
    # Once the run has ended, the same command tests it.
    done = run_pimm("test", str(finished))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (finished / "test_metrics.json").is_file()


# -- 3. pimm --help and pimm torchrun --help ----------------------------------------------------------
def test_help_keeps_a_space_between_every_command_and_its_text(capsys):
    assert pimm.cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for name, (text, _) in pimm.cli.COMMANDS.items():
        line = next(line for line in out.splitlines() if line.strip().startswith(name) and text in line)
        assert line.split(text)[0].rstrip() == f"  {name}" and line.split(text)[0].endswith("  "), line
    assert "torchruntorchrun" not in out


def test_torchrun_help_names_pimm_torchrun(capsys):
    from pimm.distributed import torchrun

    with pytest.raises(SystemExit) as done:
        torchrun.main(["--help"])
    assert done.value.code == 0
    assert capsys.readouterr().out.startswith("usage: pimm torchrun ")


# -- 4. --config-file pimm://... -------------------------------------------------------------------
def test_config_file_in_the_package_scheme_is_the_shipped_config(tmp_path, monkeypatch):
    from pimm.utils.config import PACKAGE_CONFIGS, Config

    monkeypatch.chdir(tmp_path)
    cfg = Config.fromfile("pimm://_base_/default_runtime.py")
    assert cfg.filename == str(PACKAGE_CONFIGS / "_base_" / "default_runtime.py")
    assert "save_path" in cfg
    with pytest.raises(ConfigError, match=r"config file 'pimm://nope.py': pimm ships no such config \(it ships "
                                          r"pimm://_base_/default_runtime.py\)"):
        Config.fromfile("pimm://nope.py")


def test_config_file_in_the_package_scheme_on_the_command_line(tmp_path):
    done = run_pimm("train", "--config-file", "pimm://_base_/default_runtime.py", "--print-config", cwd=tmp_path)
    line = one_error(done)
    assert "not found" not in line and "pimm:/" not in line
    assert "the config has no `model`" in line  # the shipped runtime base was read: it defines no model


# -- 5. weight-loading messages --------------------------------------------------------------------
def _read(path: Path) -> dict:
    from pimm.engines.state.weight_source import read_state_dict, resolve_weight_source

    return read_state_dict(resolve_weight_source(str(path)))


@pytest.mark.parametrize("content, said", [
    (b"this is the README, not weights\n", "it is a text file"),
    (b"", "the file is empty"),
    (bytes(range(256)) * 4, "it is not a file written by torch.save"),
    ("truncated", "its archive is damaged"),
])
def test_a_weight_file_that_is_not_one_is_named_without_torchs_advice(tmp_path, content, said):
    path = tmp_path / "model_best.pth"
    if content == "truncated":
        blob = io.BytesIO()
        torch.save({"w": torch.ones(64)}, blob)
        content = blob.getvalue()[:200]
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as caught:
        _read(path)
    message = str(caught.value)
    assert f"weight={str(path)!r} is not a torch weight file: {said}" in message
    assert "weights_only" not in message and "\n" not in message


def test_pimm_test_with_a_text_file_as_model_best_is_one_line(finished, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    (run / "model" / "model_best.pth").write_text("<html>a download error page, not weights</html>\n")
    line = one_error(run_pimm("test", str(run)))
    assert "model_best.pth' is not a torch weight file: it is a text file" in line
    assert "weights_only" not in line


class Payload:
    """Unpickling it creates ``marker``: code a folder could run if it were unpickled."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _commit(checkpoint: Path, **manifest) -> None:
    files = {p.relative_to(checkpoint).as_posix(): {"size": p.stat().st_size, "crc32": zlib.crc32(p.read_bytes())}
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != "COMMITTED"}
    (checkpoint / "COMMITTED").write_text(json.dumps({"global_step": 1, "epoch": 1, "world_size": 1, **manifest,
                                                      "files": files}))


def test_weight_folder_that_holds_code_advises_what_exists(tmp_path):
    checkpoint = tmp_path / "run" / "checkpoints" / "step000000001-epoch0001"
    checkpoint.mkdir(parents=True)
    marker = tmp_path / "marker"
    torch.save({"model": {"w": torch.ones(2)}, "extra": Payload(marker)}, checkpoint / "common.pth")
    _commit(checkpoint)
    with pytest.raises(CheckpointError) as caught:
        _read(checkpoint)
    message = str(caught.value)
    assert not marker.exists()
    assert "refers to builtins.open" in message or "refers to io.open" in message
    assert f"python tools/convert_checkpoint.py {checkpoint} OUT.pth --trust-checkpoint-code" in message
    assert "give weight=OUT.pth" in message and "--trust-checkpoint-code loads it" not in message


def _sharded_checkpoint(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    checkpoint = tmp_path / "run" / "checkpoints" / "step000000001-epoch0001"
    checkpoint.mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"weight": torch.arange(6.0).reshape(2, 3)}, "optimizer": {"lr": 0.5}},
                 storage_writer=dcp.FileSystemWriter(str(checkpoint / "sharded")))
    _commit(checkpoint, sharded=["model", "optimizer"])
    return checkpoint


def test_a_damaged_dcp_shard_is_named(tmp_path):
    checkpoint = _sharded_checkpoint(tmp_path)
    assert torch.equal(_read(checkpoint)["weight"], torch.arange(6.0).reshape(2, 3))
    shard = next((checkpoint / "sharded").glob("*.distcp"))
    shard.write_bytes(b"overwritten" * 8)
    # The manifest shows the damage: named before anything is read.
    with pytest.raises(CheckpointError, match=rf"{checkpoint.name} cannot be used: sharded/{shard.name} has 88 "
                                              "bytes"):
        _read(checkpoint)
    # Damage the manifest agrees with (written so, or re-signed): the shard itself is named.
    _commit(checkpoint, sharded=["model", "optimizer"])
    with pytest.raises(CheckpointError) as caught:
        _read(checkpoint)
    assert f"{shard} is damaged: this shard of the sharded checkpoint cannot be read" in str(caught.value)
    assert "earlier checkpoint" in str(caught.value) and "\n" not in str(caught.value)


def test_a_damaged_dcp_shard_on_resume_is_a_checkpoint_error(tmp_path):
    """The resume path reads shards through sharded_loader: DCP's CheckpointException (a BaseException that
    would pass every handler up to a traceback) becomes one CheckpointError naming the file."""
    from pimm.engines.state.sharded import saved_structure, sharded_loader

    checkpoint = _sharded_checkpoint(tmp_path)
    shard = next((checkpoint / "sharded").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    template = {"weight": torch.empty(2, 3)}
    with pytest.raises(CheckpointError, match=rf"{shard} is damaged"):
        sharded_loader(checkpoint / "sharded", "model")(template)
    (checkpoint / "sharded" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointError, match=r"\.metadata is damaged: Distributed Checkpoint's metadata cannot be "
                                              r"read"):
        saved_structure(checkpoint / "sharded")


def test_weight_with_a_damaged_dcp_shard_is_one_line_at_the_command_line(tmp_path):
    checkpoint = _sharded_checkpoint(tmp_path)
    shard = next((checkpoint / "sharded").glob("*.distcp"))
    shard.write_bytes(b"overwritten" * 8)
    _commit(checkpoint, sharded=["model", "optimizer"])
    config = write_toy_config(tmp_path, tmp_path / "new", "epoch = 1\n")
    line = one_error(run_tool("train", config, f"weight={checkpoint}"))
    assert f"{shard} is damaged" in line


class _Context:
    def __init__(self, path: Path):
        self.path = path


@pytest.mark.parametrize("state, said", [
    ({"rollout": {"__object__": "tests.support.upstream_grpo:Trajectory", "attrs": 5}, "history": []},
     "the object record at rollout is damaged"),
    ({"rollout": {"a": [{"__object__": 7, "attrs": {}}]}, "history": []},
     "the object record at rollout['a'][0] is damaged"),
    ({"rollout": None}, "it needs 'rollout' and 'history'"),
    ({"rollout": None, "history": 5}, "'history' must be a list"),
    ({"rollout": None, "history": [], "all_nan_run": "x"}, "'history' must be a list"),
])
def test_a_damaged_grpo_rollout_record_names_the_file(tmp_path, state, said):
    from pimm.engines.trainers.grpo_state import RolloutCache

    cache = RolloutCache(torch.device("cpu"), "update", trusted_modules=("tests.support.upstream_grpo",))
    with pytest.raises(CheckpointError) as caught:
        cache.restore(dict(state, step_per="update"), _Context(tmp_path / "step000000004-epoch0001"))
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'step000000004-epoch0001' / 'rank00000.pth'}: ")
    assert said in message and "resume from an earlier checkpoint" in message


def test_a_sound_grpo_rollout_record_still_restores():
    from pimm.engines.trainers.grpo_state import RolloutCache

    saved = RolloutCache(torch.device("cpu"), "update")
    saved.start({"reward": torch.ones(3), "steps": [torch.zeros(2)]}, batch=None)
    restored = RolloutCache(torch.device("cpu"), "update")
    restored.restore(saved.state_dict(), _Context(Path("unused")))
    assert torch.equal(restored.rollout["reward"], torch.ones(3)) and len(restored.rollout["steps"]) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, bad):
    from pimm.engines.state import load_weights
    from tests.support.toy import ToyMLP

    model = ToyMLP()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith("weight"))
    state[name] = torch.full_like(state[name], bad)
    torch.save({"state_dict": state}, tmp_path / "diverged.pth")
    fresh = ToyMLP()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"weight='.*diverged.pth': {name} holds {state[name].numel()} NaN "
                                              rf"or infinite value\(s\) of {state[name].numel()}"):
        load_weights(fresh, tmp_path / "diverged.pth")
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing was loaded
    with pytest.raises(CheckpointError, match=rf"{name} holds"):
        pimm.from_pretrained(tmp_path / "diverged.pth", model_config=dict(type="ToyMLP"))


# -- 6. upstream's module paths --------------------------------------------------------------------
def test_pimm_utils_warnings():
    from pimm.utils.warnings import (PimmDeprecationWarning, PimmWarning, deprecated, deprecation_message, warn,
                                     warn_deprecated, warn_once)

    assert issubclass(PimmWarning, UserWarning) and issubclass(PimmDeprecationWarning, FutureWarning)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn("plain")
        warn_once("only once", key="r6")
        warn_once("only once", key="r6")
        warn_deprecated("old_thing", "new_thing", "0.9")

        @deprecated(replacement="new_function", remove_in="0.9")
        def old_function(x):
            return x + 1

        assert old_function(1) == 2
    assert [str(w.message) for w in caught] == [
        "plain", "only once", deprecation_message("old_thing", "new_thing", "0.9"),
        "test_pimm_utils_warnings.<locals>.old_function is deprecated; use new_function instead. It will be removed "
        "in pimm 0.9."]
    assert [w.category for w in caught] == [PimmWarning, PimmWarning, PimmDeprecationWarning, PimmDeprecationWarning]
    assert all(w.filename == __file__ for w in caught)  # attributed to the caller, never to pimm's module


def test_pimm_utils_config_dict_action():
    from pimm.utils.config import DictAction

    parser = argparse.ArgumentParser()
    parser.add_argument("--options", nargs="+", action=DictAction)
    args = parser.parse_args(["--options", "epoch=3", "optimizer.lr=0.01", "enable_amp=False", "name=abc",
                              "grid=0.1,0.2", "pairs=[(1,2),(3,4)]", "--options", "names='[a, b]'"])
    assert args.options == {"epoch": 3, "optimizer.lr": 0.01, "enable_amp": False, "name": "abc",
                            "grid": [0.1, 0.2], "pairs": [(1, 2), (3, 4)], "names": ["a", "b"]}


def test_pimm_utils_logger_get_root_logger(tmp_path):
    from pimm.utils.logger import get_root_logger, setup_logger

    log = tmp_path / "plugin.log"
    logger = get_root_logger(log_file=log)
    try:
        assert logger is logging.getLogger("pimm") and get_root_logger() is logger
        logger.info("from a plug-in")
        assert "from a plug-in" in log.read_text()
    finally:
        setup_logger(None)  # the console handler only: the file is closed


def test_pimm_utils_events_storage():
    from pimm.utils.events import AverageMeter, EventStorage, HistoryBuffer, JSONWriter, get_event_storage

    with pytest.raises(RuntimeError, match="outside a `with EventStorage"):
        get_event_storage()
    with EventStorage(start_iter=10) as storage:
        assert get_event_storage() is storage
        storage.put_scalar("loss", torch.tensor(2.0))
        storage.put_scalar("loss", 4.0, n=3)
        with storage.name_scope("val"):
            storage.put_scalar("miou", 0.5, smoothing_hint=True)
        storage.step()
        storage.put_scalar("val/miou", 0.7, smoothing_hint=True)
        history = storage.history("loss")
        assert isinstance(history, AverageMeter) and (history.val, history.count, history.avg) == (4.0, 4, 3.5)
        assert storage.latest() == {"loss": (4.0, 10), "val/miou": (0.7, 11)}
        assert storage.latest_with_smoothing_hint(2)["val/miou"] == (pytest.approx(0.6), 11)
        with pytest.raises(ValueError, match="takes a number"):
            storage.put_scalar("loss", "high")
        storage.reset_histories()
        assert storage.history("loss").count == 0
    buffer = HistoryBuffer(max_length=2)
    for value in (1.0, 2.0, 6.0):
        buffer.update(value)
    assert buffer.values() == [(2.0, 1), (6.0, 2)] and buffer.global_avg() == 3.0 and buffer.median(2) == 4.0
    assert JSONWriter  # written through below


def test_pimm_utils_events_json_writer(tmp_path):
    from pimm.utils.events import EventStorage, JSONWriter

    with EventStorage() as storage:
        writer = JSONWriter(tmp_path / "metrics.json")
        storage.put_scalar("loss", 1.5)
        writer.write()
        storage.step()
        storage.put_scalar("loss", 0.5)
        writer.write()
        writer.close()
    assert [json.loads(line) for line in (tmp_path / "metrics.json").read_text().splitlines()] == [
        {"iteration": 0, "loss": 1.5}, {"iteration": 1, "loss": 0.5}]


def test_pimm_models_modules_point_sequential_runs_on_a_point():
    from torch import nn

    from pimm.engines.hooks.base import HookBase
    from pimm.models.modules import PointModel, PointModule, PointSequential
    from pimm.models.utils.structure import Point

    class Double(PointModule):
        def forward(self, point):
            point["feat"] = point["feat"] * 2
            return point

    torch.manual_seed(0)
    sequence = PointSequential(nn.Linear(3, 4), Double())
    sequence.add(nn.ReLU(), name="act")
    point = Point(coord=torch.rand(5, 3), feat=torch.rand(5, 3), offset=torch.tensor([5]))
    expected = torch.relu(sequence[0](point["feat"]) * 2)
    assert torch.equal(sequence(point)["feat"], expected) and len(sequence) == 3
    assert list(dict(sequence.named_children())) == ["0", "1", "act"]
    assert issubclass(PointModel, PointModule) and issubclass(PointModel, HookBase)


def test_pimm_utils_checkpoints(tmp_path, finished):
    import pimm.utils.checkpoints as checkpoints
    from pimm.engines.state import upstream_checkpoints

    assert checkpoints is upstream_checkpoints  # the alias, no file at upstream's path
    model_file = checkpoints.load_weight_state(finished / "model" / "model_last.pth", map_location="cpu")
    weights = checkpoints.checkpoint_model_state_dict(model_file)
    assert set(weights) == set(torch.load(finished / "model" / "model_last.pth")["state_dict"])
    (newest,) = sorted((finished / "checkpoints").glob("step*"))[-1:]
    common = checkpoints.load_weight_state(newest / "common.pth", map_location="cpu")
    assert set(checkpoints.checkpoint_model_state_dict(common)) == set(weights)
    checkpoints.save_model_weights_file(common, tmp_path / "weights.pth")
    assert set(torch.load(tmp_path / "weights.pth", weights_only=True)["state_dict"]) == set(weights)
    assert checkpoints.parse_hf_uri("hf://org/name@v1/model.safetensors") == ("org/name", "v1", "model.safetensors")
    assert checkpoints.resolve_remote_weight("/local/w.pth") == "/local/w.pth"
    assert checkpoints.exported_weights_file(tmp_path) is None
    # Read as data, unlike upstream's weights_only=False: a file that holds code is refused, and not run.
    marker = tmp_path / "marker"
    torch.save({"state_dict": weights, "extra": Payload(marker)}, tmp_path / "poisoned.pth")
    with pytest.raises(UserError, match="refers to"):
        checkpoints.load_weight_state(tmp_path / "poisoned.pth", map_location="cpu")
    assert not marker.exists()


def test_pimm_engines_defaults_and_launch_train_an_upstream_style_script(tmp_path):
    """Upstream's tools/train.py shape, unchanged, trains a pimm run (one process)."""
    from pimm.engines.defaults import default_argument_parser, default_config_parser, default_setup
    from pimm.engines.launch import launch
    from pimm.engines.train import TRAINERS

    config = write_toy_config(tmp_path, tmp_path / "run", "epoch = 1\n")
    args = default_argument_parser().parse_args(["--config-file", str(config), "--options", "epoch=1",
                                                 "batch_size=8", "optimizer.lr=0.02"])
    cfg = default_config_parser(args.config_file, args.options)
    assert (cfg.batch_size, cfg.optimizer.lr) == (8, 0.02)
    # The options are recorded in config.py, so that a resume applies them again.
    assert Path(tmp_path / "run" / "config.py").read_text().splitlines()[1] == \
        '# options: ["epoch=1", "batch_size=8", "optimizer.lr=0.02"]'

    ran = []

    def main_worker(cfg):
        cfg = default_setup(cfg)
        assert (cfg.batch_size_per_gpu, cfg.num_worker_per_gpu, cfg.batch_size_val_per_gpu) == (8, 0, 1)
        trainer = TRAINERS.build(dict(type=cfg.train.type, cfg=cfg))
        trainer.train()
        ran.append(trainer.global_step)

    launch(main_worker, num_gpus_per_machine=args.num_gpus, num_machines=args.num_machines,
           machine_rank=args.machine_rank, dist_url=args.dist_url, cfg=(cfg,))
    assert ran == [20]  # 160 samples, batch 8, one epoch
    assert (tmp_path / "run" / "model" / "model_last.pth").is_file()
    # A second fresh start into the same save_path is refused, not written over.
    with pytest.raises(ConfigError, match="already holds"):
        default_config_parser(args.config_file, args.options)
    with pytest.raises(UserError, match=r"launch\(num_gpus_per_machine=0\)"):
        launch(main_worker, 0)
    with pytest.raises(UserError, match=r"dist_url='auto'\) picks a port on this machine only"):
        launch(main_worker, 2, num_machines=2)


def test_upstream_paths_import_first_in_a_fresh_interpreter():
    code = ("from pimm.utils.warnings import PimmWarning; from pimm.engines.defaults import default_config_parser; "
            "from pimm.models.modules import PointModule, PointSequential; "
            "from pimm.utils.events import EventStorage; from pimm.utils.checkpoints import load_weight_state; "
            "from pimm.engines.launch import launch; from pimm.utils.config import DictAction; "
            "from pimm.utils.logger import get_root_logger; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.slow
def test_launch_starts_every_rank_of_a_process_group(tmp_path):
    """Two local processes (gloo on CPU) meet, all-reduce and each calls main_func(*cfg)."""
    script = tmp_path / "two_ranks.py"
    script.write_text(
        "import os, sys\n"
        "import torch, torch.distributed as dist\n"
        "from pimm.engines.launch import launch\n"
        "from pimm.utils import comm\n"
        "def work(out_dir):\n"
        "    total = torch.tensor([comm.get_rank() + 1.0])\n"
        "    dist.all_reduce(total)\n"
        "    with open(os.path.join(out_dir, f'rank{comm.get_rank()}'), 'w') as fh:\n"
        "        fh.write(f'{comm.get_world_size()} {os.environ[\"LOCAL_RANK\"]} {total.item()}')\n"
        "if __name__ == '__main__':\n"
        "    launch(work, 2, cfg=(sys.argv[1],))\n")
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2 0 3.0", "2 1 3.0"]
