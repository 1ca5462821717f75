"""PushToHub against a local stand-in of the Hub API (a ``huggingface_hub``
module whose ``HfApi`` copies uploads into a folder): what is pushed, when,
under which name; offline it is one warning line and the run completes."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from tests.support.inprocess import hook_of, make_trainer

EVAL = 'dict(type="ClsEvaluator", num_classes=2)'


class LocalHub:
    """The part of ``huggingface_hub.HfApi`` PushToHub uses, on a local folder."""

    def __init__(self, root: Path, offline: bool = False):
        self.root, self.offline, self.calls = root, offline, []

    def api(self, token=None):
        hub = self

        class HfApi:
            def __init__(self, token=None):
                hub.calls.append(("init", token))

            def _check(self):
                if hub.offline:
                    raise ConnectionError("Failed to resolve 'huggingface.co'")

            def create_repo(self, repo_id, repo_type, private, exist_ok):
                self._check()
                (hub.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
                hub.calls.append(("create_repo", repo_id, private))

            def upload_file(self, path_or_fileobj, path_in_repo, repo_id, repo_type, revision, commit_message):
                self._check()
                shutil.copy(path_or_fileobj, hub.root / repo_id / path_in_repo)
                hub.calls.append(("upload_file", repo_id, path_in_repo))

            def upload_folder(self, folder_path, repo_id, repo_type, revision, commit_message):
                self._check()
                shutil.copytree(folder_path, hub.root / repo_id, dirs_exist_ok=True)
                hub.calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

            def super_squash_history(self, repo_id, repo_type, branch):
                self._check()
                hub.calls.append(("squash", repo_id))

        return HfApi


@pytest.fixture
def hub(tmp_path, monkeypatch):
    local = LocalHub(tmp_path / "hub")
    module = types.ModuleType("huggingface_hub")
    module.HfApi = local.api()
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    return local


def test_pushes_the_best_weights_at_the_end_byte_identical(tmp_path, hub):
    trainer = make_trainer(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy")]')
    trainer.train()
    pushed = hub.root / "org" / "toy" / "model_best.pth"
    assert pushed.read_bytes() == (tmp_path / "run" / "model" / "model_best.pth").read_bytes()
    assert [c[0] for c in hub.calls if c[0] != "init"] == ["create_repo", "upload_file", "squash"]
    assert hook_of(trainer, "PushToHub").pushed == ["hf://org/toy/model_best.pth"]


def test_periodic_pushes_on_best_and_every_epoch_in_the_background(tmp_path, hub):
    trainer = make_trainer(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", checkpoint="last", '
                                     'name="final.pth", on_best=True, every_n_epochs=1, squash_history=False)]',
                           epoch=2)
    trainer.train()
    hook = hook_of(trainer, "PushToHub")
    # upstream's ``name`` names every upload; on_best pushes each new best, every_n_epochs each epoch's weights
    assert hook.pushed.count("hf://org/toy/final.pth") == len(hook.pushed) >= 3
    assert [c[2] for c in hub.calls if c[0] == "upload_file"] == ["final.pth"] * len(hook.pushed)
    assert not any(c[0] == "squash" for c in hub.calls)
    assert (hub.root / "org" / "toy" / "final.pth").read_bytes() == (
        tmp_path / "run" / "model" / "model_last.pth").read_bytes()


def test_export_folder_when_not_weights_only(tmp_path, hub):
    make_trainer(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", weights_only=False)]').train()
    folders = [c for c in hub.calls if c[0] == "upload_folder"]
    assert folders and "model.safetensors" in folders[0][2]


def test_offline_is_one_line_and_the_run_completes(tmp_path, hub, caplog):
    hub.offline = True
    trainer = make_trainer(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", on_best=True)]')
    trainer.train()
    assert trainer.outcome == "completed"
    lines = [r.getMessage() for r in caplog.records if "PushToHub" in r.getMessage()]
    assert lines and all("offline" in line and "\n" not in line for line in lines)
    assert hook_of(trainer, "PushToHub").pushed == []


def test_bad_repo_and_missing_package_are_one_line(monkeypatch):
    from pimm.engines.registries import HOOKS
    from pimm.utils.errors import ConfigError

    with pytest.raises(ConfigError, match="org/name"):
        HOOKS.build(dict(type="PushToHub", repo_id="no-slash"))
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    with pytest.raises(ConfigError, match="pip install 'pimm\\[hub\\]'"):
        HOOKS.build(dict(type="PushToHub", repo_id="org/toy"))
