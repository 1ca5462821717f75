"""Issue 45 (hardening 6): run records, resume and secrets.

* Secrets (``PushToHub(token=...)``, any secret-keyed value, ``WANDB_API_KEY=``
  in ``PIMM_LAUNCH_COMMAND``) reach no record and no checkpoint; the live run
  still uses them; a resume never replays ``"<redacted>"`` as the secret.
* A run's record holds its config as the hooks received it, so ``--resume
  RUN`` replays every run (``WeightDecayExclusion`` included: both shipped
  pre-trainings were unresumable).
* A config key given on the command line is applied and checked at once:
  ``hooks_override`` (was recorded for the resume to apply), ``_base_``.
* ``hooks.<Type>.<param>=v`` reaches a default hook of that type (SPEC).
* NumPy arrays and scalars and deques in a hook's state round-trip as data.
* ``Config.fromfile`` does not depend on which registries are imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

import pimm.cli
from pimm.engines import HOOKS, HookBase
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError
from tests.support import forkserver
from tests.support.inprocess import hook_of, make_trainer
from tests.support.run import ROOT, env, run_tool, write_toy_config

pimm.cli.register_all()

from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.run.run_dir import AttemptRecord, write_config  # noqa: E402

HUB_TOKEN = "hf_LiveTokenThatMustNeverBeWritten0001"
API_KEY = "sk-api-key-never-written-0002"
WANDB_KEY = "wandb0003neverwritten"
EVAL = 'dict(type="ClsEvaluator", num_classes=2)'


@HOOKS.register_module(force=True)
class KeyedHook(HookBase):
    """Keeps the secret it was built with (what the live run uses)."""

    def __init__(self, api_key=None, password=None):
        self.api_key, self.password = api_key, password


@pytest.fixture
def hub(monkeypatch):
    """A stand-in ``huggingface_hub`` recording the token each API is made with."""
    tokens: list = []

    class HfApi:
        def __init__(self, token=None):
            tokens.append(token)

        def create_repo(self, **kwargs):
            pass

        def upload_file(self, **kwargs):
            pass

        def super_squash_history(self, **kwargs):
            pass

    module = types.ModuleType("huggingface_hub")
    module.HfApi = HfApi
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)
    return tokens


def _every_byte(root: Path) -> bytes:
    return b"\n".join(p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file())


def _toy(tmp_path: Path, hooks: str, extra: str = "") -> Path:
    body = ("epoch = 2\ndata = dict(train=dict(type='ToyDataset', num_samples=64), "
            "val=dict(type='ToyDataset', num_samples=32, seed=1), test=dict(type='ToyDataset', num_samples=32, "
            "seed=2))\ndefault_hooks = dict(checkpoint=dict(save_freq=2))\n" + f"hooks = {hooks}\n" + extra)
    return write_toy_config(tmp_path, tmp_path / "run", body)


# -- secrets -----------------------------------------------------------------------------------------
def test_secrets_reach_no_record_and_no_checkpoint_but_the_live_run_uses_them(tmp_path, hub, monkeypatch):
    monkeypatch.setenv("PIMM_LAUNCH_COMMAND", f"WANDB_API_KEY={WANDB_KEY} python train.py --token {HUB_TOKEN}")
    monkeypatch.setattr(sys, "argv", ["train.py", "--options", f"hooks.KeyedHook.api_key={API_KEY}"])
    config = _toy(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", checkpoint="last", '
                            f'token="{HUB_TOKEN}"), dict(type="KeyedHook")]')
    cfg, hooks = load_config(str(config), [f"hooks.KeyedHook.api_key={API_KEY}"], world_size=1)
    write_config(cfg)  # config.py, resolved_config.json, model_config.json, run_metadata.json
    attempt = AttemptRecord(cfg.save_path, "train", 1)
    attempt.start()
    trainer = build_trainer(cfg, hooks=hooks)
    trainer.train()
    attempt.end(f"bad input: --options hooks.KeyedHook.api_key={API_KEY}", 2)

    assert hook_of(trainer, "KeyedHook").api_key == API_KEY and hub == [HUB_TOKEN]  # the live run has them
    written = _every_byte(tmp_path / "run")  # config.py, the JSON records, attempts.jsonl, checkpoints, logs
    for secret in (HUB_TOKEN, API_KEY, WANDB_KEY):
        assert secret.encode() not in written, secret
    record = (tmp_path / "run" / "config.py").read_text()
    assert "token='<redacted>'" in record and f"hooks.KeyedHook.api_key=<redacted>" in record.splitlines()[1]
    metadata = json.loads((tmp_path / "run" / "run_metadata.json").read_text())
    assert metadata["launch_command"] == "WANDB_API_KEY=<redacted> python train.py --token <redacted>"
    assert metadata["cli_options"] == {"hooks.KeyedHook.api_key": "<redacted>"}
    common = next((tmp_path / "run" / "checkpoints").glob("step*")) / "common.pth"
    flat = torch.load(common, weights_only=True)["meta"]["config_flat"]
    assert flat["hooks.1.token"] == "'<redacted>'"


def test_print_config_shows_no_secret(tmp_path, capsys):
    from pimm.engines.run.launch import main

    config = _toy(tmp_path, f'[{EVAL}, dict(type="KeyedHook", password="pw-0006")]')
    assert main(["--config-file", str(config), "--print-config", "--options",
                 f"hooks.KeyedHook.api_key={API_KEY}"]) == 0
    shown = capsys.readouterr().out
    assert "pw-0006" not in shown and API_KEY not in shown and "password='<redacted>'" in shown


def test_a_resume_never_uses_the_redacted_text_as_the_secret(tmp_path, hub):
    config = _toy(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", checkpoint="last", '
                            f'token="{HUB_TOKEN}"), dict(type="KeyedHook", password="pw-0004")]')
    cfg, hooks = load_config(str(config), [], world_size=1)
    write_config(cfg)
    build_trainer(cfg, hooks=hooks).train()
    record = str(tmp_path / "run" / "config.py")
    run = [f"save_path={tmp_path / 'run'}", "resume=True"]  # what `pimm train --resume RUN` runs
    cfg, _ = load_config(record, run, world_size=1)
    write_config(cfg)
    assert not list((tmp_path / "run").glob("config.prev*"))  # the same run: its record is rewritten in place

    # Not given again: left unset (PushToHub then uses HF_TOKEN or the stored login), and the log says so.
    cfg, hooks = load_config(record, [*run, "epoch=3"], world_size=1)
    assert cfg.__dict__["_resume_note"].count("a secret, never recorded") == 1
    assert "hooks.1.token, hooks.2.password" in cfg.__dict__["_resume_note"]
    trainer = build_trainer(cfg, hooks=hooks)
    assert hook_of(trainer, "KeyedHook").password is None
    trainer.train()
    assert hub[-1] is None  # never the literal "<redacted>"
    write_config(cfg)

    # Given again on the command line: used for this attempt, still never written.
    again = "hooks.PushToHub.token=hf_GivenAgainForThisAttempt0005"
    cfg, hooks = load_config(record, [*run, "epoch=4", again], world_size=1)
    build_trainer(cfg, hooks=hooks).train()
    assert hub[-1] == "hf_GivenAgainForThisAttempt0005"
    write_config(cfg)
    assert b"GivenAgain" not in _every_byte(tmp_path / "run")
    assert "token='<redacted>'" in (tmp_path / "run" / "config.py").read_text()  # still says one was given


# -- the record is the config the hooks received: every run resumes from it ---------------------------
WDE = '[dict(type="ClsEvaluator", num_classes=2), dict(type="WeightDecayExclusion")]'
ONE_CYCLE = "scheduler = dict(type='OneCycleLR', max_lr=[0.01], pct_start=0.2)\n"


def test_a_record_replays_with_the_hooks_changes_made_once(tmp_path):
    cfg, hooks = load_config(str(_toy(tmp_path, WDE, ONE_CYCLE)), [], world_size=1)
    assert cfg.optimizer.no_weight_decay and cfg.scheduler.max_lr == [0.01, 0.01]  # the hook's change, live
    write_config(cfg)
    record = (tmp_path / "run" / "config.py").read_text()
    assert "no_weight_decay" not in record and "max_lr=[0.01]" in record  # as the hooks received it
    build_trainer(cfg, hooks=hooks).train()
    # `pimm train --resume RUN`: before, exit 2 "optimizer.no_weight_decay: optimizer AdamW has no parameter ..."
    resumed, hooks = load_config(str(tmp_path / "run" / "config.py"),
                                 [f"save_path={tmp_path / 'run'}", "resume=True", "epoch=3"], world_size=1)
    assert resumed.scheduler.max_lr == [0.01, 0.01] and resumed.optimizer.no_weight_decay == cfg.optimizer.no_weight_decay
    assert resumed.__dict__["_resume_note"] == "the config differs from the run's record in: epoch: 2 -> 3"
    trainer = build_trainer(resumed, hooks=hooks)
    trainer.train()
    assert trainer.global_step == 12


def test_a_record_written_with_the_hooks_changes_still_resumes(tmp_path):
    """Runs recorded before the record left the hooks' changes out hold them: still resumable, applied once."""
    cfg, hooks = load_config(str(_toy(tmp_path, WDE, ONE_CYCLE)), [], world_size=1)
    build_trainer(cfg, hooks=hooks).train()
    cfg.dump(str(tmp_path / "run" / "config.py"))  # the old record: no_weight_decay, max_lr widened
    resumed, hooks = load_config(str(tmp_path / "run" / "config.py"),
                                 [f"save_path={tmp_path / 'run'}", "resume=True", "epoch=3"], world_size=1)
    assert resumed.scheduler.max_lr == [0.01, 0.01]  # not widened a second time
    build_trainer(resumed, hooks=hooks).train()


