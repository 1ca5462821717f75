"""``--options`` overrides: grammar, value parsing, key paths and errors,
and parameters of registry-built dicts as defined keys (with the real registries)."""

import gc
import os
import sys
from pathlib import Path

import pytest

import pimm.datasets  # noqa: F401  (the real registries, filled, as tools/train.py has them)
import pimm.evaluation  # noqa: F401
import pimm.models  # noqa: F401
from pimm.utils.config import Config, ConfigDict
from pimm.utils.config_options import parse_options, parse_value
from pimm.utils.config_slots import check_registry_dicts, slot_registry
from pimm.utils.errors import ConfigError, RegistryError
from pimm.utils.registry import Registry
from tests.support import forkserver

ROOT = Path(__file__).resolve().parents[1]
RINGS = ROOT / "configs" / "rings" / "cls-cnn.py"


def make_cfg() -> Config:
    return Config({
        "optimizer": {"type": "AdamW", "lr": 0.001, "betas": (0.9, 0.999)},
        "model": {"type": "Net", "backbone": {"depth": 4}},
        "hooks": [
            {"type": "IterTimer"},
            {"type": "CheckpointSaver", "save_freq": 1},
            {"type": "Logger", "interval": 10},
            {"type": "CheckpointSaver", "save_freq": 5},
        ],
        "class_weights": {0: 1.0, 1: 2.0},
        "save_path": "exp/default",
        "resume": False,
    })


@pytest.mark.parametrize("text, expected", [
    ("1", 1), ("-3", -3), ("0.25", 0.25), ("-1.5e-4", -1.5e-4), ("1_000", 1000),
    ("True", True), ("False", False), ("None", None),
    ("'quoted str'", "quoted str"), ('"7"', "7"),
    ("[1, 2.5, 'a']", [1, 2.5, "a"]), ("(1, 2)", (1, 2)), ("(3,)", (3,)), ("()", ()),
    ("{'a': 1, 'b': [None]}", {"a": 1, "b": [None]}),
    ("exp/run1", "exp/run1"), ("bfloat16", "bfloat16"), ("a=b", "a=b"), ("", ""),
])
def test_parse_value_literals_and_bare_words(text, expected):
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text", [
    "[1, 2", "(1,", "{'a': 1", "'unterminated", '"also',
    "__import__('os').system('echo hi')", "dict(a=f(1))", "dict(1, a=1)", "dict(**x)", "print(1)",
    "os.getcwd()", "[1, f(2)]",
])
def test_parse_value_rejects_malformed_literals_and_calls(text):
    with pytest.raises(ConfigError, match="bad value in --options lr=.*never run as code"):
        parse_value(text, "lr")


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("false", False), ("null", None), ("none", None), ("[true, null]", [True, None]),
    ("{'a': false}", {"a": False}), ("dict(a=1, b=true)", {"a": 1, "b": True}),
    ('[dict(type="EMAHook", decay=0.9)]', [{"type": "EMAHook", "decay": 0.9}]),
])
def test_parse_value_takes_yaml_words_and_literal_dict_calls(text, expected):
    """What YAML/Hydra users type: read as the Python literal, never run."""
    assert parse_value(text, "k") == expected


def test_other_spellings_of_yaml_words_say_what_to_write():
    with pytest.raises(ConfigError, match="write True"):
        parse_value("TRUE", "resume")
    assert parse_value('"true"') == "true"  # quoted: the string


def test_plus_on_a_list_appends():
    cfg = make_cfg()
    before = [h["type"] for h in cfg.hooks]
    cfg.merge_from_options(['+hooks=[dict(type="EMAHook", decay=0.9)]'])
    assert [h["type"] for h in cfg.hooks] == [*before, "EMAHook"] and cfg.hooks[-1]["decay"] == 0.9


def test_values_are_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    cfg = make_cfg()
    with pytest.raises(ConfigError):
        cfg.merge_from_options([f"save_path=__import__('pathlib').Path({str(marker)!r}).touch()"])
    assert not marker.exists()


def test_parse_options_returns_key_value_and_new_flag():
    assert parse_options(["a.b=1", "+c.d=x", "e=[1]"]) == [("a.b", 1, False), ("c.d", "x", True), ("e", [1], False)]
    assert parse_options(None) == []


@pytest.mark.parametrize("token", ["optimizer.lr", "=3", "+=3", "optimizer..lr=1", ".lr=1", "lr.=1", "2]"])
def test_bad_tokens_quote_the_token_and_show_expected_form(token):
    with pytest.raises(ConfigError) as info:
        parse_options([token])
    assert repr(token) in str(info.value) and "expected key=value" in str(info.value)


