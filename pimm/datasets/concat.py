"""``ConcatDataset``: several configured data sets read as one (upstream's).

The children are built from their configs and laid end to end: global index
``i`` is child ``k``'s local index ``i - start[k]`` (after ``i % total`` for
``loop``). Items pass through unchanged, so the keys are the children's. As
every child is map-style and reads an event as a pure function of its index,
the stateful sampler's position over the concatenation is the whole loading
state: exact mid-epoch resume needs nothing more.
"""

from __future__ import annotations

import bisect
import logging
from typing import Sequence

import numpy as np
from torch.utils.data import Dataset

from pimm.engines.registries import DATASETS
from pimm.utils.domains import PosInt, Registered, Seq
from pimm.utils.errors import ConfigError

__all__ = ["ConcatDataset"]

logger = logging.getLogger(__name__)


@DATASETS.register_module()
class ConcatDataset(Dataset):
    """The events of ``datasets`` (a list of data set configs), one after the other.

    Args:
        datasets: a non-empty list of ``dict(type=..., ...)`` data set configs.
        loop: repeat the concatenation this many times per epoch.

    ``collate_fn`` and ``class_names`` are the first child's (a trainer without
    its own collate function batches with it).
    """

    domains = dict(datasets=Seq(Registered("dataset"), min_len=1), loop=PosInt)

    def __init__(self, datasets: Sequence[dict], loop: int = 1):
        super().__init__()
        if not isinstance(datasets, (list, tuple)) or not datasets:
            raise ConfigError("ConcatDataset: datasets must be a non-empty list of dict(type=...) data set configs")
        if isinstance(loop, bool) or not isinstance(loop, int) or loop < 1:
            raise ConfigError(f"ConcatDataset: loop={loop!r} must be an integer >= 1")
        self.datasets = [DATASETS.build(cfg) if isinstance(cfg, dict) else cfg for cfg in datasets]
        sizes = [len(d) for d in self.datasets]
        empty = [i for i, n in enumerate(sizes) if n == 0]
        if empty:
            raise ConfigError(f"ConcatDataset: datasets[{empty[0]}] "
                              f"({type(self.datasets[empty[0]]).__name__}) has no events; remove it or fix its data")
        self.starts = [0] + list(np.cumsum(sizes)[:-1].tolist())
        self.total = int(sum(sizes))
        self.loop = loop
        first = self.datasets[0]
        for name in ("collate_fn", "class_names", "num_classes"):
            if hasattr(first, name):
                setattr(self, name, getattr(first, name))
        logger.info("ConcatDataset: %d events in %d data sets x loop %d", self.total, len(sizes), loop)

    def __len__(self) -> int:
        return self.total * self.loop

    def locate(self, idx: int) -> tuple[int, int]:
        """``(child, local index)`` of global index ``idx``."""
        idx = int(idx) % self.total
        child = bisect.bisect_right(self.starts, idx) - 1
        return child, idx - self.starts[child]

    def get_data_name(self, idx: int) -> str:
        child, local = self.locate(idx)
        dataset = self.datasets[child]
        if hasattr(dataset, "get_data_name"):
            return dataset.get_data_name(local)
        return f"{type(dataset).__name__}[{child}]_{local}"

    def __getitem__(self, idx: int):
        n = len(self)
        if not -n <= int(idx) < n:
            raise IndexError(f"event index {idx} out of range for a ConcatDataset of {n}")
        child, local = self.locate(int(idx) % n)
        return self.datasets[child][local]
