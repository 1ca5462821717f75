"""Plain numeric values in a hook's state, kept as data in a checkpoint.

A hook's ``state_dict()`` often holds what any Python code keeps: a NumPy
array of running statistics, a ``np.float64`` best score, a ``deque`` of the
last losses. Pickled as they are, they name NumPy's or ``collections``'
reconstructors, which a checkpoint loaded as data (``weights_only=True``,
:mod:`pimm.engines.state.safe_load`) refuses. :func:`encode` writes each of
them as a tagged dict of plain values (an array's dtype, shape and bytes; a
deque's items and ``maxlen``; a frozenset's items) and :func:`decode` builds
the same value back, so the hook gets what it saved. Nothing else is
touched: an arbitrary object stays what it is, and a save still warns about
it and a resume still refuses it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any

import numpy as np

from pimm.utils.errors import CheckpointError

__all__ = ["TAG", "encode", "decode"]

#: The key that marks an encoded value (a hook's own dict never uses it).
TAG = "__pimm_value__"
# Array and scalar dtypes kept as raw bytes: numbers, booleans, times, fixed-width text.
_RAW_KINDS = frozenset("biufcmMSU")


def _raw(dtype: np.dtype) -> bool:
    return dtype.kind in _RAW_KINDS and dtype.fields is None and dtype.subdtype is None


def encode(value: Any) -> Any:
    """``value`` with its NumPy arrays and scalars, deques and frozensets (at any
    depth of dicts, lists and tuples) as tagged plain dicts; ``value`` itself
    when there is none."""
    if isinstance(value, np.ndarray) and _raw(value.dtype):
        return {TAG: "numpy.ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                "data": np.ascontiguousarray(value).tobytes()}
    if isinstance(value, np.generic) and _raw(value.dtype):
        return {TAG: "numpy.scalar", "dtype": value.dtype.str, "data": value.tobytes()}
    if isinstance(value, deque):
        return {TAG: "deque", "items": [encode(v) for v in value], "maxlen": value.maxlen}
    if type(value) is frozenset:
        return {TAG: "frozenset", "items": [encode(v) for v in value]}
    if type(value) in (dict, OrderedDict):
        items = {k: encode(v) for k, v in value.items()}
        if all(items[k] is value[k] for k in value):
            return value
        return items if type(value) is dict else OrderedDict(items)
    if type(value) in (list, tuple):
        items = [encode(v) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if type(value) is list else tuple(items)
    return value


def decode(value: Any, where: str = "a hook's state") -> Any:
    """The values :func:`encode` wrote, built back (``where`` names the state in errors)."""
    if type(value) in (dict, OrderedDict):
        if TAG in value:
            return _build(value, where)
        items = {k: decode(v, where) for k, v in value.items()}
        return items if type(value) is dict else OrderedDict(items)
    if type(value) in (list, tuple):
        items = [decode(v, where) for v in value]
        return items if type(value) is list else tuple(items)
    return value


def _build(value: dict, where: str) -> Any:
    kind = value[TAG]
    try:
        if kind in ("numpy.ndarray", "numpy.scalar"):
            dtype = np.dtype(value["dtype"])
            if not _raw(dtype):
                raise ValueError(f"dtype {value['dtype']!r} is not a plain one")
            flat = np.frombuffer(value["data"], dtype=dtype)
            if kind == "numpy.scalar":
                return flat[0]
            return flat.reshape([int(n) for n in value["shape"]]).copy()
        if kind == "deque":
            return deque((decode(v, where) for v in value["items"]), maxlen=value["maxlen"])
        if kind == "frozenset":
            return frozenset(decode(v, where) for v in value["items"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise CheckpointError(f"{where}: a saved {kind} value is damaged ({err}); resume from an earlier "
                              "checkpoint of the run") from None
    raise CheckpointError(f"{where}: unknown saved value kind {kind!r} (written by a newer pimm?); resume with the "
                          "pimm that wrote the checkpoint")
