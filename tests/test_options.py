"""``--options`` overrides: grammar, value parsing, key paths and errors."""

import pytest

from pimm.utils.config import Config, ConfigDict, parse_options, parse_value
from pimm.utils.errors import ConfigError


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
    "__import__('os').system('echo hi')", "dict(a=1)", "print(1)", "os.getcwd()", "[1, f(2)]",
])
def test_parse_value_rejects_malformed_literals_and_calls(text):
    with pytest.raises(ConfigError, match="bad value in --options lr=.*never run as code"):
        parse_value(text, "lr")


@pytest.mark.parametrize("word, python", [("true", "True"), ("false", "False"), ("null", "None")])
def test_parse_value_rejects_yaml_style_constants(word, python):
    with pytest.raises(ConfigError, match=f"write {python}"):
        parse_value(word, "resume")


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
    cfg.merge_from_options(["hooks.1.save_freq=50", "hooks.-1.save_freq=7", "hooks.2={'type': 'Other'}"])
    assert [h.get("save_freq") for h in cfg.hooks] == [None, 50, None, 7]
    assert isinstance(cfg.hooks[2], ConfigDict) and cfg.hooks[2].type == "Other"


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
    with pytest.raises(ConfigError, match="did you mean 'hooks.CheckpointSaver.save_freq'"):
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
