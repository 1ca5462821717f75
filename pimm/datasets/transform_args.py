"""Argument checks and small shared pieces of the transforms ported from
upstream pimm (:mod:`~pimm.datasets.transforms_color`,
:mod:`~pimm.datasets.transforms_spatial`, :mod:`~pimm.datasets.transforms_crop`,
:mod:`~pimm.datasets.transforms_instance`, :mod:`~pimm.datasets.multiview_extra`).

A config's arguments are checked against each class's ``domains`` when the
config is resolved; :func:`check_args` applies the same declarations when a
transform is built directly (a script, a test, ``TRANSFORMS.build``), so a bad
value is one line naming the transform and the argument either way.

Random draws: these transforms draw from the same global streams as upstream
(Python's ``random``, NumPy's global generator, torch's for ``randperm``), in
the same order, so one seed gives upstream's augmentation. The engine seeds
and checkpoints all three (:mod:`pimm.utils.rng`), which keeps resume exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pimm.utils.config_domains import domains_of
from pimm.utils.errors import UserError

_AXIS_INDEX = {"x": 0, "y": 1, "z": 2}


def check_args(transform: Any, **args: Any) -> None:
    """Check ``args`` against ``type(transform)``'s declared domains and rules."""
    cls = type(transform)
    domains, rules = domains_of(cls)
    name = cls.__name__
    for key, value in args.items():
        if key in domains:
            domains[key](f"{name}.{key}", value)
    for rule in rules:
        rule.check(args, f"{name}.")


def rotation(axis: str, angle: float) -> np.ndarray:
    """The right-handed turn by ``angle`` (radians) about ``axis`` (upstream's matrices)."""
    c, s = np.cos(angle), np.sin(angle)
    i = _AXIS_INDEX[axis]
    j, k = (i + 1) % 3, (i + 2) % 3  # cyclic order: j turns towards k for a positive angle
    rot = np.eye(3)
    rot[j, j], rot[j, k], rot[k, j], rot[k, k] = c, -s, s, c
    return rot


def need(data: dict, key: str, owner: str) -> Any:
    if key not in data:
        raise UserError(f"{owner}: the event has no {key!r} (keys: {sorted(data)})")
    return data[key]


def float_copy(value: Any) -> np.ndarray:
    """A writable floating copy (float32 unless already floating)."""
    array = np.asarray(value)
    return np.array(array, dtype=array.dtype if array.dtype.kind == "f" else np.float32, copy=True)
