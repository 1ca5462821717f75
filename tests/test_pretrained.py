"""Models that travel: pimm.save_pretrained / from_pretrained, ``pimm export`` and
``weight=`` taking a run directory, a checkpoint folder, an export folder, a
``.safetensors`` file or ``hf://`` (resolved through a stand-in of
huggingface_hub: these tests use local files only)."""

from __future__ import annotations

import json
import sys
import types

import pytest
import torch

import pimm
from pimm.utils.errors import CheckpointError, ConfigError, UserError
from tests.support import forkserver
from tests.support.inprocess import make_trainer
from tests.support.run import ROOT, env

safetensors = pytest.importorskip("safetensors")  # a core dependency; missing only in an outdated environment

HOOKS = '[dict(type="ClsEvaluator", num_classes=2), dict(type="CheckpointSaver", keep_last=1)]'


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished toy run (2 epochs of 4 steps) with model_best.pth, model_last.pth and a checkpoint."""
    directory = tmp_path_factory.mktemp("pretrained")
    from pimm.engines.run.run_dir import write_config

    trainer = make_trainer(directory, HOOKS)
    write_config(trainer.cfg)  # config.py and resolved_config.json, as the command line writes them
    trainer.train()
    return directory / "run"


def _same(model, state):
    own = model.state_dict()
    return set(own) == set(state) and all(torch.equal(own[k], state[k]) for k in own)


def _best(run):
    return torch.load(run / "model" / "model_best.pth", weights_only=True)["state_dict"]


def test_from_pretrained_takes_a_run_and_its_model_file(run):
    model = pimm.from_pretrained(run)
    assert type(model).__name__ == "ToyMLP" and not model.training
    assert _same(model, _best(run))
    model, meta = pimm.from_pretrained(run / "model" / "model_last.pth", return_metadata=True)
    last = torch.load(run / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert _same(model, last) and meta["config_file"] == str(run / "resolved_config.json")  # data, not config.py


def test_save_pretrained_writes_a_self_describing_folder(run, tmp_path):
    out = pimm.save_pretrained(run, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["type"] == "ToyMLP"
    assert config["save_path"] == "<redacted>" and str(tmp_path) not in (out / "config.json").read_text()
    assert config["weight"] is None and "from_pretrained" in (out / "README.md").read_text()
    model = pimm.from_pretrained(out)
    assert _same(model, _best(run)) and not model.training
    x = torch.randn(5, 8)
    reference = pimm.from_pretrained(run)
    assert torch.equal(model({"x": x})["cls_logits"], reference({"x": x})["cls_logits"])
    with pytest.raises(UserError, match="already holds .*model.safetensors.*overwrite=True"):
        pimm.save_pretrained(run, out)


def test_save_pretrained_from_a_model_with_cfg_and_card(tmp_path):
    import pimm.models  # noqa: F401
    from tests.support.toy import ToyMLP

    model = ToyMLP(hidden=7)
    out = pimm.save_pretrained(model, tmp_path / "m", cfg={"model": {"type": "ToyMLP", "hidden": 7},
                                                           "data_root": "/secret/site/data"},
                               model_card="# my card\n")
    assert (out / "README.md").read_text() == "# my card\n"
    assert json.loads((out / "config.json").read_text())["data_root"] == "<redacted>"
    loaded = pimm.from_pretrained(out)
    assert _same(loaded, model.state_dict())


def test_safetensors_file_prefix_key_mapping_and_strict(tmp_path):
    from safetensors.torch import save_file

    from tests.support.toy import ToyMLP

    model = ToyMLP()
    wrapped = {f"student.backbone.{k}": v.clone() for k, v in model.state_dict().items()}
    wrapped["teacher.head.weight"] = torch.zeros(2)
    save_file(wrapped, str(tmp_path / "pretrain.safetensors"))
    path = tmp_path / "pretrain.safetensors"
    by_prefix = pimm.from_pretrained(path, model_config=dict(type="ToyMLP"), prefix="student.backbone.")
    assert _same(by_prefix, model.state_dict())
    by_map = pimm.from_pretrained(path, model_config=dict(type="ToyMLP"), key_mapping={"student.backbone.": ""})
    assert _same(by_map, model.state_dict())
    with pytest.raises(CheckpointError, match="do not fit ToyMLP .*not in the weights: net.0.weight"):
        pimm.from_pretrained(path, model_config=dict(type="ToyMLP"))
    with pytest.raises(CheckpointError, match="no weight name starts with prefix='nope.'"):
        pimm.from_pretrained(path, model_config=dict(type="ToyMLP"), prefix="nope.")
    partial, meta = pimm.from_pretrained(path, model_config=dict(type="ToyMLP", hidden=32), strict=False,
                                         key_mapping={"student.backbone.net.0.": "net.0."}, return_metadata=True)
    assert torch.equal(partial.net[0].weight, model.net[0].weight) and "net.3.weight" in meta["missing_keys"]
    with pytest.raises(ConfigError, match="no model config .*model_config=dict"):
        pimm.from_pretrained(path)


def test_a_checkpoint_folder_is_a_weight_source(run):
    folder = sorted((run / "checkpoints").glob("step*"))[-1]
    model = pimm.from_pretrained(folder)
    last = torch.load(run / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert _same(model, last)


@pytest.mark.parametrize("form", ["run", "checkpoint", "export", "safetensors"])
def test_weight_option_takes_every_form(run, tmp_path, form):
    export = pimm.save_pretrained(run, tmp_path / "export")
    weight = {"run": run, "checkpoint": sorted((run / "checkpoints").glob("step*"))[-1], "export": export,
              "safetensors": export / "model.safetensors"}[form]
    trainer = make_trainer(tmp_path / "warm", HOOKS, options=[f"weight={weight}"])
    assert trainer.restore()
    expected = torch.load(run / "model" / ("model_last.pth" if form == "checkpoint" else "model_best.pth"),
                          weights_only=True)["state_dict"]
    assert _same(trainer.model_without_ddp, expected)


def test_a_folder_without_weights_is_one_config_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"weight=.*empty: holds no model weights"):
        make_trainer(tmp_path / "x", HOOKS, options=[f"weight={tmp_path / 'empty'}"])


@pytest.fixture
def fake_hub(monkeypatch, run, tmp_path):
    """huggingface_hub stand-in: a 'cache' holding one export; anything else is
    'not cached' while offline."""
    export = pimm.save_pretrained(run, tmp_path / "cache" / "org--toy")
    calls = []

    class LocalEntryNotFoundError(Exception):
        pass

    def snapshot_download(repo, revision=None, allow_patterns=None, **options):
        calls.append(("snapshot", repo, revision))
        if repo == "org/toy":
            return str(export)
        raise LocalEntryNotFoundError("not in the cache and outgoing traffic is disabled")

    def hf_hub_download(repo, filename, revision=None, **options):
        calls.append(("file", repo, filename, revision))
        if repo == "org/toy":
            return str(export / filename)
        raise LocalEntryNotFoundError("not in the cache")

    module = types.SimpleNamespace(snapshot_download=snapshot_download, hf_hub_download=hf_hub_download)
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return calls


def test_hf_names_resolve_through_the_hub_cache(run, fake_hub):
    assert _same(pimm.from_pretrained("hf://org/toy@v1"), _best(run))
    assert _same(pimm.from_pretrained("hf://org/toy/model.safetensors", model_config=dict(type="ToyMLP")),
                 _best(run))
    assert fake_hub == [("snapshot", "org/toy", "v1"), ("file", "org/toy", "model.safetensors", None)]
    with pytest.raises(CheckpointError, match=r"model hf://org/other@main is not in the Hugging Face cache and "
                                              r"the Hub cannot be reached \(HF_HUB_OFFLINE=1\); download it once"):
        pimm.from_pretrained("hf://org/other@main")


def test_hf_without_huggingface_hub_says_which_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError, match=r"needs huggingface_hub: pip install 'pimm\[hub\]'"):
        pimm.from_pretrained("hf://org/toy")
    with pytest.raises(ConfigError, match="not a Hugging Face model name"):
        pimm.from_pretrained("hf://just-a-name")


def test_pimm_export_command(run, tmp_path):
    cmd = [sys.executable, "-m", "pimm.cli", "export", str(run), str(tmp_path / "out")]
    done = forkserver.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _same(pimm.from_pretrained(tmp_path / "out"), _best(run))
    again = forkserver.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert again.returncode == 2
    assert [line for line in again.stderr.splitlines() if line.strip()] == [
        f"error: save_pretrained: {tmp_path / 'out'} already holds model.safetensors, config.json, README.md; "
        "choose another folder or pass overwrite=True"]
    last = forkserver.run([*cmd, "--weights", "last", "--overwrite"], capture_output=True, text=True, env=env(),
                          cwd=ROOT, timeout=300)
    assert last.returncode == 0, last.stderr
    lastw = torch.load(run / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert _same(pimm.from_pretrained(tmp_path / "out"), lastw)


def test_weight_option_takes_hf_names(run, tmp_path, fake_hub):
    trainer = make_trainer(tmp_path / "warm", HOOKS, options=["weight=hf://org/toy"])
    assert trainer.restore() and _same(trainer.model_without_ddp, _best(run))
