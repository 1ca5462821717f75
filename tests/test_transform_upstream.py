"""pimm's geometric transforms and ``Collect`` against upstream pimm's own
output on one event (``tests/fixtures/transforms/upstream_transforms.json``,
written by ``make_reference.py`` there from upstream's code): coord, normal,
the per-point ``vertex`` (with -1 sentinel rows), and the declared position,
direction and vector targets."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pimm.datasets.transforms import Collect, ToTensor
from pimm.engines.registries import TRANSFORMS

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "transforms" / "upstream_transforms.json").read_text())


def event():
    return {k: np.asarray(v, dtype=np.float32) for k, v in FIXTURE["event"].items()}


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=[c["name"] for c in FIXTURE["cases"]])
def test_geometric_transform_matches_upstream(case):
    out = TRANSFORMS.build(dict(case["cfg"]))({**event(), **FIXTURE["declared"]})
    for key, expected in FIXTURE["outputs"][case["name"]].items():
        np.testing.assert_allclose(out[key], np.asarray(expected), rtol=1e-5, atol=1e-5, err_msg=key)


def test_fixture_exercises_every_kind_of_target():
    """Guards the fixture: each target moved in some case, and sentinels present."""
    ev = event()
    assert (ev["vertex"] == -1).all(axis=1).sum() == 2 and (ev["momentum_vec"] == -1).all(axis=1).sum() == 2
    for key in ("vertex", "primary_vertex", "primary_direction", "momentum_vec", "normal"):
        moved = [c["name"] for c in FIXTURE["cases"]
                 if not np.allclose(FIXTURE["outputs"][c["name"]][key], ev[key])]
        assert moved, key


def test_collect_matches_upstream():
    out = Collect(keys=("coord",), feat_keys=("coord", "energy"))(ToTensor()(event()))
    assert set(out) == set(FIXTURE["collect"])
    for key, expected in FIXTURE["collect"].items():
        torch.testing.assert_close(out[key], torch.tensor(expected, dtype=out[key].dtype), msg=key)