# -- command-line keys: applied and checked at once ---------------------------------------------------
@pytest.mark.parametrize("token", ["hooks_override=dict(ClsEvaluator=dict(num_classes=-3))",
                                   "+hooks_override=dict(ClsEvaluator=dict(num_classes=-3))",
                                   "hooks_override.ClsEvaluator.num_classes=-3"])
def test_hooks_override_on_the_command_line_is_checked_at_once(tmp_path, token):
    with pytest.raises(ConfigError, match=r"num_classes=-3 is invalid: it takes an integer in \[1, "):
        load_config(str(_toy(tmp_path, f"[{EVAL}]")), [token], world_size=1)
    assert not (tmp_path / "run").exists()  # refused before the run starts


def test_hooks_override_on_the_command_line_is_applied_at_once_never_recorded(tmp_path):
    options = ["hooks_override=dict(CheckpointSaver=dict(keep_last=5), ClsEvaluator=dict(num_classes=3))"]
    cfg, hooks = load_config(str(_toy(tmp_path, f"[{EVAL}]")), options, world_size=1)
    assert "hooks_override" not in cfg
    assert cfg.default_hooks.checkpoint.keep_last == 5 and cfg.hooks[0].num_classes == 3
    assert hook_of(build_trainer(cfg, hooks=hooks), "ClsEvaluator").num_classes == 3
    write_config(cfg)
    reloaded = Config.fromfile(tmp_path / "run" / "config.py")
    assert "hooks_override" not in reloaded and reloaded.hooks[0].num_classes == 3
    with pytest.raises(ConfigError, match="hook type 'EMAHook' is not in the config's hooks"):
        load_config(str(_toy(tmp_path, f"[{EVAL}]")), ["hooks_override.EMAHook.decay=0.9"], world_size=1)


