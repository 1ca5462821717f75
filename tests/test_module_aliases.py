"""Old import paths of the regrouped engine modules and of ``pimm.tools`` keep
working (issue 35): same module objects, no files at the old places."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import pimm
from pimm.utils.module_aliases import MOVED

PACKAGE_ROOT = Path(pimm.__file__).resolve().parent


@pytest.mark.parametrize("old, new", sorted(MOVED.items()))
def test_an_old_path_is_the_new_module_and_has_no_file(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)
    relative = Path(*old.split(".")[1:])
    assert not (PACKAGE_ROOT / relative.with_suffix(".py")).exists(), f"{old}: a file is left at the old place"
    if old != "pimm.tools":  # pimm.tools was a package; pimm.cli is its new home
        assert not (PACKAGE_ROOT / relative).is_dir()
    # The module keeps its real identity: its spec names the new path.
    assert importlib.import_module(new).__spec__.name == new


def test_every_target_exists():
    for new in MOVED.values():
        importlib.import_module(new)


def test_from_imports_attribute_access_and_monkeypatch_reach_the_module_the_engine_uses(monkeypatch):
    from pimm.engines import runtime as via_package
    from pimm.engines.run import runtime
    from pimm.engines.runtime import RUNTIME_DEFAULTS
    import pimm.engines.scheduler

    assert via_package is runtime and RUNTIME_DEFAULTS is runtime.RUNTIME_DEFAULTS
    assert pimm.engines.scheduler is importlib.import_module("pimm.engines.optim.scheduler")
    monkeypatch.setattr("pimm.engines.runtime.RUNTIME_DEFAULTS", {"patched": True})
    assert runtime.RUNTIME_DEFAULTS == {"patched": True}


def test_optim_package_still_exposes_what_optim_py_held():
    from pimm.engines.optim import NO_DECAY_RULES, build_optimizer
    from pimm.engines.optim.optimizers import build_optimizer as real

    assert build_optimizer is real and NO_DECAY_RULES


def test_pimm_tools_names_still_import():
    from pimm.tools import ToolParser, output_path, writing  # noqa: F401
    from pimm.tools.jsonl import read_jsonl
    from pimm.cli.jsonl import read_jsonl as real

    assert read_jsonl is real


def test_objects_pickled_under_an_old_module_path_load():
    from pimm.engines.observe.metrics import BestMetric

    # A pickle written before the move names the class by its old module.
    data = pickle.dumps(BestMetric, protocol=0).replace(b"pimm.engines.observe.metrics", b"pimm.engines.metrics")
    assert b"pimm.engines.metrics" in data
    assert pickle.loads(data) is BestMetric


def test_a_fresh_interpreter_resolves_old_paths_before_anything_else_is_imported():
    code = ("import pimm.engines.optim_step as old, pimm.engines.optim.step as new, sys; "
            "assert old is new and sys.modules['pimm.engines.optim_step'] is new; "
            "import pimm.tools.trace_report; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_unknown_names_still_fail_as_before():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pimm.engines.no_such_module")


def test_python_dash_m_runs_a_command_by_its_old_path():
    done = subprocess.run([sys.executable, "-m", "pimm.tools.submit", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=str(PACKAGE_ROOT.parent))
    assert done.returncode == 0 and "usage: pimm submit" in done.stdout, done.stderr[-2000:]
