"""Config files: ConfigDict behaviour, loading, _base_ merging, custom_imports,
load errors, dump/load round trip and pickling."""

import copy
import os
import pickle
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest

from pimm.utils.config import Config, ConfigDict
from pimm.utils.errors import ConfigError, UserError

REPO = Path(__file__).resolve().parents[1]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes an importable module into tmp_path; removes it from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))
    created = []

    def make(name: str, text: str) -> str:
        write(tmp_path / f"{name}.py", text)
        created.append(name)
        return name

    yield make
    for name in created:
        sys.modules.pop(name, None)


# ----------------------------------------------------------------------------- ConfigDict


def test_configdict_attribute_and_item_access_and_deep_conversion():
    cfg = ConfigDict(optimizer=dict(lr=0.1), hooks=[dict(type="A")], pair=(dict(x=1), 2))
    assert cfg.optimizer.lr == 0.1 and cfg["optimizer"]["lr"] == 0.1
    assert isinstance(cfg.hooks[0], ConfigDict) and cfg.hooks[0].type == "A"
    assert isinstance(cfg.pair, tuple) and cfg.pair[0].x == 1
    cfg.optimizer.lr = 0.5
    cfg.scheduler = {"type": "Cos", "args": {"t": 3}}
    cfg.update(extra={"deep": {"k": 1}})
    assert cfg["optimizer"]["lr"] == 0.5 and cfg.scheduler.args.t == 3 and cfg.extra.deep.k == 1
    assert cfg.get("missing", 7) == 7 and cfg.optimizer.get("lr") == 0.5
    del cfg.scheduler
    assert "scheduler" not in cfg


def test_configdict_missing_attribute_names_key():
    cfg = ConfigDict(optimizer=dict(lr=0.1))
    with pytest.raises(AttributeError, match="'optimzer'.*did you mean 'optimizer'"):
        cfg.optimzer
    assert getattr(cfg, "nothing", "default") == "default"
    assert not hasattr(cfg.optimizer, "momentum")


def test_configdict_refuses_to_shadow_dict_methods_as_attributes():
    cfg = ConfigDict()
    with pytest.raises(AttributeError, match="cfg\\['items'\\]"):
        cfg.items = 3
    cfg["items"] = 3
    assert cfg["items"] == 3


def test_to_dict_returns_plain_containers():
    cfg = ConfigDict(a=dict(b=[dict(c=1)], t=(dict(d=2),)))
    plain = cfg.to_dict()
    assert plain == {"a": {"b": [{"c": 1}], "t": ({"d": 2},)}}
    assert type(plain["a"]) is dict and type(plain["a"]["b"][0]) is dict and type(plain["a"]["t"][0]) is dict


def test_pickle_deepcopy_and_copy_keep_type_data_and_filename(tmp_path):
    cfg = Config.fromfile(write(tmp_path / "c.py", """
        from collections import OrderedDict
        model = dict(type='M', sizes=[1, (2, 3)])
        fn = OrderedDict
    """))
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg), cfg.copy()):
        assert type(clone) is Config and clone == cfg
        assert clone.filename == cfg.filename
        assert isinstance(clone.model, ConfigDict) and clone.fn is OrderedDict
    deep = copy.deepcopy(cfg)
    deep.model.sizes.append(9)
    assert cfg.model.sizes == [1, (2, 3)]


def test_equality_depends_on_data_only(tmp_path):
    a = Config.fromfile(write(tmp_path / "a.py", "x = dict(y=1)\n"))
    b = Config.fromfile(write(tmp_path / "b.py", "x = {'y': 1}\n"))
    assert a == b and a == Config({"x": {"y": 1}}) and a == {"x": {"y": 1}}
    assert a != Config({"x": {"y": 2}})


# ----------------------------------------------------------------------------- loading


def test_fromfile_keeps_data_drops_helpers(tmp_path):
    path = write(tmp_path / "cfg.py", """
        import math
        import os.path
        from collections import OrderedDict
        from math import pi
        def helper(x):
            return x * 2
        class Local:
            pass
        _private = 5
        lr = helper(0.5)
        model = dict(type=OrderedDict, fn=math.sqrt, n=_private)
        container = OrderedDict
        here = __file__
    """)
    cfg = Config.fromfile(path)
    assert set(cfg) == {"lr", "model", "container", "here"}
    assert cfg.lr == 1.0 and cfg.model.type is OrderedDict and cfg.model.n == 5
    assert cfg.container is OrderedDict
    assert cfg.here == str(path.resolve())
    assert cfg.filename == str(path.resolve()) and "filename" not in cfg