def test_dotted_keys_and_literal_types():
    cfg = make_cfg()
    cfg.merge_from_options([
        "optimizer.lr=0.01", "model.backbone.depth=-2", "resume=True", "save_path=exp/run1",
        "optimizer.betas=(0.8, 0.9)", "model.backbone={'depth': 3, 'width': None}",
    ])
    assert cfg.optimizer.lr == 0.01 and cfg.model.backbone.width is None
    assert cfg.resume is True and cfg.save_path == "exp/run1" and cfg.optimizer.betas == (0.8, 0.9)
    assert isinstance(cfg.model.backbone, ConfigDict) and cfg.model.backbone.depth == 3


def test_later_options_override_earlier_ones():
    cfg = make_cfg()
    cfg.merge_from_options(["optimizer.lr=1", "optimizer.lr=2"])
    assert cfg.optimizer.lr == 2


def test_list_indices():
    cfg = make_cfg()
    cfg.merge_from_options(["hooks.1.save_freq=50", "hooks.-1.save_freq=7", "hooks.2={'type': 'ProgressBar'}"])
    assert [h.get("save_freq") for h in cfg.hooks] == [None, 50, None, 7]
    assert isinstance(cfg.hooks[2], ConfigDict) and cfg.hooks[2].type == "ProgressBar"


def test_hook_type_key_sets_every_hook_of_that_type_only():
    cfg = make_cfg()
    cfg.merge_from_options(["hooks.CheckpointSaver.save_freq=50", "+hooks.CheckpointSaver.keep=[1, 2]"])
    assert cfg.hooks[1].save_freq == 50 and cfg.hooks[3].save_freq == 50
    assert cfg.hooks[2] == {"type": "Logger", "interval": 10} and cfg.hooks[0] == {"type": "IterTimer"}
    cfg.hooks[1].keep.append(3)  # every hook got its own copy
    assert cfg.hooks[3].keep == [1, 2]


def test_hook_type_key_adds_key_to_entries_of_that_type_missing_it():
    cfg = make_cfg()
    del cfg.hooks[3]["save_freq"]
    cfg.merge_from_options(["hooks.CheckpointSaver.save_freq=9"])
    assert cfg.hooks[1].save_freq == 9 and cfg.hooks[3].save_freq == 9


def test_hook_type_key_matches_class_types():
    class CheckpointSaver:
        pass

    cfg = Config({"hooks": [{"type": CheckpointSaver, "save_freq": 1}]})
    cfg.merge_from_options(["hooks.CheckpointSaver.save_freq=3"])
    assert cfg.hooks[0].save_freq == 3


def test_integer_dict_keys():
    cfg = make_cfg()
    cfg.merge_from_options(["class_weights.1=0.5"])
    assert cfg.class_weights == {0: 1.0, 1: 0.5}


def test_plus_creates_new_keys_and_parents():
    cfg = make_cfg()
    cfg.merge_from_options(["+wandb_project=pimm", "+data.train.root=/data", "+optimizer.lr=0.5",
                            "+hooks.Logger.log_dir=logs"])
    assert cfg.wandb_project == "pimm" and cfg.data.train.root == "/data"
    assert isinstance(cfg.data.train, ConfigDict)
    assert cfg.optimizer.lr == 0.5 and cfg.hooks[2].log_dir == "logs"


def test_unknown_key_suggests_nearest_existing_key():
    cfg = make_cfg()
    with pytest.raises(ConfigError) as info:
        cfg.merge_from_options(["optimzer.lr=0.01"])
    assert str(info.value) == (
        "unknown config key 'optimzer.lr' (did you mean 'optimizer.lr'?); write +optimzer.lr=... to add a new key"
    )
    with pytest.raises(ConfigError, match="hook CheckpointSaver has no parameter 'save_frq' "
                                          "\\(did you mean 'hooks.CheckpointSaver.save_freq'\\?\\)"):
        cfg.merge_from_options(["hooks.CheckpointSaver.save_frq=2"])
    with pytest.raises(ConfigError, match="did you mean 'model.backbone.depth'"):
        cfg.merge_from_options(["model.backbone.dept=2"])
    assert cfg == make_cfg()


def test_unknown_hook_type_names_types_present():
    with pytest.raises(ConfigError, match="no entry of 'hooks' has type 'Checkpointsaver'; "
                                          "types present: CheckpointSaver, IterTimer, Logger"):
        make_cfg().merge_from_options(["hooks.Checkpointsaver.save_freq=2"])


