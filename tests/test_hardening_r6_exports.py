"""Hardening round 6, models that travel: weight files and export folders are
data (no config.py or custom_imports runs from them), exports never destroy or
shadow what they read, are checked whole before a byte is written, and carry
no secret and no path."""

from __future__ import annotations

import json
import os
import stat
import sys
import textwrap
import types

import pytest
import torch

import pimm
from pimm.utils.errors import CheckpointError, ConfigError, UserError
from tests.support import forkserver
from tests.support.inprocess import make_trainer
from tests.support.run import ROOT, env

pytest.importorskip("safetensors")

HOOKS = '[dict(type="ClsEvaluator", num_classes=2), dict(type="CheckpointSaver", keep_last=1)]'
SECRET = "hf_" + "Q" * 34  # the shape of a Hugging Face token


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished toy run with model_best.pth, model_last.pth, a checkpoint and pimm's run records."""
    directory = tmp_path_factory.mktemp("r6exports")
    from pimm.engines.run.run_dir import write_config

    trainer = make_trainer(directory, HOOKS)
    write_config(trainer.cfg)
    trainer.train()
    return directory / "run"


def _toy_state(hidden: int = 32) -> dict:
    from tests.support.toy import ToyMLP

    return ToyMLP(hidden=hidden).state_dict()


def _booby_trapped_config(folder, marker) -> None:
    """A config.py that would leave ``marker`` behind if anything ran it."""
    (folder / "config.py").write_text(textwrap.dedent(f"""\
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("ran")
        model = dict(type="ToyMLP")
        """))


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    from pimm.cli import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.strip()]


# -- 1. weight files and export folders are data ------------------------------------------------------------------
def test_an_export_folder_with_a_config_py_is_not_run(tmp_path):
    from safetensors.torch import save_file

    folder, marker = tmp_path / "looks-like-an-export", tmp_path / "ran.txt"
    folder.mkdir()
    save_file(_toy_state(), str(folder / "model.safetensors"))
    _booby_trapped_config(folder, marker)
    with pytest.raises(ConfigError, match=r"holds a config.py but no config.json: .*never runs one found beside "
                                          r"weights; if you trust it, pass config_path='.*config.py'"):
        pimm.from_pretrained(folder)
    assert not marker.exists()
    # the explicit opt-in runs it, and loads
    model = pimm.from_pretrained(folder, config_path=folder / "config.py")
    assert marker.exists() and type(model).__name__ == "ToyMLP"


def test_a_weight_file_with_a_config_py_beside_it_is_not_run(tmp_path, capsys):
    marker = tmp_path / "ran.txt"
    torch.save({"state_dict": _toy_state()}, tmp_path / "weights.pth")
    _booby_trapped_config(tmp_path, marker)
    with pytest.raises(ConfigError, match="never runs one found beside weights"):
        pimm.from_pretrained(tmp_path / "weights.pth")
    code, err = _cli(capsys, "export", str(tmp_path / "weights.pth"), str(tmp_path / "out"))
    assert code == 2 and len(err) == 1 and f"pass --config {tmp_path / 'config.py'}" in err[0], err
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="never runs one found beside weights"):
        pimm.save_pretrained(tmp_path / "weights.pth", tmp_path / "out2")
    assert not marker.exists() and not (tmp_path / "out2").exists()


def test_custom_imports_of_an_export_are_never_imported(tmp_path, monkeypatch):
    """The module sits in the current directory (on sys.path, as for ``python -c``)."""
    from safetensors.torch import save_file

    marker = tmp_path / "imported.txt"
    (tmp_path / "evil_plugin_r6.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = tmp_path / "export"
    folder.mkdir()
    save_file(_toy_state(), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"custom_imports": ["evil_plugin_r6"],
                                                    "model": {"type": "ToyMLP"}}))
    model = pimm.from_pretrained(folder)  # a registered type: loads, imports nothing
    assert type(model).__name__ == "ToyMLP"
    (folder / "config.json").write_text(json.dumps({"custom_imports": ["evil_plugin_r6"],
                                                    "model": {"type": "EvilNet"}}))
    with pytest.raises(ConfigError, match=r"model type 'EvilNet' is not registered, and the config names "
                                          r"custom_imports=\['evil_plugin_r6'\], which pimm never imports .*import "
                                          r"evil_plugin_r6"):
        pimm.from_pretrained(folder)
    assert not marker.exists() and "evil_plugin_r6" not in sys.modules


def test_from_pretrained_of_a_run_reads_its_records_as_data(run, tmp_path):
    """A run directory works without running its config.py (resolved_config.json is data)."""
    copy = tmp_path / "copied-run"
    import shutil

    shutil.copytree(run, copy)
    marker = tmp_path / "ran.txt"
    text = (copy / "config.py").read_text()
    (copy / "config.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n" + text)
    model, meta = pimm.from_pretrained(copy, return_metadata=True)
    assert meta["config_file"].endswith("resolved_config.json") and not marker.exists()
    # `pimm export RUN` on a run directory (config.py + pimm's run records) does run it: the documented rule
    from pimm.export.configs import is_run_directory

    assert is_run_directory(copy) and not is_run_directory(tmp_path)