def test_base_merge_rules(tmp_path):
    write(tmp_path / "base.py", """
        model = dict(type="Net", depth=3, head=dict(dim=8, act="relu"), layers=[1, 2, 3])
        optimizer = dict(type="SGD", lr=0.1, momentum=0.9)
        hooks = [dict(type="A"), dict(type="B")]
        epoch = 10
    """)
    cfg = Config.fromfile(write(tmp_path / "child.py", """
        _base_ = "base.py"
        model = dict(depth=5, head=dict(dim=16), layers=[7])
        optimizer = dict(_delete_=True, type="AdamW", lr=0.001)
        hooks = [dict(type="C")]
        seed = 1
    """))
    assert cfg.model == {"type": "Net", "depth": 5, "head": {"dim": 16, "act": "relu"}, "layers": [7]}
    assert cfg.optimizer == {"type": "AdamW", "lr": 0.001}  # _delete_ replaced it, key dropped
    assert cfg.hooks == [{"type": "C"}] and cfg.epoch == 10 and cfg.seed == 1
    assert "_base_" not in cfg
    assert list(cfg) == ["model", "optimizer", "hooks", "epoch", "seed"]


def test_delete_key_never_survives(tmp_path):
    cfg = Config.fromfile(write(tmp_path / "c.py", """
        fresh = dict(_delete_=True, a=dict(_delete_=True, b=1))
        items = [dict(_delete_=False, x=1)]
    """))
    assert cfg.fresh == {"a": {"b": 1}}
    assert cfg["items"] == [{"x": 1}]


def test_multiple_bases_merge_in_order_and_base_of_base(tmp_path):
    write(tmp_path / "common" / "root.py", "a = 1\nopt = dict(lr=0.1, wd=0.0)\norder = ['root']\n")
    write(tmp_path / "common" / "mid.py", "_base_ = './root.py'\nb = 2\nopt = dict(wd=0.5)\norder = ['mid']\n")
    write(tmp_path / "other" / "second.py", "b = 3\nc = 4\nopt = dict(lr=0.2)\n")
    cfg = Config.fromfile(write(tmp_path / "exp" / "run.py", """
        _base_ = ["../common/mid.py", "../other/second.py"]
        c = 5
    """))
    assert cfg.a == 1 and cfg.b == 3 and cfg.c == 5  # later base wins, child wins over both
    assert cfg.opt == {"lr": 0.2, "wd": 0.5}
    assert cfg.order == ["mid"]


def test_base_absolute_path(tmp_path):
    base = write(tmp_path / "elsewhere" / "b.py", "x = 1\n")
    cfg = Config.fromfile(write(tmp_path / "c.py", f"_base_ = {str(base)!r}\ny = 2\n"))
    assert cfg == {"x": 1, "y": 2}


@pytest.mark.parametrize("layout", ["self", "pair", "triangle"])
def test_base_cycles_are_errors(tmp_path, layout):
    if layout == "self":
        write(tmp_path / "a.py", "_base_ = 'a.py'\n")
    elif layout == "pair":
        write(tmp_path / "a.py", "_base_ = 'b.py'\n")
        write(tmp_path / "b.py", "_base_ = 'a.py'\n")
    else:
        write(tmp_path / "a.py", "_base_ = 'b.py'\n")
        write(tmp_path / "b.py", "_base_ = ['c.py']\n")
        write(tmp_path / "c.py", "_base_ = 'a.py'\n")
    with pytest.raises(ConfigError, match="circular _base_") as info:
        Config.fromfile(tmp_path / "a.py")
    assert str(tmp_path / "a.py") in str(info.value)


def test_diamond_bases_are_not_cycles(tmp_path):
    write(tmp_path / "root.py", "r = 1\n")
    write(tmp_path / "l.py", "_base_ = 'root.py'\nl = 1\n")
    write(tmp_path / "r.py", "_base_ = 'root.py'\nrr = 1\n")
    assert Config.fromfile(write(tmp_path / "top.py", "_base_ = ['l.py', 'r.py']\n")) == {"r": 1, "l": 1, "rr": 1}


# ----------------------------------------------------------------------------- custom_imports


def test_custom_imports_registers_user_classes(tmp_path, user_module):
    name = user_module("pimm_test_user_hooks", """
        from pimm.utils.registry import Registry
        REG = Registry("test-hooks")
        @REG.register_module()
        class MyHook:
            pass
    """)
    cfg = Config.fromfile(write(tmp_path / "c.py", f"custom_imports = {name!r}\nhooks = [dict(type='MyHook')]\n"))
    assert cfg.custom_imports == [name]
    assert sys.modules[name].REG.get("MyHook").__name__ == "MyHook"