def test_index_out_of_range_names_key_and_length():
    with pytest.raises(ConfigError, match="hooks.7.save_freq: index 7 is out of range for 'hooks' "
                                          "\\(a list of length 4\\)"):
        make_cfg().merge_from_options(["hooks.7.save_freq=1"])
    with pytest.raises(ConfigError, match="out of range"):
        make_cfg().merge_from_options(["+hooks.4.save_freq=1"])  # + never grows lists


def test_cannot_walk_into_a_scalar_or_assign_into_a_tuple():
    with pytest.raises(ConfigError, match="'optimizer.lr' is 0.001 \\(float\\), not a dict or list"):
        make_cfg().merge_from_options(["optimizer.lr.x=1"])
    with pytest.raises(ConfigError, match="'optimizer.betas' is a tuple"):
        make_cfg().merge_from_options(["optimizer.betas.0=0.5"])


def test_all_tokens_are_parsed_before_any_is_applied():
    cfg = make_cfg()
    with pytest.raises(ConfigError):
        cfg.merge_from_options(["optimizer.lr=0.5", "model.depth=[1,"])
    assert cfg.optimizer.lr == 0.001


def test_options_survive_dump_round_trip(tmp_path):
    cfg = make_cfg()
    cfg.merge_from_options(["hooks.CheckpointSaver.save_freq=50", "+extra=(1, 'a')"])
    cfg.dump(tmp_path / "config.py")
    assert Config.fromfile(tmp_path / "config.py") == cfg


# ----------------------------------------------------------------------------- registry-built dicts


def rings() -> Config:
    return Config.fromfile(RINGS)


def listing_rings() -> Config:
    """The ring config with a hooks list of its own that names the runtime hooks
    too, as every upstream config does (hook-type selectors act on the list)."""
    cfg = rings()
    cfg.hooks = [ConfigDict(type="CheckpointLoader"), ConfigDict(type="IterationTimer", warmup_iter=2),
                 *cfg.hooks, ConfigDict(type="CheckpointSaver", keep_last=2)]
    return cfg


def saver(cfg):
    return next(h for h in cfg.hooks if h.type == "CheckpointSaver")


def test_hook_parameter_missing_from_the_config_is_a_defined_key():
    cfg = listing_rings()
    assert "save_freq" not in saver(cfg) and "save_every_seconds" not in saver(cfg)
    cfg.merge_from_options(["hooks.CheckpointSaver.save_freq=50", "hooks.CheckpointSaver.save_every_seconds=60.0",
                            "hooks.CheckpointSaver.priority=90", "hooks.0.key_map=[['a', 'b']]"])
    assert saver(cfg).save_freq == 50 and saver(cfg).save_every_seconds == 60.0 and saver(cfg).priority == 90
    assert cfg.hooks[0] == {"type": "CheckpointLoader", "key_map": [["a", "b"]]}
    assert all("save_freq" not in h for h in cfg.hooks if h.type != "CheckpointSaver")


def test_misspelt_hook_parameter_names_the_nearest_real_one():
    cfg = listing_rings()
    with pytest.raises(ConfigError) as info:
        cfg.merge_from_options(["hooks.CheckpointSaver.save_frequency=50"])
    assert str(info.value) == ("--options hooks.CheckpointSaver.save_frequency: hook CheckpointSaver has no "
                               "parameter 'save_frequency' (did you mean 'hooks.CheckpointSaver.save_freq'?)")
    with pytest.raises(ConfigError, match="no parameter 'zzz' \\(it takes: save_freq, save_every_seconds, keep_last, "
                                          "keep_best, keep_every, keep_all, time_check_every, async_write, keep, "
                                          "evaluator_every_n_steps, save_every_minutes, priority\\)"):
        cfg.merge_from_options(["hooks.-1.zzz=1"])
    assert cfg == listing_rings()


@pytest.mark.parametrize("option, path, value", [
    ("model.dropout=0.2", ("model", "dropout"), 0.2),
    ("optimizer.amsgrad=True", ("optimizer", "amsgrad"), True),
    ("scheduler.anneal_strategy=linear", ("scheduler", "anneal_strategy"), "linear"),
    ("data.train.seed=7", ("data", "train", "seed"), 7),
    ("data.val.with_time=False", ("data", "val", "with_time"), False),
    ("train.find_unused_parameters=True", ("train", "find_unused_parameters"), True),
])
def test_constructor_parameters_of_model_optimizer_data_and_trainer_are_defined(option, path, value):
    cfg = rings()
    node = cfg
    for key in path[:-1]:
        node = node[key]
    assert path[-1] not in node
    cfg.merge_from_options([option])
    assert node[path[-1]] == value