def test_a_file_only_key_on_the_command_line_is_refused(tmp_path):
    base = tmp_path / "base.py"
    base.write_text("epoch = 9\n")
    with pytest.raises(ConfigError, match="_base_.*cannot be set from the command line"):
        load_config(str(_toy(tmp_path, f"[{EVAL}]")), [f"+_base_={base}"], world_size=1)


# -- hooks.<Type> reaches a default hook of that type -------------------------------------------------
def test_a_type_selector_reaches_the_default_hook_of_that_type(tmp_path):
    config = str(_toy(tmp_path, f"[{EVAL}]"))
    cfg, hooks = load_config(config, ["hooks.CheckpointSaver.save_freq=50"], world_size=1)  # SPEC's own example
    assert cfg.default_hooks.checkpoint.save_freq == 50 and hook_of(build_trainer(cfg, hooks=hooks),
                                                                    "CheckpointSaver").save_freq == 50
    with pytest.raises(ConfigError, match="did you mean 'hooks.CheckpointSaver.save_freq'"):
        load_config(config, ["hooks.CheckpointSaver.save_frq=50"], world_size=1)
    # A type the list has is the list's entry (it replaces the default).
    listed = str(_toy(tmp_path, f'[{EVAL}, dict(type="CheckpointSaver", save_freq=3)]'))
    cfg, _ = load_config(listed, ["hooks.CheckpointSaver.keep_last=7"], world_size=1)
    assert cfg.hooks[1].keep_last == 7 and cfg.default_hooks.checkpoint.keep_last == 2


# -- NumPy values and deques in a hook's state ---------------------------------------------------------
@HOOKS.register_module(force=True)
class NumericStateHook(HookBase):
    def __init__(self):
        self.history, self.best, self.counts = deque(maxlen=3), np.float64(-1.0), np.zeros((2, 3), np.int32)
        self.loaded = None

    def after_step(self):
        step = self.trainer.global_step
        self.history.append(float(step))
        self.best = np.float64(step / 2)
        self.counts[step % 2, step % 3] += 1

    def state_dict(self):
        return {"history": self.history, "best": self.best, "counts": self.counts,
                "nested": [np.arange(3, dtype=np.float16), (np.int64(7), deque([1, 2]))]}

    def load_state_dict(self, state):
        self.loaded = state
        self.history, self.best, self.counts = state["history"], state["best"], state["counts"]


