"""Checks a reader runs on each event it reads, so damaged data is one line
naming the file, the event and the key when the event is read -- not a NaN
loss, a CUDA assert or an index error at batch N, and never a silent wrong
result.

Each check is a pass over arrays the reader has just decoded, with a fast
path for the common case (one reduction, no temporary arrays); only a
failing event pays for finding the first bad row.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from pimm.utils.errors import UserError

__all__ = ["check_finite", "check_labels"]


def _row(array: np.ndarray, flat_index: int) -> str:
    if array.ndim <= 1:
        return f"row {flat_index}"
    return f"row {flat_index // int(np.prod(array.shape[1:]))}"


def check_finite(values, what: str) -> None:
    """Refuse NaN or infinite entries in ``values``; ``what`` names the file,
    the event and the key (``"a.h5, event 3, key 'coord'"``)."""
    array = np.asarray(values)
    if array.dtype.kind not in "fc" or array.size == 0:
        return
    # A finite sum means every entry is finite (NaN and inf both propagate);
    # a sum that overflows is told apart by the exact check below. Summing in
    # the array's own dtype is the fast path (a contiguous array: ~2 ns a value).
    if np.isfinite(np.add.reduce(array, axis=None)):
        return
    bad = np.flatnonzero(~np.isfinite(array.reshape(-1)))
    if bad.size:
        first = int(bad[0])
        raise UserError(f"{what} holds {array.reshape(-1)[first]} at {_row(array, first)} ({bad.size} non-finite "
                        "value(s)); fix the data or drop the event")


def check_labels(labels, what: str, num_classes: int | None = None, allowed: Iterable[int] = (-1,)) -> None:
    """Refuse labels outside ``[0, num_classes)`` (any non-negative value when
    ``num_classes`` is None) that are not one of ``allowed`` (the ignore index)."""
    array = np.asarray(labels)
    if array.size == 0:
        return
    low, high = array.min(), array.max()
    if low >= 0 and (num_classes is None or high < num_classes):
        return
    allowed = sorted({int(v) for v in allowed})
    valid = (array >= 0) & (array < num_classes) if num_classes is not None else array >= 0
    bad = np.flatnonzero(~(valid | np.isin(array, allowed)).reshape(-1))
    if bad.size:
        first = int(bad[0])
        span = f"0..{num_classes - 1}" if num_classes is not None else "non-negative"
        ignore = f" or the ignore index {', '.join(map(str, allowed))}" if allowed else ""
        raise UserError(f"{what} holds label {array.reshape(-1)[first]} at {_row(array, first)}; labels are {span}"
                        f"{ignore} ({bad.size} outside); fix the data, or ignore_index if that value means "
                        "'unlabelled'")