@pytest.mark.parametrize("option, message", [
    ("model.widht=8", "--options model.widht: model RingCNN has no parameter 'widht' (did you mean 'model.width'?)"),
    ("optimizer.weight_decy=0", "--options optimizer.weight_decy: optimizer AdamW has no parameter 'weight_decy' "
                                "(did you mean 'optimizer.weight_decay'?)"),
    ("data.train.sede=1", "--options data.train.sede: dataset CherenkovRingDataset has no parameter 'sede' "
                          "(did you mean 'data.train.seed'?)"),
    ("optimizer.params=[]", "--options optimizer.params: 'params' of optimizer AdamW is filled in by the engine; "
                            "it is not a config key"),
    ("scheduler.total_steps=10", "--options scheduler.total_steps: 'total_steps' of scheduler OneCycleLR is filled "
                                 "in by the engine; it is not a config key"),
    ("train.cfg=1", "--options train.cfg: 'cfg' of trainer ImageClassTrainer is filled in by the engine; "
                    "it is not a config key"),
])
def test_misspelt_or_engine_filled_parameters_are_refused(option, message):
    with pytest.raises(ConfigError) as info:
        rings().merge_from_options([option])
    assert str(info.value) == message


def test_plus_still_forces_a_key_into_a_registry_dict():
    cfg = listing_rings()
    cfg.merge_from_options(["+model.widht=8", "+hooks.CheckpointSaver.note=x"])
    assert cfg.model.widht == 8 and saver(cfg).note == "x"


def test_missing_dict_on_the_way_is_not_created_without_plus():
    with pytest.raises(ConfigError, match="unknown config key 'model.backbone.depth' .*; write \\+model.backbone.depth"):
        rings().merge_from_options(["model.backbone.depth=3"])


def test_constructor_taking_kwargs_accepts_any_key():
    cfg = rings()
    cfg.merge_from_options(["train.type=MultiDatasetTrainer", "train.anything_goes=1"])  # (cfg, ..., **options)
    assert cfg.train == {"type": "MultiDatasetTrainer", "anything_goes": 1}


def test_type_change_validates_later_keys_against_the_new_type():
    cfg = rings()
    cfg.merge_from_options(["optimizer.type=SGD", "optimizer.momentum=0.9", "optimizer.nesterov=True"])
    assert cfg.optimizer == {"type": "SGD", "lr": 3e-3, "weight_decay": 0.01, "momentum": 0.9, "nesterov": True}
    rings().merge_from_options(["optimizer.amsgrad=True"])  # an AdamW parameter ...
    with pytest.raises(ConfigError, match="optimizer SGD has no parameter 'amsgrad'"):
        rings().merge_from_options(["optimizer.type=SGD", "optimizer.amsgrad=True"])  # ... not an SGD one


def test_type_change_refuses_keys_the_new_type_does_not_take():
    cfg = rings()
    cfg.merge_from_options(["+optimizer.betas=(0.9, 0.99)"])
    with pytest.raises(ConfigError) as info:
        cfg.merge_from_options(["optimizer.type=SGD"])
    message = str(info.value)
    assert message.startswith("--options optimizer.type: optimizer.betas: optimizer SGD has no parameter "
                              "'betas' (it takes: lr, momentum, dampening, weight_decay, nesterov")
    assert message.endswith("; to switch type, give the whole dict: optimizer=\"{'type': ..., ...}\"")


@pytest.mark.parametrize("options, message", [
    (["model.type=RingCN"], "--options model.type: unknown model type 'RingCN'; did you mean 'RingCNN'"),
    (["hooks=[{'type': 'ProgresBar'}]"], "--options hooks: hooks.0: unknown hook type 'ProgresBar'; "
                                         "did you mean 'ProgressBar'?"),
])
def test_unknown_type_set_by_an_option_names_the_closest_registered(options, message):
    with pytest.raises(RegistryError) as info:
        rings().merge_from_options(options)
    assert str(info.value).startswith(message)


def test_unknown_type_in_the_config_names_the_closest_when_a_parameter_is_set():
    cfg = rings()
    cfg.model.type = "RingCN"
    cfg.merge_from_options(["model.width=4"])  # listed in the config: no need to know the type
    with pytest.raises(RegistryError, match="^--options model.dropout: unknown model type 'RingCN'; "
                                            "did you mean 'RingCNN'[,?]"):
        cfg.merge_from_options(["model.dropout=0.1"])


