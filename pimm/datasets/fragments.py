"""Test-time fragments: ``test_mode=True`` with ``test_cfg`` (upstream pimm's
data-set options), for any data set class.

In test mode a data set item is not one transformed event but a *test item*:
the event after the data set's own ``transform``, turned into several
*fragments* the model sees one by one, plus what is needed to score the
prediction on every original point:

* ``fragment_list``: the fragments. Each ``aug_transform`` entry (a list of
  transform configs; ``[[]]``, one pass without augmentation, when left out)
  is applied to a copy of the transformed event; ``voxelize``
  (``GridSample(mode="test")``) splits each copy into fragments that together
  hold every point; ``crop`` may cut each fragment further (a transform
  returning one event or a list); ``post_transform`` packs each one
  (``ToTensor``, ``Collect``). Every fragment carries ``index``: the rows of
  the transformed event it holds (tracked through reordering augmentations).
* ``origin_<key>`` for every per-point entry of the event as the data set
  read it (``origin_coord``, ``origin_segment``, ``origin_instance``, ...):
  the full-resolution points and labels;
* ``inverse``: for every original point, the row of the transformed event
  that stands for it. Points the ``transform`` merged (a train-mode
  ``GridSample``) map to the point kept for their cell -- exactly, through the
  ``GridSample``'s own ``inverse`` when it returns one and no later transform
  reorders points; else to the nearest kept point;
* ``transformed_points``, ``fragment_batch_size``, ``name``.

The testers (:mod:`pimm.evaluation.voting`) run the fragments, add up the
class probabilities of every transformed row over fragments and
augmentations, and carry them to the original points through ``inverse``, so
test metrics count every original point once.

``test_cfg`` keys: ``voxelize``, ``crop`` (transform configs or None),
``post_transform`` (a transform list), ``aug_transform`` (a list of transform
lists) and, a pimm addition, ``fragment_batch_size`` (fragments per model
call, default 1). Any other key is a one-line ``ConfigError`` naming it.

Using it in a data set class (``PointDataset`` does this for every pimm point
data set)::

    from pimm.datasets.fragments import TEST_CFG, build_test_item, fragments_for_test_mode

    class MyDataset(Dataset):
        domains = dict(test_cfg=TEST_CFG, ...)

        def __init__(self, ..., transform=None, test_mode=False, test_cfg=None):
            self.transform = Compose(transform) if transform else None
            self.test_fragments = fragments_for_test_mode(test_mode, test_cfg, type(self).__name__)

        def __getitem__(self, idx):
            data = self.get_data(idx)
            if self.test_fragments is not None:
                return build_test_item(data, self.transform, self.test_fragments)
            return self.transform(data) if self.transform else data

The point collate functions (:mod:`pimm.datasets.collate`) batch test items
as ``{"test_events": [...]}``, each event's fragments collated in groups of
``fragment_batch_size`` with the same collate function.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import Domain, Int, Registered, Seq, Transforms, show
from pimm.utils.errors import ConfigError

from .point_dict import point_keys

__all__ = ["TEST_CFG", "TEST_CFG_KEYS", "TestFragments", "fragments_for_test_mode", "build_test_item",
           "is_test_item"]

# Bookkeeping rows carried through transforms as ordinary per-point entries
# (the collate functions drop keys starting with "_").
_ORIGIN_ROW = "_test_origin_row"
_EVENT_ROW = "_test_event_row"

#: What each ``test_cfg`` key takes.
TEST_CFG_KEYS = {
    "voxelize": Registered("transform") | None,
    "crop": Registered("transform") | None,
    "post_transform": Transforms,
    "aug_transform": Seq(Seq(Registered("transform"), what="a list of transform configs"), min_len=1,
                         what="a non-empty list of transform lists ([[]]: no augmentation)") | None,
    "fragment_batch_size": Int(1, 4096) | None,
}


class _TestCfg(Domain):
    """``test_cfg``: a dict of the keys in :data:`TEST_CFG_KEYS` (or None)."""

    what = f"None or a dict with keys {', '.join(TEST_CFG_KEYS)}"

    def accepts(self, value):
        return value is None or (isinstance(value, dict) and set(value) <= set(TEST_CFG_KEYS)
                                 and all(TEST_CFG_KEYS[k].accepts(v) for k, v in value.items()))

    def __call__(self, key: str, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={show(value)} is invalid: it takes {self.what}")
        for name, item in value.items():
            if name not in TEST_CFG_KEYS:
                raise ConfigError(f"{key}.{name} is not a test_cfg key; test_cfg takes "
                                  f"{', '.join(TEST_CFG_KEYS)}")
            TEST_CFG_KEYS[name](f"{key}.{name}", item)
        return value


#: The domain of a data set's ``test_cfg`` argument.
TEST_CFG = _TestCfg()


def _build(cfg: Any) -> Callable | None:
    if cfg is None:
        return None
    if callable(cfg):
        return cfg
    return TRANSFORMS.build(cfg)


def _compose(cfgs: Any) -> Callable | None:
    from .transforms import Compose  # the transforms module imports torch helpers: only when testing

    return Compose(cfgs) if cfgs else None


class TestFragments:
    """The fragments of one transformed event, built from a ``test_cfg`` dict
    (see the module doc); ``owner`` names the data set in errors."""

    __test__ = False  # not a pytest class

    def __init__(self, test_cfg: dict, owner: str = "test_cfg"):
        TEST_CFG(f"{owner}.test_cfg", test_cfg)
        cfg = dict(test_cfg)
        self.voxelize = _build(cfg.get("voxelize"))
        self.crop = _build(cfg.get("crop"))
        self.post_transform = _compose(cfg.get("post_transform"))
        augs = cfg.get("aug_transform") or [[]]
        self.aug_transform = [_compose(aug) for aug in augs]
        self.fragment_batch_size = int(cfg.get("fragment_batch_size") or 1)

    def __call__(self, event: dict) -> list[dict]:
        """Fragments of ``event`` (one transformed event), each with ``index``."""
        n = len(event["coord"])
        event = _with_row(event, _EVENT_ROW, np.arange(n))
        fragments = []
        for number, aug in enumerate(self.aug_transform):
            view = aug(copy.deepcopy(event)) if aug is not None else copy.deepcopy(event)
            _check_rows(view, _EVENT_ROW, f"test_cfg.aug_transform[{number}]")
            parts = self.voxelize(view) if self.voxelize is not None else view
            for part in parts if isinstance(parts, list) else [parts]:
                _check_rows(part, _EVENT_ROW, "test_cfg.voxelize")
                crops = self.crop(part) if self.crop is not None else part
                for piece in crops if isinstance(crops, list) else [crops]:
                    _check_rows(piece, _EVENT_ROW, "test_cfg.crop")
                    fragments.append(self._pack(piece))
        return fragments

    def _pack(self, piece: dict) -> dict:
        rows = np.asarray(piece.pop(_EVENT_ROW), dtype=np.int64)
        if "index_valid_keys" in piece:
            piece["index_valid_keys"] = [k for k in piece["index_valid_keys"] if k != _EVENT_ROW]
        piece["index"] = rows  # Collect(keys=(..., "index")) in upstream configs keeps it
        if self.post_transform is not None:
            piece = self.post_transform(piece)
        count = _count(piece)
        if count is not None and count != len(rows):
            raise ConfigError(f"test_cfg.post_transform changed a fragment's point count ({len(rows)} -> {count}); "
                              "drop or reorder points in voxelize/crop, not in post_transform")
        piece["index"] = torch.from_numpy(rows) if isinstance(piece.get("coord", piece.get("feat")),
                                                              torch.Tensor) else rows
        return piece


def fragments_for_test_mode(test_mode: bool, test_cfg: Any, owner: str) -> TestFragments | None:
    """What a data set's ``test_mode`` / ``test_cfg`` arguments mean: None (items
    are plain transformed events) unless ``test_mode``, which needs ``test_cfg``.
    A ``test_cfg`` without ``test_mode`` is ignored, as upstream does."""
    if not isinstance(test_mode, bool):
        raise ConfigError(f"{owner}: test_mode must be True or False, got {show(test_mode)}")
    TEST_CFG(f"{owner}.test_cfg", test_cfg)
    if not test_mode:
        return None
    if test_cfg is None:
        raise ConfigError(f"{owner}: test_mode=True needs test_cfg=dict(voxelize=..., post_transform=[...], "
                          "aug_transform=[[]]) describing the test fragments")
    return TestFragments(test_cfg, owner)


def is_test_item(sample: Any) -> bool:
    """Whether ``sample`` is a test item (see the module doc)."""
    return isinstance(sample, dict) and "fragment_list" in sample


def build_test_item(event: dict, transform: Callable | None, fragments: TestFragments) -> dict:
    """The test item of one event as the data set read it (full resolution):
    ``transform`` (the data set's own, may be None) then ``fragments``."""
    n = len(event["coord"])
    origin = {f"origin_{k}": np.asarray(event[k]) for k in point_keys(event)}
    data = _with_row(event, _ORIGIN_ROW, np.arange(n))
    data = transform(data) if transform is not None else data
    if isinstance(data, list):
        raise ConfigError("the data set's transform returned several events (a GridSample with mode='test'?); "
                          "in test mode put the test-time voxelisation in test_cfg.voxelize")
    _check_rows(data, _ORIGIN_ROW, "the data set's transform")
    kept = np.asarray(data.pop(_ORIGIN_ROW), dtype=np.int64)
    inverse = _origin_inverse(kept, data.pop("inverse", None), origin["origin_coord"])
    event_only = {k: v for k, v in data.items() if not k.startswith("origin_")}
    if "index_valid_keys" in event_only:
        event_only["index_valid_keys"] = [k for k in event_only["index_valid_keys"] if k != _ORIGIN_ROW]
    return dict(fragment_list=fragments(event_only), inverse=inverse, transformed_points=len(kept),
                fragment_batch_size=fragments.fragment_batch_size, name=event.get("name", ""), **origin)


def _with_row(event: dict, key: str, rows: np.ndarray) -> dict:
    out = dict(event)
    out[key] = rows
    if "index_valid_keys" in out and key not in out["index_valid_keys"]:
        out["index_valid_keys"] = list(out["index_valid_keys"]) + [key]
    return out


def _count(event: dict) -> int | None:
    for key in ("coord", "grid_coord", "feat"):
        if key in event:
            return len(event[key])
    return None


def _check_rows(event: Any, key: str, stage: str) -> None:
    if not isinstance(event, dict):
        raise ConfigError(f"{stage} returned {type(event).__name__}, not an event dict (or a list of them)")
    if key not in event or "coord" not in event:
        raise ConfigError(f"{stage} packs the event (Collect/ToTensor?); in test mode pack the fragments in "
                          "test_cfg.post_transform instead")
    if len(event[key]) != len(event["coord"]):
        raise ConfigError(f"{stage} lost track of which points it kept (an Update of index_valid_keys that "
                          "leaves out entries?); test mode needs every per-point entry kept aligned")


def _origin_inverse(kept: np.ndarray, grid_inverse: Any, origin_coord: np.ndarray) -> np.ndarray:
    """For every original point, the transformed row standing for it. ``kept``:
    the original row of every transformed row; ``grid_inverse``: a train-mode
    GridSample's ``inverse`` (used when it describes these rows)."""
    n, m = len(origin_coord), len(kept)
    if grid_inverse is not None:
        grid_inverse = np.asarray(grid_inverse, dtype=np.int64).reshape(-1)
        if (len(grid_inverse) == n and m and grid_inverse.min(initial=0) >= 0 and grid_inverse.max() < m
                and np.array_equal(grid_inverse[kept], np.arange(m))):
            return grid_inverse
    inverse = np.full(n, -1, dtype=np.int64)
    inverse[kept] = np.arange(m)
    dropped = np.flatnonzero(inverse < 0)
    if len(dropped):
        if m == 0:
            raise ConfigError("the data set's transform removed every point of an event; "
                              "a test event needs at least one point")
        # Row j of origin_coord[kept] is transformed row j.
        inverse[dropped] = _nearest(origin_coord[dropped], origin_coord[kept])
    return inverse


def _nearest(queries: np.ndarray, points: np.ndarray, budget: int = 1 << 24) -> np.ndarray:
    """Index into ``points`` of the nearest one to each query (Euclidean), in
    blocks of at most ``budget`` distances."""
    q = torch.as_tensor(np.asarray(queries, dtype=np.float64))
    p = torch.as_tensor(np.asarray(points, dtype=np.float64))
    step = max(1, budget // max(len(p), 1))
    return torch.cat([torch.cdist(q[i:i + step], p).argmin(dim=1) for i in range(0, len(q), step)]).numpy()
