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


@pytest.mark.parametrize("module", sorted({p[0] for p in PATHS}))
def test_upstream_path_imports_first_in_a_fresh_interpreter(module):
    """The first import of the process (``pimm.models.losses.builder`` is not a file)."""
    names = ", ".join(p[1] for p in PATHS if p[0] == module)
    done = subprocess.run([sys.executable, "-c", f"from {module} import {names}; print('ok')"], cwd=ROOT,
                          capture_output=True, text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


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