def test_custom_imports_accumulate_across_bases(tmp_path, user_module):
    one = user_module("pimm_test_mod_one", "X = 1\n")
    two = user_module("pimm_test_mod_two", "X = 2\n")
    write(tmp_path / "base.py", f"custom_imports = [{one!r}]\n")
    cfg = Config.fromfile(write(tmp_path / "c.py", f"_base_ = 'base.py'\ncustom_imports = [{two!r}, {one!r}]\n"))
    assert cfg.custom_imports == [one, two]
    assert one in sys.modules and two in sys.modules


def test_custom_imports_given_with_options_are_imported_before_hooks_are_built(tmp_path, user_module):
    name = user_module("pimm_test_option_hooks", """
        from pimm.engines import HOOKS, HookBase
        @HOOKS.register_module(force=True)
        class HookFromAnOptionImport(HookBase):
            pass
    """)
    from pimm.engines.hooks.base import build_hooks

    cfg = Config.fromfile(write(tmp_path / "c.py", "hooks = []\n"))
    cfg.merge_from_options([f"+custom_imports=[{name!r}]", "hooks=[{'type': 'HookFromAnOptionImport'}]"])
    assert cfg.custom_imports == [name]
    assert [type(h).__name__ for h in build_hooks(cfg.hooks)] == ["HookFromAnOptionImport"]
    with pytest.raises(ConfigError, match="custom_imports.*'no_such_pimm_module_xyz'"):
        cfg.merge_from_options(["custom_imports=['no_such_pimm_module_xyz']"])


def test_custom_imports_missing_module_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="custom_imports.*'no_such_pimm_module_xyz'"):
        Config.fromfile(write(tmp_path / "c.py", "custom_imports = ['no_such_pimm_module_xyz']\n"))


def test_custom_imports_found_in_current_directory(tmp_path, monkeypatch):
    write(tmp_path / "pimm_test_cwd_mod.py", "VALUE = 42\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        Config.fromfile(write(tmp_path / "c.py", "custom_imports = ['pimm_test_cwd_mod']\n"))
        assert sys.modules["pimm_test_cwd_mod"].VALUE == 42
    finally:
        sys.modules.pop("pimm_test_cwd_mod", None)


def test_unpickling_in_a_new_process_reimports_custom_modules(tmp_path, user_module):
    name = user_module("pimm_test_worker_mod", "LOADED = True\n")
    cfg = Config.fromfile(write(tmp_path / "c.py", f"custom_imports = [{name!r}]\nlr = 0.1\n"))
    code = (
        "import pickle, sys\n"
        "cfg = pickle.load(sys.stdin.buffer)\n"
        f"print(cfg.lr, {name!r} in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(tmp_path)]))
    out = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(cfg), env=env,
                         capture_output=True, check=True, cwd=REPO)
    assert out.stdout.decode().split() == ["0.1", "True"]


# ----------------------------------------------------------------------------- load errors


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match=f"config file not found: .*{tmp_path.name}.*nope.py"):
        Config.fromfile(tmp_path / "nope.py")


def test_missing_base_names_including_file(tmp_path):
    child = write(tmp_path / "child.py", "_base_ = ['gone.py']\n")
    with pytest.raises(ConfigError) as info:
        Config.fromfile(child)
    msg = str(info.value)
    assert "config file not found" in msg and "gone.py" in msg and str(child) in msg


def test_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path / "bad.py", "a = 1\nb = dict(x=\n")
    with pytest.raises(ConfigError, match=f"syntax error in config {path}:2: .*never closed") as info:
        Config.fromfile(path)
    assert "\n" not in str(info.value) and isinstance(info.value, UserError)


def test_exception_while_executing_names_file_line_and_exception(tmp_path):
    path = write(tmp_path / "boom.py", "a = 1\nb = undefined_name + 1\n")
    with pytest.raises(ConfigError, match=f"{path}:2: NameError: name 'undefined_name' is not defined"):
        Config.fromfile(path)


def test_error_in_base_names_base_file(tmp_path):
    base = write(tmp_path / "base.py", "x = 1 / 0\n")
    with pytest.raises(ConfigError, match=f"{base}:1: ZeroDivisionError"):
        Config.fromfile(write(tmp_path / "c.py", "_base_ = 'base.py'\n"))


def test_bad_base_type(tmp_path):
    with pytest.raises(ConfigError, match="_base_ must be a string or a list of strings, got 3"):
        Config.fromfile(write(tmp_path / "c.py", "_base_ = 3\n"))


