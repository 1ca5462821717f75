"""Hardening round 6, transforms: what upstream's transform code gives a meaning
to, pimm accepts and does the same way.

* ``CenterShift`` / ``PositiveShift`` / ``RandomShift`` move ``vertex`` and the
  event's ``aux_position_keys`` with ``coord`` (upstream's CenterShift does;
  the detector's vertex targets drifted by up to half the event's extent);
* ``ElasticDistortion`` takes a zero magnitude and ``[]``, the view generators
  a ``center_height_scale`` window reaching past the top; nonsense is refused;
* ``MultiViewGenerator``'s anchor arguments centre local crops on anchors, as
  upstream's do (they were accepted and ignored);
* ``GridSample`` / ``LocalCovarianceFeatures`` extend ``index_valid_keys`` as
  upstream does.

The edge cases are checked against upstream's own output
(``edge_cases`` of ``tests/fixtures/transforms/upstream_transforms_more.json``,
written by ``make_reference_more.py`` from upstream's code).
"""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

import pimm.datasets  # noqa: F401  (registers the transforms)
from pimm.engines.registries import TRANSFORMS
from pimm.utils.config_domains import check_config_domains
from pimm.utils.errors import ConfigError, UserError

HERE = Path(__file__).parent / "fixtures" / "transforms"
FIXTURE = json.loads((HERE / "upstream_transforms_more.json").read_text())
_spec = importlib.util.spec_from_file_location("make_reference_more", HERE / "make_reference_more.py")
reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(reference)  # its event preparation and seeding only; upstream is never imported

EVENT = {k: np.asarray(v["values"], dtype=v["dtype"]) for k, v in FIXTURE["event"].items()}
EDGE_CASES = FIXTURE["edge_cases"]


@pytest.mark.parametrize("spec", EDGE_CASES, ids=[c["name"] for c in EDGE_CASES])
def test_edge_case_matches_upstream(spec):
    data = reference.prepare(EVENT, spec)
    reference.seed_all(spec["seed"])
    out = TRANSFORMS.build(json.loads(json.dumps(spec["cfg"])))(data)
    for key, want in FIXTURE["edge_outputs"][spec["name"]].items():
        if key in reference.NAMES:  # upstream appends a name it already lists again; pimm keeps one of each
            assert list(out[key]) == list(dict.fromkeys(want)), key
            continue
        got = np.asarray(reference.lookup(out, key), dtype=np.float64)
        np.testing.assert_allclose(got, np.asarray(want, dtype=np.float64).reshape(got.shape), rtol=2e-6,
                                   atol=2e-5, err_msg=f"{spec['name']}: {key}")


def test_the_edge_cases_cover_what_the_issue_names():
    names = {c["name"] for c in EDGE_CASES}
    assert {"center_shift_all", "elastic_zero_magnitude", "elastic_no_pairs", "multiview_anchors",
            "mixed_scale_top_band", "grid_sample_valid_keys", "local_covariance_valid_keys"} <= names
    shifted = FIXTURE["edge_outputs"]["center_shift_all"]
    assert not np.allclose(shifted["primary_vertex"], EVENT["primary_vertex"])  # upstream moved it


def _event_with_targets():
    rng = np.random.default_rng(3)
    coord = rng.uniform(100, 700, size=(50, 3)).astype(np.float32)
    vertex = coord + rng.normal(0, 5, size=(50, 3)).astype(np.float32)
    vertex[4] = -1  # the missing-vertex sentinel stays
    return dict(coord=coord, vertex=vertex, primary_vertex=coord[0] + 1, aux_position_keys=["primary_vertex"],
                energy=np.ones((50, 1), np.float32))


@pytest.mark.parametrize("cfg", [dict(type="CenterShift"), dict(type="CenterShift", axes=("x", "z")),
                                 dict(type="PositiveShift"),
                                 dict(type="RandomShift", shift=((-3, 3), (-2, 2), (1, 1)))],
                         ids=["center", "center_xz", "positive", "random"])
def test_shifts_move_the_position_targets_with_the_points(cfg):
    data = _event_with_targets()
    np.random.seed(0)
    out = TRANSFORMS.build(cfg)(data)
    shift = out["coord"][0].astype(np.float64) - data["coord"][0]
    assert np.abs(shift).max() > 0.5
    np.testing.assert_allclose(out["coord"] - data["coord"], np.broadcast_to(shift, data["coord"].shape), atol=1e-3)
    live = np.ones(50, bool)
    live[4] = False
    np.testing.assert_allclose(out["vertex"][live] - data["vertex"][live], np.broadcast_to(shift, (49, 3)),
                               atol=1e-3)
    np.testing.assert_array_equal(out["vertex"][4], [-1, -1, -1])
    np.testing.assert_allclose(out["primary_vertex"] - data["primary_vertex"], shift, atol=1e-3)


