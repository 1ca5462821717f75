"""Geometric transforms move declared targets (vertex, primary vertex,
direction, momentum) with the points, and turn about y the right-handed way.

Every reference is worked out by hand; the consistency tests place points at
the targets and check the targets land where those points land."""

import numpy as np
import pytest

from pimm.datasets.transforms import NormalizeCoord, RandomFlip, RandomRotate, RandomScale, Update
from pimm.utils.errors import UserError

SENTINEL = [-1.0, -1.0, -1.0]


def tracked_event():
    """Points 0-1 sit at the two particle vertices, point 2 at the primary
    vertex, point 3 one unit along the primary direction from it; point 4's
    vertex and momentum are missing (-1 sentinel)."""
    direction = np.array([2.0, -1.0, 2.0]) / 3.0
    coord = np.array([[1.0, 2.0, 3.0], [4.0, 0.0, -2.0], [0.5, 1.5, 1.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
    coord[3] = coord[2] + direction
    vertex = coord[:4].copy().tolist() + [SENTINEL]
    momentum = [[0.0, 0.0, 2.5], [3.0, 4.0, 0.0], (2.0 * direction).tolist(), [1.0, 0.0, 0.0], SENTINEL]
    ev = dict(coord=coord.astype(np.float32), vertex=np.array(vertex, np.float32),
              primary_vertex=coord[2].astype(np.float32), primary_direction=direction.astype(np.float32),
              momentum_vec=np.array(momentum, np.float32), normal=np.tile(direction, (5, 1)).astype(np.float32))
    return Update(keys_dict=dict(aux_position_keys=["primary_vertex"], aux_direction_keys=["primary_direction"],
                                 aux_vector_keys=["momentum_vec"]))(ev)


def assert_consistent(out, ev, turns_directions):
    """Targets sit where the points placed on them went; directions stay unit,
    vectors keep their length; the sentinel rows stay -1."""
    np.testing.assert_allclose(out["vertex"][:4], out["coord"][:4], atol=1e-5)
    np.testing.assert_array_equal(out["vertex"][4], SENTINEL)
    np.testing.assert_array_equal(out["momentum_vec"][4], SENTINEL)
    np.testing.assert_allclose(out["primary_vertex"], out["coord"][2], atol=1e-5)
    assert abs(np.linalg.norm(out["primary_direction"]) - 1) < 1e-6
    np.testing.assert_allclose(np.linalg.norm(out["momentum_vec"][:4], axis=1),
                               np.linalg.norm(ev["momentum_vec"][:4], axis=1), rtol=1e-6)
    step = out["coord"][3] - out["coord"][2]
    if turns_directions:  # rotation / flip: the direction follows the points
        np.testing.assert_allclose(out["primary_direction"], step / np.linalg.norm(step), atol=1e-5)
        np.testing.assert_allclose(out["momentum_vec"][2], 2.0 * out["primary_direction"], atol=1e-5)
    else:  # centering / scale: upstream leaves directions and vectors as they are
        np.testing.assert_array_equal(out["primary_direction"], ev["primary_direction"])
        np.testing.assert_array_equal(out["momentum_vec"], ev["momentum_vec"])


def test_rotate_is_right_handed_about_every_axis():
    ev = dict(coord=np.eye(3, dtype=np.float32))  # rows: x, y, z unit points
    quarter = dict(angle=[0.5, 0.5], center=[0, 0, 0], always_apply=True)
    # A quarter turn about a takes the next axis (cyclically) to the one after: x: y->z, y: z->x, z: x->y.
    expected = {"x": [[1, 0, 0], [0, 0, 1], [0, -1, 0]],
                "y": [[0, 0, -1], [0, 1, 0], [1, 0, 0]],
                "z": [[0, 1, 0], [-1, 0, 0], [0, 0, 1]]}
    for axis, rows in expected.items():
        np.testing.assert_allclose(RandomRotate(axis=axis, **quarter)(ev)["coord"], rows, atol=1e-6, err_msg=axis)


def test_rotate_moves_every_target_by_hand():
    ev = tracked_event()
    # Half a quarter turn about y, around the point (1, 0, 1): (x, y, z) -> centre + R (p - centre).
    out = RandomRotate(angle=[0.25, 0.25], axis="y", center=[1, 0, 1], always_apply=True)(ev)
    c = s = np.sqrt(0.5)
    rot = np.array([[c, 0, s], [0, 1, 0], [-s, 0, c]])
    centre = np.array([1.0, 0, 1])
    np.testing.assert_allclose(out["coord"], (ev["coord"] - centre) @ rot.T + centre, atol=1e-6)
    np.testing.assert_allclose(out["primary_vertex"], rot @ (ev["primary_vertex"] - centre) + centre, atol=1e-6)
    np.testing.assert_allclose(out["primary_direction"], rot @ ev["primary_direction"], atol=1e-6)
    np.testing.assert_allclose(out["momentum_vec"][1], rot @ [3.0, 4.0, 0.0], atol=1e-6)  # (2.12, 4, -2.12)
    np.testing.assert_allclose(out["normal"][0], rot @ ev["normal"][0], atol=1e-6)
    assert_consistent(out, ev, turns_directions=True)
    for k in ("coord", "vertex", "momentum_vec", "primary_vertex"):
        assert out[k].dtype == np.float32, k
    np.testing.assert_array_equal(ev["vertex"][:4], ev["coord"][:4])  # the input is untouched


def test_flip_moves_every_target_by_hand():
    ev = tracked_event()
    out = RandomFlip(p=1.0, axes=("x", "z"))(ev)
    mirror = np.array([-1.0, 1.0, -1.0])
    for key in ("coord", "primary_vertex", "primary_direction", "normal"):
        np.testing.assert_allclose(out[key], ev[key] * mirror, err_msg=key)
    np.testing.assert_allclose(out["momentum_vec"][:4], ev["momentum_vec"][:4] * mirror)
    assert_consistent(out, ev, turns_directions=True)
    untouched = RandomFlip(p=0.0)(ev)
    for key in ("vertex", "primary_direction", "momentum_vec"):
        np.testing.assert_array_equal(untouched[key], ev[key])


def test_scale_moves_positions_only():
    ev = tracked_event()
    out = RandomScale(scale=[2.0, 2.0])(ev)
    np.testing.assert_allclose(out["primary_vertex"], [1.0, 3.0, 2.0])
    np.testing.assert_allclose(out["vertex"][1], [8.0, 0.0, -4.0])
    assert_consistent(out, ev, turns_directions=False)
    np.random.seed(3)  # random anisotropic factors: positions still follow the points
    assert_consistent(RandomScale(scale=[0.5, 1.5], anisotropic=True)(ev), ev, turns_directions=False)


def test_normalize_moves_positions_only():
    ev = tracked_event()
    out = NormalizeCoord(center=[0.5, 1.5, 1.0], scale=2.0)(ev)
    np.testing.assert_allclose(out["primary_vertex"], [0.0, 0.0, 0.0], atol=1e-7)
    np.testing.assert_allclose(out["vertex"][0], [0.25, 0.25, 1.0])
    assert_consistent(out, ev, turns_directions=False)
    for kwargs in (dict(), dict(center="box", mode="box")):  # the event's own centre and extent
        assert_consistent(NormalizeCoord(**kwargs)(ev), ev, turns_directions=False)


def test_random_draws_keep_targets_consistent():
    ev = tracked_event()
    np.random.seed(11)
    for _ in range(20):
        out = RandomRotate(axis=str(np.random.choice(list("xyz"))), p=1.0)(ev)
        assert_consistent(out, ev, turns_directions=True)
        assert_consistent(RandomFlip(p=0.5, axes=("x", "y", "z"))(out), ev, turns_directions=True)


def test_targets_declared_as_arguments_and_bad_targets():
    ev = tracked_event()
    bare = {k: v for k, v in ev.items() if not k.startswith("aux_")}
    out = RandomFlip(p=1.0, axes="y", aux_position_keys=["primary_vertex"], aux_direction_keys="primary_direction",
                     aux_vector_keys=("momentum_vec",))(bare)
    np.testing.assert_allclose(out["primary_vertex"], bare["primary_vertex"] * [1, -1, 1])
    np.testing.assert_allclose(out["momentum_vec"][1], [3.0, -4.0, 0.0])
    # Undeclared keys stay; vertex moves by default, as upstream.
    plain = RandomFlip(p=1.0, axes="y")(bare)
    np.testing.assert_array_equal(plain["primary_vertex"], bare["primary_vertex"])
    np.testing.assert_allclose(plain["vertex"][:4], plain["coord"][:4])
    # Declaring vertex again moves it once, not twice.
    twice = RandomScale(scale=[2.0, 2.0], aux_position_keys=["vertex"])(ev)
    np.testing.assert_allclose(twice["vertex"][:4], twice["coord"][:4])
    # A key the event declares but lacks is skipped (upstream); one the arguments name must exist.
    assert "extra" not in RandomFlip(p=1.0)(Update(keys_dict={"aux_vector_keys": ["extra"]})(bare))
    with pytest.raises(UserError, match="primary_vertx"):
        RandomRotate(p=1.0, aux_position_keys=["primary_vertx"])(bare)
    with pytest.raises(UserError, match="'momentum_vec'.*3 components"):
        RandomFlip(p=1.0, aux_vector_keys=["momentum_vec"])(dict(coord=bare["coord"], momentum_vec=np.ones((5, 2))))
    with pytest.raises(UserError, match="'primary_vertex' is declared both as a position and as a vector"):
        RandomScale(aux_vector_keys=["primary_vertex"])(ev)
    as_direction = RandomFlip(p=1.0, axes="x", aux_direction_keys=["vertex"])(bare)["vertex"]  # overrides the default
    np.testing.assert_allclose(np.linalg.norm(as_direction[:4], axis=1), 1.0, rtol=1e-6)
    with pytest.raises(UserError, match="strings"):
        RandomScale(aux_direction_keys=[3])
