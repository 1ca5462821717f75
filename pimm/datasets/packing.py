"""The last steps of a transform pipeline: :class:`ToTensor` (numpy to torch,
with upstream pimm's dtype rules) and :class:`Collect` (keep the model's keys,
build ``feat`` and the other feature groups)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.errors import UserError

from .point_dict import _keys
from pimm.utils.domains import DictOf, Key, Keys

__all__ = ["ToTensor", "Collect"]


@TRANSFORMS.register_module()
class ToTensor:
    """Convert to torch, recursing into dicts and lists: integer arrays become
    int64, floating arrays float32, boolean arrays stay boolean; a Python int
    or float becomes a 1-element tensor (upstream's rule). Strings, tensors and
    anything else pass through."""

    def __call__(self, data: Any) -> Any:
        if isinstance(data, torch.Tensor) or isinstance(data, str):
            return data
        if isinstance(data, np.ndarray) and data.dtype != object:
            tensor = torch.from_numpy(np.ascontiguousarray(data))
            if data.dtype.kind in "iu":
                return tensor.long()
            return tensor.float() if data.dtype.kind == "f" else tensor
        if isinstance(data, (bool, int, np.integer)):
            return torch.tensor([int(data)], dtype=torch.long)
        if isinstance(data, (float, np.floating)):
            return torch.tensor([float(data)], dtype=torch.float32)
        if isinstance(data, Mapping):
            return {k: self(v) for k, v in data.items()}
        if isinstance(data, (list, tuple)):
            return [self(v) for v in data]
        return data


@TRANSFORMS.register_module()
class Collect:
    """The last step: keep only ``keys``; for every other argument named
    ``<name>_keys``, concatenate those entries along dim 1 into ``<name>``
    (float32): ``feat_keys=("coord", "energy")`` builds a 4-channel ``feat``
    (1-D entries count as one column); and store the point count of each
    value of ``offset_keys_dict`` under its key (``{"origin_offset":
    "origin_coord"}``), which the collate function turns into cumulative
    offsets. Works on numpy arrays and tensors.

    ``offset_keys_dict=None`` (the default) means ``{"offset": "coord"}``, as
    upstream: every collected event carries its point count as ``offset``. A
    dict given replaces that default (upstream's rule), so ``{}`` collects no
    count; the collate functions build the batch ``offset`` from the points
    either way."""

    domains = dict(keys=Key | Keys, offset_keys_dict=DictOf(Key, Key) | None, feat_keys=Key | Keys)

    @classmethod
    def collected_keys(cls, args: dict) -> set[str]:
        """The keys of every event this config hands on, read from the config
        alone (a model checks the batch keys it trains on against them)."""
        offsets = {"offset": "coord"} if args.get("offset_keys_dict") is None else args["offset_keys_dict"]
        groups = {name[: -len("_keys")] for name, group in args.items() if name.endswith("_keys") and _keys(group)}
        return set(_keys(args.get("keys", ()))) | set(offsets) | groups

    def __init__(self, keys: Sequence[str] | str, offset_keys_dict: dict | None = None, **kwargs):
        self.keys = _keys(keys)
        self.offset_keys = {"offset": "coord"} if offset_keys_dict is None else dict(offset_keys_dict)
        self.groups = {}
        for name, group in kwargs.items():
            if not name.endswith("_keys"):
                raise UserError(f"Collect: unknown argument {name!r}; feature groups are named <name>_keys, "
                                "e.g. feat_keys=('coord', 'energy')")
            if _keys(group):
                self.groups[name[: -len("_keys")]] = _keys(group)

    def __call__(self, data: dict) -> dict:
        wanted = self.keys + tuple(self.offset_keys.values()) + tuple(k for g in self.groups.values() for k in g)
        missing = [k for k in dict.fromkeys(wanted) if k not in data]
        if missing:
            raise UserError(f"Collect: the event has no {missing} (available: {sorted(data)})")
        out = {k: data[k] for k in self.keys}
        for name, source in self.offset_keys.items():
            count = len(data[source])
            out[name] = torch.tensor([count]) if isinstance(data[source], torch.Tensor) else np.array([count])
        for name, group in self.groups.items():
            cols = [data[k] for k in group]
            if all(isinstance(c, torch.Tensor) for c in cols):
                out[name] = torch.cat([_as_columns(c).float() for c in cols], dim=1)
            else:
                out[name] = np.concatenate([_as_columns(np.asarray(c, dtype=np.float32)) for c in cols], axis=1)
        return out


def _as_columns(x):
    """(N,) -> (N,1); (N,a,b,...) -> (N,a*b*...); explicit so empty events work."""
    return x.reshape(x.shape[0], int(np.prod(x.shape[1:], dtype=np.int64)))