def test_numeric_hook_state_round_trips_as_data(tmp_path, caplog):
    hooks = f'[{EVAL}, dict(type="NumericStateHook")]'
    trainer = make_trainer(tmp_path, hooks, extra="default_hooks = dict(checkpoint=dict(save_freq=2))\n")
    trainer.train()
    assert not [r for r in caplog.records if "trust_checkpoint_code" in r.getMessage()]  # no warning at the saves
    saved = hook_of(trainer, "NumericStateHook").state_dict()
    newest = sorted((tmp_path / "run" / "checkpoints").glob("step*"))[-1]
    for path in newest.glob("*.pth"):
        torch.load(path, weights_only=True)  # plain data

    resumed = make_trainer(tmp_path, hooks, extra="default_hooks = dict(checkpoint=dict(save_freq=2))\n",
                           options=["resume=True"], epoch=3)  # no trust_checkpoint_code
    resumed.restore()
    state = hook_of(resumed, "NumericStateHook").loaded
    assert isinstance(state["history"], deque) and state["history"].maxlen == 3
    assert list(state["history"]) == list(saved["history"])
    assert type(state["best"]) is np.float64 and state["best"] == saved["best"]
    assert state["counts"].dtype == np.int32 and np.array_equal(state["counts"], saved["counts"])
    assert state["nested"][0].dtype == np.float16 and np.array_equal(state["nested"][0], np.arange(3))
    assert type(state["nested"][1][0]) is np.int64 and state["nested"][1][1] == deque([1, 2])


# -- Config.fromfile does not depend on the registries being imported ---------------------------------
def test_fromfile_of_upstream_configs_needs_no_registry(tmp_path):
    configs = sorted(str(p) for p in (ROOT / "tests" / "support" / "upstream_configs").rglob("*.py")
                     if "hooks_override" in p.read_text())
    assert len(configs) >= 6
    script = ("import json, sys\nfrom pimm.utils.config import Config\nout = {}\n"
              "for path in sys.argv[1:]:\n"
              "    try:\n        out[path] = Config.fromfile(path).dump()\n"
              "    except Exception as err:\n        out[path] = f'{type(err).__name__}: {err}'\n"
              "print(json.dumps({'loaded': out, 'registries': 'pimm.engines.registries' in sys.modules}))\n")
    res = subprocess.run([sys.executable, "-c", script, *configs], capture_output=True, text=True, env=env(),
                         cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    bare = json.loads(res.stdout.strip().splitlines()[-1])
    assert bare["registries"] is False  # the registries were not imported when the files were read
    for path in configs:  # the same config as with every registry imported (this process)
        assert bare["loaded"][path] == Config.fromfile(path).dump(), path


# -- every shipped config whose hooks modify the config: killed after a checkpoint, `pimm train --resume RUN`
def _configs_with_modify_config() -> list[str]:
    """Shipped configs whose own ``hooks`` list has a hook that defines ``modify_config``."""
    found = []
    for path in sorted((ROOT / "configs").rglob("*.py")):
        if "_base_" in path.parts or path.name.startswith("_"):
            continue
        cfg = Config.fromfile(path)
        types_ = [HOOKS.get(h["type"]) if isinstance(h["type"], str) else h["type"] for h in cfg.get("hooks") or []]
        if any(t.modify_config is not HookBase.modify_config for t in types_):
            found.append(str(path.relative_to(ROOT / "configs")))
    return found


def _tiny(cfg, lucid: Path, pilarnet) -> list[str]:
    """Options that shrink a shipped config to 4 steps of small events
    (``pilarnet(revision)``: a folder of exported PILArNet files)."""
    options = ["epoch=1", "eval_epoch=1", "batch_size=2", "batch_size_val=2", "num_worker=0"]
    if isinstance(cfg.get("scheduler"), dict) and "warmup_steps" in cfg.scheduler:
        options.append("scheduler.warmup_steps=1")
    if "samples_per_epoch" in cfg.train:
        options.append("train.samples_per_epoch=8")
    for split, entry in cfg.data.items():
        entries = [(f"data.{split}", entry)] if isinstance(entry, dict) else \
            [(f"data.{split}.{i}", e) for i, e in enumerate(entry)] if isinstance(entry, list) else []
        for where, dataset in entries:
            kind = dataset.get("type") if isinstance(dataset, dict) else None
            if kind in ("LArTPCSynthDataset", "CherenkovRingDataset"):
                options.append(f"{where}.num_events={8 if split == 'train' else 2}")
            if kind == "LArTPCSynthDataset":
                options.append(f"{where}.points_per_event=(150,250)")
            if kind == "LUCiDEventSSLDataset":
                options += [f"{where}.data_root={lucid}", f"{where}.holdout_events_per_config=1"]
            if kind == "PILArNetH5Dataset":
                options += [f"{where}.data_root={pilarnet(dataset.get('revision', 'v2'))}",
                            f"{where}.max_len={8 if split == 'train' else 2}"]
    return options


@pytest.fixture(scope="module")
def lucid(tmp_path_factory):
    from pimm.datasets.lucid_generator import generate_lucid

    root = tmp_path_factory.mktemp("lucid")
    for species in ("electron", "muon"):
        generate_lucid(root / species, 5, species, events_per_file=5)
    return root


@pytest.fixture(scope="module")
def pilarnet(tmp_path_factory):
    """PILArNet files of a revision, exported on first use (8 training and 2 validation events)."""
    made: dict[str, Path] = {}

    def folder(revision: str) -> Path:
        if revision not in made:
            root = tmp_path_factory.mktemp(f"pilarnet-{revision}")
            for split, events in (("train", 8), ("val", 2)):
                res = forkserver.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(root),
                                      "--num-events", str(events), "--seed", "5", "--split", split, "--revision",
                                      revision, "--events-per-file", "4"], capture_output=True, text=True,
                                     timeout=300, env=env())
                assert res.returncode == 0, res.stderr
            made[revision] = root
        return made[revision]

    return folder