def test_dict_outside_the_known_slots_is_looked_up_in_every_registry():
    kind = Registry("gadget-options-test")

    @kind.register_module()
    class Gadget:
        def __init__(self, size=1, colour="red"):
            pass

    cfg = Config({"extra": {"type": "Gadget"}, "other": {"type": "NotRegisteredAnywhere"}})
    cfg.merge_from_options(["extra.colour=blue"])
    assert cfg.extra.colour == "blue"
    with pytest.raises(ConfigError, match="gadget-options-test Gadget has no parameter 'colur' "
                                          "\\(did you mean 'extra.colour'\\?\\)"):
        cfg.merge_from_options(["extra.colur=blue"])
    with pytest.raises(ConfigError, match="^unknown config key 'other.size'"):  # plain data: key must exist
        cfg.merge_from_options(["other.size=2"])
    del kind, Gadget
    gc.collect()


def test_name_in_several_registries_accepts_the_parameters_of_either():
    first, second = Registry("options-test-a"), Registry("options-test-b")
    first.register_module("Twin", module=type("TwinA", (), {"__init__": lambda self, alpha=1: None}))
    second.register_module("Twin", module=type("TwinB", (), {"__init__": lambda self, beta=1: None}))
    cfg = Config({"thing": {"type": "Twin"}})
    cfg.merge_from_options(["thing.alpha=2", "thing.beta=3"])
    assert cfg.thing == {"type": "Twin", "alpha": 2, "beta": 3}
    with pytest.raises(ConfigError, match="options-test-a/options-test-b Twin has no parameter 'gamma'"):
        cfg.merge_from_options(["thing.gamma=1"])


@pytest.mark.parametrize("path, registry", [
    ("train", "trainer"), ("hooks.3", "hook"), ("model", "model"), ("optimizer", "optimizer"),
    ("scheduler", "scheduler"), ("data.train", "dataset"), ("data.train.1", "dataset"),
    ("data.val.transform.0", "transform"), ("data.train.1.transform", "transform"),
    ("train.collate_fn", "collate function"),
    ("model.backbone", None), ("hooks.x", None), ("data", None),
])
def test_slot_of_a_path(path, registry):
    assert slot_registry(path) == registry


def test_whole_config_check_names_the_path_of_a_misspelt_parameter(tmp_path):
    for shipped in sorted((ROOT / "configs").rglob("*.py")):
        check_registry_dicts(Config.fromfile(shipped))  # every shipped config passes
    bad = tmp_path / "bad.py"
    bad.write_text(f"_base_ = {str(RINGS)!r}\ndata = dict(val=dict(num_event=10))\n")
    with pytest.raises(ConfigError) as info:
        check_registry_dicts(Config.fromfile(bad))
    assert str(info.value) == ("data.val.num_event: dataset CherenkovRingDataset has no parameter 'num_event' "
                               "(did you mean 'data.val.num_events'?)")


# ----------------------------------------------------------------------------- through the real command line


def _train(tmp_path, *options):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.pop("PIMM_DEBUG", None)
    cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(RINGS), "--options",
           f"save_path={tmp_path / 'run'}", *options]
    return forkserver.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)


def test_cli_misspelt_hook_parameter_exits_2_naming_the_nearest(tmp_path):
    proc = _train(tmp_path, "default_hooks.checkpoint.save_frq=50")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --options default_hooks.checkpoint.save_frq: hook CheckpointSaver has no parameter 'save_frq' "
        "(did you mean 'default_hooks.checkpoint.save_freq'?)"]


@pytest.mark.slow
def test_cli_hook_parameter_not_in_the_config_takes_effect(tmp_path):
    # 64 events / batch 32 = 2 steps in one epoch: without save_freq only the
    # epoch-end checkpoint (step 2) is written; save_freq=1 adds step 1.
    proc = _train(tmp_path, "epoch=1", "batch_size=32", "batch_size_val=32", "data.train.num_events=64",
                  "data.val.num_events=32", "default_hooks.checkpoint.save_freq=1",
                  "default_hooks.checkpoint.keep_last=4")
    assert proc.returncode == 0, proc.stderr
    steps = sorted(p.name.split("-")[0] for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert steps == ["step000000001", "step000000002"]
    written = Config.fromfile(tmp_path / "run" / "config.py")
    assert written.default_hooks.checkpoint.save_freq == 1
