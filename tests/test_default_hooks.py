"""Named default hooks (issue 31): the runtime services live in ``default_hooks``
and survive any ``hooks`` list; a type in both is the list's entry; each
default is switched off or re-parameterised by name, in a config or with
``--options``; ``--print-config`` shows the ordered hooks. The runtime base
ships in the package (``_base_ = "pimm://_base_/default_runtime.py"``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from pimm.cli import register_all
from pimm.engines.loop.default_hooks import DEFAULT_HOOKS, assemble_hooks
from pimm.engines.hooks.live_control import AUDIT_FILE
from pimm.engines.run.launch import build_trainer, load_config
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError
from tests.support import forkserver
from tests.support.run import ROOT, env

register_all()

RINGS = ROOT / "configs" / "rings" / "cls-cnn.py"
SHIPPED = sorted(p for p in (ROOT / "configs").rglob("*.py") if "_base_" not in p.parts)
# The ring example, small: 3 steps of 64 events in one epoch, evaluated on 64.
SMALL_RINGS = ["epoch=1", "data.train.num_events=192", "data.val.num_events=64", "data.test.num_events=64"]


def types(cfg) -> list[str]:
    return [entry["type"] for _, entry in assemble_hooks(cfg)]


def loaded(path=RINGS, options=()):
    cfg, hooks = load_config(str(path), list(options), world_size=1, check_save_path=False)
    return cfg, hooks


# ----------------------------------------------------------------------------- the rule


def test_a_shipped_config_with_its_own_hooks_list_keeps_the_runtime_services():
    cfg, hooks = loaded()
    names = [type(h).__name__ for h in hooks]
    assert {"LiveControl", "OnDemandValidation", "CheckpointSaver", "InformationWriter"} <= set(names)
    assert names.count("ClsEvaluator") == 1 and [h.origin for h in hooks if type(h).__name__ == "ClsEvaluator"] == \
        ["hooks[0]"]
    # The config re-parameterised a default by name: its writer logs every 10 steps.
    writer = next(h for h in hooks if type(h).__name__ == "InformationWriter")
    assert writer.origin == "default_hooks.information_writer" and writer.log_frequency == 10


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT / "configs")))
def test_no_shipped_config_lists_a_hook_twice_or_drops_a_runtime_service(path):
    cfg = Config.fromfile(path)
    listed = [h["type"] for h in cfg.get("hooks") or []]
    assert not set(listed) & {d["type"] for d in DEFAULT_HOOKS.values()}, "runtime hooks belong in default_hooks"
    assert len(listed) == len(set(listed))
    assert set(cfg.default_hooks) == set(DEFAULT_HOOKS) and all(v is not None for v in cfg.default_hooks.values())


def test_a_type_in_the_list_and_the_defaults_is_the_lists_entry_with_its_parameters():
    cfg, hooks = loaded(options=["+hooks=[dict(type='CheckpointSaver', save_freq=3, keep_last=7)]"])
    savers = [h for h in hooks if type(h).__name__ == "CheckpointSaver"]
    assert len(savers) == 1 and savers[0].origin == "hooks[1]"
    assert (savers[0].save_freq, savers[0].retention.keep_last) == (3, 7)


def test_an_option_on_a_default_the_list_replaces_is_refused_naming_the_entry():
    with pytest.raises(ConfigError) as info:
        loaded(options=["+hooks=[dict(type='CheckpointSaver', save_freq=3)]", "default_hooks.checkpoint.keep_last=5"])
    assert str(info.value) == (
        "--options default_hooks.checkpoint.keep_last=5 has no effect: the hooks list has its own CheckpointSaver "
        "(hooks[1]), used instead of default_hooks.checkpoint; change that entry (--options "
        "hooks.CheckpointSaver.<key>=...) or drop it from the list")


def test_defaults_are_switched_off_and_re_parameterised_by_name_from_the_command_line():
    cfg, hooks = loaded(options=["default_hooks.live_control=None", "default_hooks.checkpoint.keep_last=5"])
    names = [type(h).__name__ for h in hooks]
    assert "LiveControl" not in names and "OnDemandValidation" in names
    assert next(h for h in hooks if type(h).__name__ == "CheckpointSaver").retention.keep_last == 5
    cfg, hooks = loaded(options=["default_hooks=None"])
    assert [type(h).__name__ for h in hooks] == ["ClsEvaluator"]


def test_a_config_without_base_gets_the_defaults_and_merges_its_own_by_name(tmp_path):
    path = tmp_path / "bare.py"
    path.write_text(Path(RINGS).read_text().replace('_base_ = "../_base_/default_runtime.py"', "")
                    .replace("information_writer=dict(log_frequency=10)",
                             "checkpoint=dict(keep_last=5), live_control=None"))
    cfg = Config.fromfile(path)
    assert "_base_" not in path.read_text() and set(cfg.default_hooks) == {"checkpoint", "live_control"}
    cfg, hooks = loaded(path)
    assert cfg.default_hooks.checkpoint == dict(type="CheckpointSaver", save_freq=None, keep_last=5)
    assert cfg.default_hooks.timer == DEFAULT_HOOKS["timer"]
    assert "LiveControl" not in [type(h).__name__ for h in hooks]


def test_a_bad_name_in_a_config_names_the_closest_default(tmp_path):
    path = tmp_path / "typo.py"
    path.write_text(f"_base_ = {str(RINGS)!r}\ndefault_hooks = dict(live_contrl=None)\n")
    with pytest.raises(ConfigError, match=r"^default_hooks.live_contrl is not a default hook \(did you mean "
                                          r"'live_control'\? the names are checkpoint_loader, .*list any other hook "
                                          r"in `hooks`$"):
        loaded(path)


def test_cli_a_bad_default_hook_name_is_one_line_exit_2(tmp_path):
    out = forkserver.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(RINGS), "--options",
                          f"save_path={tmp_path / 'run'}", "default_hooks.live_contrl=None"],
                         capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: unknown config key 'default_hooks.live_contrl' (did you mean 'default_hooks.live_control'?); "
        "default_hooks names: checkpoint_loader, timer, information_writer, progress_bar, live_control, "
        "on_demand_validation, checkpoint (list any other hook in `hooks`)"]
    assert not (tmp_path / "run").exists()


def test_print_config_shows_the_final_ordered_hooks(tmp_path):
    out = forkserver.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file",
                          str(ROOT / "configs" / "rings" / "cls-cnn-ema-earlystop.py"), "--print-config", "--options",
                          "default_hooks.on_demand_validation=None"],
                         capture_output=True, text=True, env=env(), cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    listing = out.stdout[out.stdout.index("# The hooks this run registers"):].splitlines()[1:]
    rows = [line.split() for line in listing]
    assert [(r[2], r[3], r[4]) for r in rows] == [
        ("VERY_HIGH", "CheckpointLoader", "default_hooks.checkpoint_loader"),
        ("HIGH", "IterationTimer", "default_hooks.timer"),
        ("ABOVE_NORMAL", "EMAHook", "hooks[1]"),
        ("NORMAL", "InformationWriter", "default_hooks.information_writer"),
        ("NORMAL", "ClsEvaluator", "hooks[0]"),
        ("BELOW_NORMAL", "LiveControl", "default_hooks.live_control"),
        ("BELOW_NORMAL", "EarlyStopping", "hooks[2]"),
        ("LOW", "ProgressBar", "default_hooks.progress_bar"),
        ("LOW", "CheckpointSaver", "default_hooks.checkpoint"),
    ]
    # The printed config loads back, the switch included.
    path = tmp_path / "printed.py"
    path.write_text(out.stdout)
    assert Config.fromfile(path).default_hooks.on_demand_validation is None


# ----------------------------------------------------------------------------- done when


def _train_rings_with_control(directory: Path, *options: str) -> Path:
    save_path = directory / "run"
    cfg, hooks = load_config(str(RINGS), [f"save_path={save_path}", *SMALL_RINGS, "enable_tensorboard=False",
                                          "batch_size_val=64", *options], world_size=1)
    save_path.mkdir(parents=True)
    (save_path / "control.json").write_text(json.dumps({"revision": 1, "lr": 1e-4}))
    build_trainer(cfg, hooks=hooks).train()
    return save_path


def _lrs(save_path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in open(save_path / "metrics.jsonl")]
    return {r["step"]: r["train/lr"] for r in records if "train/lr" in r}


def test_the_default_example_applies_control_json_and_switching_live_control_off_removes_it(tmp_path):
    steered = _train_rings_with_control(tmp_path / "on", "default_hooks.live_control.poll_every=1")
    [entry] = [json.loads(line) for line in (steered / AUDIT_FILE).read_text().splitlines()]
    assert (entry["step"], entry["revision"], entry["changes"]) == (1, 1, {"lr": 1e-4})
    lrs = _lrs(steered)
    assert lrs[2] == pytest.approx(1e-4) and lrs[1] != pytest.approx(1e-4)

    plain = _train_rings_with_control(tmp_path / "off", "default_hooks.live_control=None")
    assert not (plain / AUDIT_FILE).exists()
    assert _lrs(plain)[1] == pytest.approx(lrs[1]) and _lrs(plain)[2] != pytest.approx(1e-4)


# ----------------------------------------------------------------------------- the runtime base in the package


def test_a_config_anywhere_names_the_shipped_runtime_base(tmp_path):
    mine = tmp_path / "elsewhere" / "mine.py"
    mine.parent.mkdir()
    mine.write_text('_base_ = "pimm://_base_/default_runtime.py"\nepoch = 3\n')
    cfg = Config.fromfile(mine)
    repo = Config.fromfile(ROOT / "configs" / "_base_" / "default_runtime.py")
    assert cfg.epoch == 3 and {k: v for k, v in cfg.items() if k != "epoch"} == \
        {k: v for k, v in repo.items() if k != "epoch"}
    assert cfg.default_hooks.live_control == dict(type="LiveControl")


@pytest.mark.parametrize("base", ["pimm://_base_/nope.py", "pimm://../engines/runtime.py", "pimm://"])
def test_a_shipped_base_that_does_not_exist_is_one_error_listing_what_ships(tmp_path, base):
    mine = tmp_path / "mine.py"
    mine.write_text(f"_base_ = {base!r}\n")
    with pytest.raises(ConfigError, match=r"pimm ships no such config \(it ships pimm://_base_/default_runtime.py\)"):
        Config.fromfile(mine)
