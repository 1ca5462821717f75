"""Upstream pimm's import paths (docs/architecture.md) name pimm's own objects:
the same registries and classes, importable in a fresh interpreter in any order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PATHS = [
    ("pimm.engines.hooks.builder", "HOOKS", "pimm.engines.registries", "HOOKS"),
    ("pimm.engines.hooks.default", "HookBase", "pimm.engines.hooks.base", "HookBase"),
    ("pimm.engines.train", "TRAINERS", "pimm.engines.registries", "TRAINERS"),
    ("pimm.engines.test", "TESTERS", "pimm.engines.registries", "TESTERS"),
    ("pimm.models.builder", "MODELS", "pimm.engines.registries", "MODELS"),
    ("pimm.models.utils.structure", "Point", "pimm.models.ptv3.structure", "Point"),
    ("pimm.models.losses.builder", "LOSSES", "pimm.models.losses", "LOSSES"),
    ("pimm.models.losses.builder", "build_criteria", "pimm.models.losses", "build_criteria"),
    ("pimm.models.default", "DefaultSegmentorV2", "pimm.models.segmentor_v2", "DefaultSegmentorV2"),
    ("pimm.datasets.builder", "DATASETS", "pimm.engines.registries", "DATASETS"),
    ("pimm.datasets.transform", "TRANSFORMS", "pimm.engines.registries", "TRANSFORMS"),
    ("pimm.datasets.transform", "Compose", "pimm.datasets.transforms", "Compose"),
    ("pimm.datasets.utils", "collate_fn", "pimm.datasets.collate", "collate_fn"),
]


@pytest.mark.parametrize("upstream, name, home, home_name", PATHS, ids=[f"{p[0]}.{p[1]}" for p in PATHS])
def test_upstream_path_is_pimms_object(upstream, name, home, home_name):
    import importlib

    assert getattr(importlib.import_module(upstream), name) is getattr(importlib.import_module(home), home_name)


# One interpreter imports torch and numpy (third-party leaves that every pimm module
# imports first, ~2 s of start-up), then forks a child per module: each child's
# first pimm import is the module under test, as in a fresh interpreter.
_FIRST_IMPORTS = r"""
import json, os, sys, traceback
import numpy, torch
assert not any(m == "pimm" or m.startswith("pimm.") for m in sys.modules)
results = {}
for module, names in json.loads(sys.argv[1]):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            exec(f"from {module} import {names}")
            message = "ok"
        except BaseException:
            message = traceback.format_exc()
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        results[module] = pipe.read()
    os.waitpid(pid, 0)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def first_imports() -> dict[str, str]:
    """Each upstream path imported first in a process that has imported no pimm module: "ok" or the traceback."""
    import json

    wanted = [(module, ", ".join(p[1] for p in PATHS if p[0] == module)) for module in sorted({p[0] for p in PATHS})]
    done = subprocess.run([sys.executable, "-c", _FIRST_IMPORTS, json.dumps(wanted)], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", sorted({p[0] for p in PATHS}))
def test_upstream_path_imports_first_in_a_fresh_interpreter(module, first_imports):
    """The first pimm import of the process (``pimm.models.losses.builder`` is not a file)."""
    assert first_imports[module] == "ok", first_imports[module][-2000:]


def test_build_model_and_build_dataset_build_from_the_registries():
    import torch

    from pimm.datasets.builder import DATASETS, build_dataset
    from pimm.models.builder import MODELS, build_model

    @MODELS.register_module("UpstreamPathProbe")
    class Probe(torch.nn.Module):
        def __init__(self, width=3):
            super().__init__()
            self.width = width

    try:
        assert build_model(dict(type="UpstreamPathProbe", width=5)).width == 5
    finally:
        MODELS.remove("UpstreamPathProbe")

    @DATASETS.register_module("UpstreamPathData")
    class Data:
        def __init__(self, n=1):
            self.n = n

    try:
        assert build_dataset(dict(type="UpstreamPathData", n=4)).n == 4
    finally:
        DATASETS.remove("UpstreamPathData")