# -- 2. exports never destroy or shadow what they read ------------------------------------------------------------
def test_export_into_the_run_itself_is_refused(run, capsys):
    before = sorted(p.name for p in run.iterdir())
    code, err = _cli(capsys, "export", str(run), str(run))
    assert code == 2 and len(err) == 1 and "an export there would shadow" in err[0], err
    assert sorted(p.name for p in run.iterdir()) == before and not (run / "model.safetensors").exists()
    checkpoint = sorted((run / "checkpoints").glob("step*"))[-1]
    code, err = _cli(capsys, "export", str(run), str(checkpoint))
    assert code == 2 and len(err) == 1 and "inside the checkpoint" in err[0], err
    code, err = _cli(capsys, "export", str(run), str(run / "model"))
    assert code == 2 and len(err) == 1 and "is a run's model/ folder" in err[0], err
    assert not (run / "model" / "model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()
    with pytest.raises(UserError, match="is a run directory"):
        pimm.save_pretrained(torch.nn.Linear(2, 2), run)


def test_convert_checkpoint_never_replaces_its_own_input(run, tmp_path):
    checkpoint = sorted((run / "checkpoints").glob("step*"))[-1]
    common = checkpoint / "common.pth"
    before = common.read_bytes()
    for source in (checkpoint, run):
        done = forkserver.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), str(source), str(common),
                               "--overwrite"], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "is inside the checkpoint" in lines[0], lines
    assert common.read_bytes() == before
    done = forkserver.run([sys.executable, str(ROOT / "tools" / "convert_checkpoint.py"), str(checkpoint),
                           str(tmp_path / "w.pth")], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr


def test_export_destinations_that_are_not_folders_are_one_line(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _cli(capsys, "export", str(run), "")
    assert code == 2 and err == ["error: the export folder is empty (''); give the folder to write, e.g. "
                                 "exports/my-model"]
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "a-file").write_text("mine")
    code, err = _cli(capsys, "export", str(run), str(tmp_path / "a-file"))
    assert code == 2 and len(err) == 1 and "is a file, not a folder" in err[0]
    assert (tmp_path / "a-file").read_text() == "mine"
    code, err = _cli(capsys, "export", str(run), str(tmp_path / "a-file" / "sub"))
    assert code == 2 and len(err) == 1 and "cannot create" in err[0], err
    with pytest.raises(UserError, match="export folder is empty"):
        pimm.save_pretrained(torch.nn.Linear(2, 2), "")


def test_save_pretrained_checks_everything_before_writing(tmp_path):
    from tests.support.toy import ToyMLP

    model = ToyMLP(hidden=32)
    with pytest.raises(UserError, match="model_card must be the card's text"):
        pimm.save_pretrained(model, tmp_path / "a", cfg={"model": {"type": "ToyMLP"}}, model_card=b"# bytes")
    assert not (tmp_path / "a").exists()
    with pytest.raises(CheckpointError, match=r"the weights do not fit the config's model ToyMLP \(shape mismatch: "
                                              r"net.0.weight \(32, 8\) vs model \(7, 8\).*nothing was written"):
        pimm.save_pretrained(model, tmp_path / "b", cfg={"model": {"type": "ToyMLP", "hidden": 7}})
    assert not (tmp_path / "b").exists()
    with pytest.raises(CheckpointError, match=r"not in the model: extra.weight"):
        pimm.save_pretrained({**model.state_dict(), "extra.weight": torch.zeros(1)}, tmp_path / "c",
                             cfg={"model": {"type": "ToyMLP"}})
    assert not (tmp_path / "c").exists()
    out = pimm.save_pretrained(model, tmp_path / "d", cfg={"model": {"type": "ToyMLP"}})
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_export_files_follow_the_umask(tmp_path):
    from tests.support.toy import ToyMLP

    previous = os.umask(0o027)
    try:
        out = pimm.save_pretrained(ToyMLP(), tmp_path / "e", cfg={"model": {"type": "ToyMLP"}})
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes == {"model.safetensors": 0o640, "config.json": 0o640, "README.md": 0o640}


def test_overwrite_leaves_no_stale_weights_of_the_other_format(tmp_path):
    from tests.support.toy import ToyMLP

    first, second = ToyMLP(), ToyMLP()
    pimm.save_pretrained(first, tmp_path / "x", cfg={"model": {"type": "ToyMLP"}})
    pimm.save_pretrained(second, tmp_path / "x", cfg={"model": {"type": "ToyMLP"}}, safe_serialization=False,
                         overwrite=True)
    assert not (tmp_path / "x" / "model.safetensors").exists()
    loaded = pimm.from_pretrained(tmp_path / "x")
    assert torch.equal(loaded.net[0].weight, second.net[0].weight)


@pytest.mark.parametrize("kind", ["dev-zero", "fifo", "not-utf8", "huge"])
def test_model_card_must_be_a_small_utf8_file(run, tmp_path, kind):
    card = {"dev-zero": "/dev/zero", "fifo": str(tmp_path / "card.fifo"), "not-utf8": str(tmp_path / "card.md"),
            "huge": str(tmp_path / "huge.md")}[kind]
    if kind == "fifo":
        os.mkfifo(card)
    elif kind == "not-utf8":
        (tmp_path / "card.md").write_bytes(b"# caf\xe9 card\n")
    elif kind == "huge":
        (tmp_path / "huge.md").write_text("x" * (2 << 20))
    done = forkserver.run([sys.executable, "-m", "pimm.cli", "export", str(run), str(tmp_path / "out"),
                           "--model-card", card], capture_output=True, text=True, env=env(), cwd=ROOT, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    expected = {"dev-zero": "a device, not a regular file", "fifo": "a FIFO, not a regular file",
                "not-utf8": "not UTF-8 text (byte 0xe9 at offset 5)", "huge": "larger than 1024 KiB"}[kind]
    assert done.returncode == 2 and len(lines) == 1 and expected in lines[0], done.stderr
    assert not (tmp_path / "out").exists()


# -- 3. secrets and paths never reach an export ---------------------------------------------------------------------
def test_save_pretrained_redacts_secrets_and_paths_everywhere(tmp_path):
    from tests.support.toy import ToyMLP

    cfg = {"model": {"type": "ToyMLP"}, "token": SECRET,
           "hooks": [{"type": "PushToHub", "repo_id": "org/toy", "token": SECRET, "checkpoint": "model_best"}],
           "load_from": "w.pth",
           "wandb": {"api_key": "k" * 40, "project": "mine"},
           "launch_command": f"WANDB_API_KEY=abc123 python tools/train.py --config-file /home/alice/cfg.py "
                             f"--token {SECRET}",
           "data_root": "data/relative", "weight": "runs/old/model/model_best.pth",
           "pretrained": "hf://org/other", "resume": True, "cache": "file:///scratch/alice/cache",
           "per_path": {"/home/alice/a.h5": 3}, "note": "trained on ~/data/run1 by alice"}
    out = pimm.save_pretrained(ToyMLP(), tmp_path / "s", cfg=cfg, model_card=f"# card\nmy token: token={SECRET}\n")
    config = json.loads((out / "config.json").read_text())
    assert config["token"] == "<redacted>" and config["hooks"][0]["token"] == "<redacted>"
    assert config["wandb"] == {"api_key": "<redacted>", "project": "mine"}
    assert config["launch_command"] == ("WANDB_API_KEY=<redacted> python tools/train.py --config-file <redacted> "
                                        "--token <redacted>")
    assert config["weight"] is None and config["pretrained"] is None and config["resume"] is None
    assert config["load_from"] is None and config["hooks"][0]["checkpoint"] == "model_best"  # a name, not a place
    assert config["data_root"] == "data/relative"
    assert config["cache"] == "<redacted>" and config["per_path"] == {"<redacted>": 3}
    assert config["note"] == "trained on <redacted> by alice"
    everything = b"".join(p.read_bytes() for p in out.iterdir())
    for leak in (SECRET.encode(), b"abc123", b"alice/", b"k" * 40, b"runs/old"):
        assert leak not in everything, leak


def test_push_to_hub_hook_export_carries_no_token(tmp_path, monkeypatch):
    uploaded = {}

    class HfApi:
        def __init__(self, token=None):
            pass

        def create_repo(self, **kwargs):
            pass

        def upload_folder(self, folder_path, **kwargs):
            uploaded.update({p.name: p.read_bytes() for p in __import__("pathlib").Path(folder_path).iterdir()})

        def super_squash_history(self, **kwargs):
            pass

    module = types.ModuleType("huggingface_hub")
    module.HfApi = HfApi
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    make_trainer(tmp_path, f'[dict(type="ClsEvaluator", num_classes=2), dict(type="PushToHub", repo_id="org/toy", '
                           f'weights_only=False, token="{SECRET}")]').train()
    assert "config.json" in uploaded and "model.safetensors" in uploaded
    config = json.loads(uploaded["config.json"])
    push = next(h for h in config["hooks"] if h["type"] == "PushToHub")
    assert push["token"] == "<redacted>" and SECRET.encode() not in b"".join(uploaded.values())
    assert config["save_path"] == "<redacted>" and str(tmp_path).encode() not in uploaded["config.json"]