@pytest.mark.slow
@pytest.mark.parametrize("config", _configs_with_modify_config())
def test_every_shipped_config_with_modify_config_resumes_from_its_record(config, tmp_path, lucid, pilarnet):
    save = tmp_path / "run"
    options = [f"save_path={save}", *_tiny(Config.fromfile(ROOT / "configs" / config), lucid, pilarnet),
               "hooks.CheckpointSaver.save_freq=2", "+custom_imports=['tests.support.toy']",
               "+hooks=[dict(type='KillAtStep', step=3, wait_for_commit=True)]"]
    killed = run_tool("train", ROOT / "configs" / config, *options, timeout=600)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert (save / "checkpoints" / "step000000002-epoch0000" / "COMMITTED").is_file()
    resumed = forkserver.run([sys.executable, "-m", "pimm.cli", "train", "--resume", str(save),
                              "--options", "hooks.KillAtStep.step=-1"],
                             capture_output=True, text=True, env=env(), cwd=ROOT, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step000000002" in (save / "train.log").read_text()
    assert torch.load(save / "model" / "model_last.pth", weights_only=True)["global_step"] == 4


@pytest.mark.slow
def test_the_command_line_writes_no_secret_and_its_resume_runs(tmp_path):
    """``pimm train`` end to end: killed after a checkpoint, ``pimm train --resume RUN``; no secret on disk."""
    config = _toy(tmp_path, f'[{EVAL}, dict(type="PushToHub", repo_id="org/toy", token="{HUB_TOKEN}", '
                            'on_train_end=False), dict(type="KillAtStep", step=3, wait_for_commit=True)]',
                  'custom_imports = ["tests.support.toy"]\n')
    environment = dict(env(), PIMM_LAUNCH_COMMAND=f"WANDB_API_KEY={WANDB_KEY} python tools/train.py")
    pimm_cli = [sys.executable, "-m", "pimm.cli", "train"]
    killed = subprocess.run([*pimm_cli, "--config-file", str(config), "--options", f"+db_password={API_KEY}"],
                            capture_output=True, text=True, env=environment, cwd=ROOT, timeout=300)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = subprocess.run([*pimm_cli, "--resume", str(tmp_path / "run"), "--options", "hooks.KillAtStep.step=-1"],
                             capture_output=True, text=True, env=environment, cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    written = _every_byte(tmp_path / "run")
    for secret in (HUB_TOKEN, API_KEY, WANDB_KEY):
        assert secret.encode() not in written, secret
    log = (tmp_path / "run" / "train.log").read_text()
    assert "hooks.1.token, db_password: a secret, never recorded" in log
    attempts = [json.loads(line) for line in open(tmp_path / "run" / "attempts.jsonl")]
    assert "+db_password=<redacted>" in attempts[0]["command"]
