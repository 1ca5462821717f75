"""docs/coming-from.md's table of every name upstream pimm registers: it is
what the live registries give (regenerate with tools/upstream_registry_table.py),
and no upstream name is a bare "unknown type": each one builds or is refused
with a line saying what to use."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("upstream_registry_table", ROOT / "tools" / "upstream_registry_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)
NAMES = json.loads(table.NAMES_FILE.read_text())


def _all_names():
    for section in ("registered", "config_only"):
        for reg_var, names in NAMES[section].items():
            for name in names:
                yield reg_var, name


def test_the_snapshot_holds_upstreams_165_names_in_9_registries():
    assert sum(len(v) for v in NAMES["registered"].values()) == 165
    assert len(NAMES["registered"]) == 9
    assert NAMES["config_only"]["HOOKS"] == ["RuntimeProfilerV2", "PreciseEvaluator"]


def test_the_page_is_what_the_registries_give_now():
    assert table.main(["--check"]) == 0, "run: python tools/upstream_registry_table.py"


@pytest.mark.parametrize("reg_var, name", list(_all_names()), ids=lambda v: str(v))
def test_every_upstream_name_builds_or_is_refused_in_one_line(reg_var, name):
    from pimm.utils.errors import RegistryError

    registry = table._live_registries()[table.REGISTRIES[reg_var]]
    if registry.find(name) is not None:
        return
    with pytest.raises(RegistryError) as err:
        registry.get(name)
    message = str(err.value)
    assert "not available in pimm" in message and "\n" not in message, message
    assert table.status(registry, name).startswith("refused: ")