def test_elastic_distortion_takes_upstreams_edge_values_and_refuses_nonsense():
    coord = np.random.default_rng(0).uniform(0, 10, size=(40, 3)).astype(np.float32)
    for params in ([[50, 0], [0.8, 1.6]], [[2.0, 0.0]], []):
        out = TRANSFORMS.build(dict(type="ElasticDistortion", distortion_params=params))(dict(coord=coord.copy()))
        assert out["coord"].shape == coord.shape
    still = TRANSFORMS.build(dict(type="ElasticDistortion", distortion_params=[[2.0, 0.0]]))(dict(coord=coord))
    np.testing.assert_array_equal(still["coord"], coord)
    for bad in ([[0, 1]], [[-1, 1]], [[1, -1]], [[1]], [[float("nan"), 1]]):
        with pytest.raises(ConfigError, match="ElasticDistortion.distortion_params"):
            TRANSFORMS.build(dict(type="ElasticDistortion", distortion_params=bad))


def _config_with(transform: dict) -> dict:
    return dict(data=dict(train=dict(type="DefaultDataset", data_root="data", transform=[transform])))


@pytest.mark.parametrize("kind", ["MultiViewGenerator", "MixedScaleGeometryMultiViewGenerator"])
def test_a_centre_window_past_the_top_is_taken_and_one_outside_the_event_refused(kind):
    ok = dict(type=kind, center_height_scale=(0.99, 1.01), view_keys=("coord",), local_view_num=2)
    if kind.startswith("Mixed"):
        ok["fine_local_view_num"] = 1
    check_config_domains(_config_with(ok))
    data = dict(coord=np.random.default_rng(1).uniform(0, 1, size=(60, 3)).astype(np.float32))
    np.random.seed(0)
    out = TRANSFORMS.build(ok)(data)
    assert len(out["global_offset"]) == 2 and len(out["local_offset"]) == 2
    for bad in ((1.2, 1.5), (-0.5, -0.1), (0.6, 0.4)):
        with pytest.raises(ConfigError, match="center_height_scale"):
            check_config_domains(_config_with(dict(ok, center_height_scale=bad)))
        with pytest.raises(ConfigError, match="center_height_scale"):
            TRANSFORMS.build(dict(ok, center_height_scale=bad))


def test_a_centre_window_holding_no_point_is_one_line_naming_the_window():
    coord = np.zeros((20, 3), np.float32)
    coord[10:, 2] = 1.0  # two layers: nothing in the middle of the z extent
    gen = TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord",), center_height_scale=(0.4, 0.6)))
    with pytest.raises(UserError, match=r"MultiViewGenerator: no point .* center_height_scale=\(0.4, 0.6\)"):
        gen(dict(coord=coord))


def test_anchor_crops_are_centred_on_the_major_point_nearest_an_anchor():
    rng = np.random.default_rng(5)
    coord = rng.uniform(0, 10, size=(400, 3)).astype(np.float32)
    anchor = np.array([[2.0, 2.0, 2.0]], np.float32)
    data = dict(coord=coord, anchors=dict(endpoints=anchor, led=np.array([[9.0, 9.0, 9.0]], np.float32)))
    gen = TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord",), global_view_scale=(1.0, 1.0),
                                local_view_num=3, local_view_scale=(0.1, 0.1), anchor_bias_ratio=1.0,
                                anchor_radius_scale=1.0))
    np.random.seed(0)
    out = gen(data)
    nearest = coord[np.argmin(np.square(coord - anchor).sum(-1))]  # the first global crop is the whole event
    starts = np.r_[0, out["local_offset"][:-1]]
    for start, end in zip(starts, out["local_offset"]):
        view = out["local_coord"][start:end]
        assert len(view) == 40  # mean of the size draws (all 40) * radius_scale**3
        np.testing.assert_array_equal(view[0], nearest)  # the crop's centre comes first
    # led is never a centre; without usable anchors the crops are the plain ones
    only_led = TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord",), anchor_keys=("led",)))
    plain = TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord",)))
    np.random.seed(1)
    a = only_led(data)
    np.random.seed(1)
    b = plain(dict(coord=coord))
    np.testing.assert_array_equal(a["local_coord"], b["local_coord"])


def test_anchor_arguments_take_upstreams_values():
    for good in (dict(anchor_keys=()), dict(anchor_radius_scale=0.0), dict(anchor_bias_ratio=0.0),
                 dict(center_sampling_kwargs=dict(radius=0.1))):
        check_config_domains(_config_with(dict(type="MultiViewGenerator", **good)))
        TRANSFORMS.build(dict(type="MultiViewGenerator", **good))
    for bad in (dict(anchor_bias_ratio=1.5), dict(anchor_radius_scale=-1.0), dict(anchor_keys=[3])):
        with pytest.raises(ConfigError):
            check_config_domains(_config_with(dict(type="MultiViewGenerator", **bad)))
