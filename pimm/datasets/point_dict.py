"""The per-point view of an event dict, shared by the transforms, voxel
down-sampling and packing modules: which entries are per point
(:func:`point_keys`), indexing them together (:func:`index_points`), and the
small argument helpers the transforms use. It imports none of those modules,
so each of them can import it."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pimm.utils.errors import UserError

__all__ = ["index_points", "point_keys"]

# Bookkeeping entries whose length may equal the point count by coincidence.
_NOT_PER_POINT = frozenset({"inverse", "index", "offset", "index_valid_keys"})


def _num_points(data: dict) -> int:
    if "coord" not in data:
        raise UserError(f"point transforms need a 'coord' entry; the event has {sorted(data)}")
    return len(data["coord"])


def point_keys(data: dict) -> list[str]:
    """The per-point entries of an event (the rule is in
    :mod:`pimm.datasets.transforms`' module doc)."""
    if "index_valid_keys" in data:
        return [k for k in data["index_valid_keys"] if k in data]
    n = _num_points(data)
    return [k for k, v in data.items()
            if isinstance(v, (np.ndarray, torch.Tensor)) and v.ndim >= 1 and len(v) == n
            and k not in _NOT_PER_POINT and not k.startswith("origin_")]


def index_points(data: dict, index: np.ndarray) -> dict:
    """A new event with every per-point entry indexed by ``index`` (select or
    reorder points); the other entries are shared."""
    out = dict(data)
    for key in point_keys(data):
        value = data[key]
        out[key] = value[torch.as_tensor(index)] if isinstance(value, torch.Tensor) else value[index]
    return out


def _keys(keys: Any) -> tuple:
    return tuple(keys) if isinstance(keys, (list, tuple)) else (keys,)


def _require(data: dict, key: str, owner: str) -> Any:
    if key not in data:
        raise UserError(f"{owner}: the event has no {key!r} (keys: {sorted(data)})")
    return data[key]