# ----------------------------------------------------------------------------- dump


def roundtrip(cfg: Config, tmp_path: Path) -> Config:
    path = tmp_path / "out" / "config.py"
    cfg.dump(path)
    return Config.fromfile(path)


def test_dump_round_trip_of_literals(tmp_path):
    long_list = [dict(type="T", index=i, scale=i / 7) for i in range(30)]
    cfg = Config({
        "model": {"type": "Net", "head": {"dims": (64, 128), "single": (1,), "empty": (), "act": None}},
        "flags": [True, False, None],
        "floats": [0.1 + 0.2, 1e-300, 2.5e300, -0.0, 1 / 3, float("inf"), float("-inf")],
        "big": 2 ** 70,
        "text": "it's \"quoted\"\nnext line\ttab \\ backslash ünïcode",
        "odd_keys": {1: "one", "with-dash": 2, "class": 3, (1, 2): "tuple key"},
        "transforms": long_list,
        "nested": [[1, [2, (3, dict(k=[4]))]]],
        "sets": {3, 1},
        "empty": {},
    })
    loaded = roundtrip(cfg, tmp_path)
    assert loaded == cfg
    assert [repr(x) for x in loaded.floats] == [repr(x) for x in cfg.floats]
    assert type(loaded.model.head.dims) is tuple and loaded.model.head.single == (1,)
    assert isinstance(loaded.transforms[29], ConfigDict)
    text = (tmp_path / "out" / "config.py").read_text()
    assert max(len(line) for line in text.splitlines()) < 140  # long values are spread over lines


def test_dump_round_trip_of_classes_and_functions(tmp_path, user_module):
    name = user_module("pimm_test_dump_mod", """
        class Outer:
            class Inner:
                pass
        def build():
            return 1
    """)
    mod = __import__(name)
    cfg = Config({
        "OrderedDict": 1,  # a key that clashes with the import name
        "model": {"type": OrderedDict, "inner": mod.Outer.Inner, "fn": mod.build, "join": os.path.join},
        "cast": int,
        "factory": mod.Outer,
    })
    loaded = roundtrip(cfg, tmp_path)
    assert loaded == cfg
    assert loaded.model.type is OrderedDict and loaded.model.inner is mod.Outer.Inner and loaded.cast is int


def test_dump_round_trip_of_loaded_file_with_bases(tmp_path):
    write(tmp_path / "base.py", "model = dict(type='Net', layers=[1, 2])\nlr = 0.1\n")
    cfg = Config.fromfile(write(tmp_path / "c.py", "_base_ = 'base.py'\nmodel = dict(layers=[3])\n"))
    assert roundtrip(cfg, tmp_path) == cfg == {"model": {"type": "Net", "layers": [3]}, "lr": 0.1}


def test_dump_rejects_lambdas_locals_and_objects_naming_the_key(tmp_path):
    class Local:
        pass

    for value, culprit in [
        ({"fn": lambda x: x}, "'model.fn'"),
        ({"cls": Local}, "'model.cls'"),
        ({"obj": object()}, "'model.obj'"),
    ]:
        cfg = Config({"model": value})
        with pytest.raises(ConfigError, match=culprit):
            cfg.dump(tmp_path / "x.py")
        assert "model" in cfg.pretty_text  # logging never fails
    with pytest.raises(ConfigError, match="'my-key'"):
        Config({"my-key": 1}).dump()


def test_dump_rejects_classes_defined_in_config_files(tmp_path):
    cfg = Config.fromfile(write(tmp_path / "c.py", "class Mine:\n    pass\nmodel = dict(type=Mine)\n"))
    with pytest.raises(ConfigError, match="'model.type'.*importable module"):
        cfg.dump()


def test_pretty_text_is_python_source():
    cfg = Config({"model": {"type": "Net", "depth": 3}, "lr": 0.1})
    assert cfg.pretty_text == "model = dict(type='Net', depth=3)\nlr = 0.1\n"


def test_option_helpers_do_not_import_the_loader():
    # Imports point one way: config -> config_options -> config_dict. A cycle
    # (config_options importing config) would make the first import order matter.
    code = ("import sys, pimm.utils.config_options; "
            "assert 'pimm.utils.config' not in sys.modules, 'config_options imports config'; "
            "from pimm.utils.config import Config, ConfigDict, ConfigError, apply_option, parse_options, parse_value; "
            "from pimm.utils.config_dict import ConfigDict as D; assert D is ConfigDict")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
