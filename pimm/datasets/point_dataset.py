"""Shared base for map-style point-cloud datasets.

Every point dataset in pimm returns one event as a dict of numpy arrays
(``coord`` (N,3) float32, ``energy`` (N,1) float32, ``segment`` / ``instance``
/ ``interaction`` (N,) int64, plus ``name`` and ``index`` metadata) and then
passes it through an optional transform pipeline. The base class owns that
common part -- index checking, split validation, building the ``Compose`` from
config dicts, the default collate function, upstream's ``test_mode`` /
``test_cfg`` test fragments (:mod:`pimm.datasets.fragments`) -- so the
generator and the HDF5 reader only implement :meth:`PointDataset.get_data`.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.utils.data import Dataset

from pimm.utils.errors import UserError

from .collate import collate_fn
from .fragments import TEST_CFG, build_test_item, fragments_for_test_mode

__all__ = ["PointDataset", "SPLITS", "SEGMENT_CLASSES"]

#: Split names accepted by every point dataset (their position is the split code).
SPLITS = ("train", "val", "test")

#: Semantic classes of LArTPC point clouds (the PILArNet convention).
SEGMENT_CLASSES = ("shower", "track", "michel", "delta", "low_energy")


class PointDataset(Dataset):
    """Map-style dataset of point-cloud events with an optional transform.

    Args:
        split: one of ``SPLITS``.
        transform: ``None`` or a list of transform configs
            (``dict(type="GridSample", ...)``) or callables, applied in order.
        test_mode: items are test items (the fragments of one event and its
            full-resolution points, see :mod:`pimm.datasets.fragments`).
        test_cfg: the fragments' recipe (``voxelize``, ``crop``,
            ``post_transform``, ``aug_transform``); read only in test mode.

    ``collate_fn`` is the batching a trainer uses when its config names none:
    events are variable-size, so torch's default stacking cannot batch them.
    """

    collate_fn = staticmethod(collate_fn)
    domains = dict(test_cfg=TEST_CFG)

    def __init__(self, split: str = "train", transform: Sequence[Any] | None = None, test_mode: bool = False,
                 test_cfg: dict | None = None):
        if split not in SPLITS:
            raise UserError(f"split={split!r} is not supported; use one of {', '.join(SPLITS)}")
        self.split = split
        self.transform = None
        if transform:
            # Imported here so that the transforms module (which imports torch
            # helpers) is only needed by datasets that actually transform.
            from .transforms import Compose

            self.transform = Compose(transform)
        self.test_mode = test_mode
        self.test_fragments = fragments_for_test_mode(test_mode, test_cfg, type(self).__name__)

    def __len__(self) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def get_data(self, idx: int) -> dict:
        """Return the raw event ``idx`` (0 <= idx < len(self)) as a dict."""
        raise NotImplementedError  # pragma: no cover - abstract

    def __getitem__(self, idx: int) -> dict:
        n = len(self)
        idx = int(idx)
        if idx < 0:
            idx += n
        if not 0 <= idx < n:
            raise IndexError(f"event index {idx} out of range for a dataset of {n} events")
        data = self.get_data(idx)
        if self.test_fragments is not None:
            return build_test_item(data, self.transform, self.test_fragments)
        if self.transform is not None:
            data = self.transform(data)
        return data
