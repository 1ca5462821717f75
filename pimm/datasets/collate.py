"""Batching of variable-size point-cloud events into one flat batch.

Point models in pimm take all points of a batch concatenated along dim 0 and
an ``offset`` tensor ``(B,)`` holding the cumulative end index of each event
(``offset[-1] == N``), instead of padding to the largest event. The functions
here build that layout from a list of per-event dicts and are registered in
``COLLATE_FNS`` under their function names:

* :func:`collate_fn` -- plain concatenation.
* :func:`point_collate_fn` -- Mix3D-style event mixing on top: with
  probability ``mix_prob`` pairs of consecutive events are merged into one by
  dropping every other offset (the points do not move; only the event
  boundaries do). Bind the probability with
  ``functools.partial(point_collate_fn, mix_prob=0.8)``.
* :func:`inseg_collate_fn` -- for instance segmentation: instance ids are made
  unique across the batch and ``num_instances`` is added; ``mix_prob`` mixes
  events as above (instances stay distinct).

* :func:`fallback_collate_fn` -- what a trainer uses for a data set that
  names no batching (a plain ``torch.utils.data.Dataset``, upstream's
  ``add_dataset.md`` example) and a config that names none: point events
  (dicts with ``coord``, ``grid_coord`` or ``feat``) are concatenated by
  :func:`collate_fn`, as upstream's trainer batches every data set; anything
  else goes to torch's ``default_collate``.

With ``mix_prob`` set, a trainer whose train collate is the plain
:func:`collate_fn` (a point data set's default) uses :func:`point_collate_fn`
in its place (its ``mixing`` attribute).

Test items (a data set in ``test_mode``, :mod:`pimm.datasets.fragments`) are
batched by each of them as ``{"test_events": [event, ...]}``: per event its
fragments collated with that same function in groups of
``fragment_batch_size`` (``fragments``), and its full-resolution entries
(``origin_*``, ``inverse``) as tensors.

Each carries :func:`split_point_batch` as its ``split_batch`` attribute: the
splitter the trainer's OOM back-off (``train.oom_backoff``) uses to redo a
batch that did not fit in memory in parts made of whole events.

Values are handled by kind: arrays/tensors with a leading dimension are
concatenated along dim 0 (per-point data, or per-event vectors that then
line up by event), 0-d tensors and Python/numpy numbers are stacked into a
``(B,)`` tensor, strings and other objects are gathered in a list. As in
upstream pimm, every key containing ``offset`` holds per-event point counts
(``Collect`` writes them; cumulative ones are turned back into counts) and
comes out cumulative over the batch -- ``offset`` itself is always the
cumulative point count -- and keys starting with ``_`` are left out. A
multi-view event (``MultiViewGenerator``: ``global_offset``, ``local_offset``
and no ``coord`` / ``grid_coord`` / ``feat``) gets no ``offset``: its view
offsets are the batch layout.
"""

from __future__ import annotations

import bisect
import numbers
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate

from pimm.engines.optim.oom_backoff import split_by_leading_dim
from pimm.engines.registries import COLLATE_FNS
from pimm.utils.domains import Prob

__all__ = ["collate_fn", "point_collate_fn", "inseg_collate_fn", "fallback_collate_fn", "split_point_batch",
           "collate_test_items"]


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.from_numpy(np.ascontiguousarray(value))


def _collate_values(values: list) -> Any:
    first = values[0]
    if isinstance(first, (torch.Tensor, np.ndarray)) and first.ndim >= 1:
        return torch.cat([_as_tensor(v) for v in values], dim=0)
    if isinstance(first, (torch.Tensor, np.ndarray, np.generic)) or (
        isinstance(first, numbers.Number) and not isinstance(first, bool)
    ):
        return torch.stack([torch.as_tensor(np.asarray(v) if not isinstance(v, torch.Tensor) else v)
                            for v in values])
    if isinstance(first, bool):
        return torch.tensor(values)
    return list(values)


def _point_count(sample: dict) -> int:
    for key in ("coord", "grid_coord", "feat"):
        if key in sample:
            return len(sample[key])
    raise KeyError(f"cannot tell the number of points of an event with keys {sorted(sample)}; "
                   "it needs 'coord', 'grid_coord' or 'feat'")


def _offset_counts(value: Any) -> torch.Tensor:
    """Per-event counts from an ``*offset*`` entry (a count, or cumulative ends)."""
    ends = _as_tensor(np.asarray(value) if not isinstance(value, torch.Tensor) else value).reshape(-1).long()
    return torch.diff(ends, prepend=ends.new_zeros(1))


def collate_test_items(batch: Sequence[dict], collate) -> dict:
    """A batch of test items (see the module doc); ``collate`` batches fragments."""
    events = []
    for item in batch:
        fragments, size = item["fragment_list"], int(item.get("fragment_batch_size", 1))
        event = {k: _as_tensor(v) if isinstance(v, np.ndarray) else v for k, v in item.items()
                 if k not in ("fragment_list", "fragment_batch_size")}
        event["fragments"] = [collate(fragments[i:i + size]) for i in range(0, len(fragments), size)]
        events.append(event)
    return {"test_events": events}


def _is_test_batch(batch: Sequence) -> bool:
    return bool(batch) and isinstance(batch[0], dict) and "fragment_list" in batch[0]


@COLLATE_FNS.register_module()
def collate_fn(batch: Sequence[dict]) -> dict:
    """Concatenate a list of events into one batch dict with ``offset``."""
    if not batch:
        raise ValueError("collate_fn got an empty batch")
    if _is_test_batch(batch):
        return collate_test_items(batch, collate_fn)
    if not isinstance(batch[0], dict):
        raise TypeError(f"collate_fn expects a list of dicts, got a list of {type(batch[0]).__name__}")
    keys = list(batch[0])
    for i, sample in enumerate(batch[1:], start=1):
        if set(sample) != set(keys):
            raise KeyError(f"event {i} of the batch has keys {sorted(sample)}, event 0 has {sorted(keys)}")
    out = {}
    for key in keys:
        if key == "offset" or key.startswith("_"):
            continue
        values = [sample[key] for sample in batch]
        if "offset" in key:
            out[key] = torch.cumsum(torch.cat([_offset_counts(v) for v in values]), dim=0)
        else:
            out[key] = _collate_values(values)
    if any(k.endswith("_offset") for k in keys) and not any(k in keys for k in ("coord", "grid_coord", "feat")):
        return out  # multi-view events (MultiViewGenerator): each view kind has its own offsets
    counts = torch.tensor([_point_count(sample) for sample in batch], dtype=torch.long)
    out["offset"] = torch.cumsum(counts, dim=0)
    return out


def _mix_pairs(out: dict, shift_instances: bool) -> dict:
    """Merge events 0+1, 2+3, ... of a collated batch (an odd last event stays
    alone) by dropping every other ``offset`` boundary; the points do not move.
    ``shift_instances``: shift each second event's non-negative ``instance``
    ids past the first one's (its max + 1) so the merged event keeps its
    particles apart (not needed when ids are already unique in the batch).
    ``num_instances`` (per event) is summed over each pair."""
    offset = out["offset"]
    if shift_instances and isinstance(out.get("instance"), torch.Tensor):
        instance = out["instance"].clone()
        starts = torch.cat([offset.new_zeros(1), offset[:-1]]).tolist()
        for first in range(0, len(offset) - 1, 2):
            a, b, c = starts[first], int(offset[first]), int(offset[first + 1])
            head = instance[a:b]
            shift = int(head.max()) + 1 if head.numel() and int(head.max()) >= 0 else 0
            tail = instance[b:c]
            instance[b:c] = torch.where(tail >= 0, tail + shift, tail)
        out["instance"] = instance
    merged = offset[1::2]
    if len(offset) % 2 == 1:
        merged = torch.cat([merged, offset[-1:]])
    out["offset"] = merged
    counts = out.get("num_instances")
    if isinstance(counts, torch.Tensor) and len(counts) == len(offset):
        pairs = counts[: len(counts) // 2 * 2].view(-1, 2).sum(1)
        out["num_instances"] = torch.cat([pairs, counts[len(pairs) * 2:]])
    return out


@COLLATE_FNS.register_module(domains=dict(mix_prob=Prob))
def point_collate_fn(batch: Sequence[dict], mix_prob: float = 0.0) -> dict:
    """:func:`collate_fn`, then with probability ``mix_prob`` (global numpy
    RNG) merge events 0+1, 2+3, ... into single events (an odd last event
    stays alone; upstream's Mix3D-style mixing). The points do not move:
    ``offset`` loses every other boundary, and the non-negative ``instance``
    ids of each second event are shifted past the first one's (its max + 1;
    upstream shifts by the max, which merges two instances) so a merged event
    never has two particles with one id. Per-event entries such as ``name``
    keep one element per original event."""
    if _is_test_batch(batch):
        return collate_test_items(batch, collate_fn)  # test fragments are never mixed
    out = collate_fn(batch)
    if mix_prob > 0 and np.random.rand() < mix_prob:
        out = _mix_pairs(out, shift_instances=True)
    return out


@COLLATE_FNS.register_module(domains=dict(mix_prob=Prob))
def inseg_collate_fn(batch: Sequence[dict], mix_prob: float = 0.0) -> dict:
    """:func:`collate_fn` with batch-unique instance ids.

    Each event's non-negative ``instance`` ids are shifted past those of the
    events before it (by the running sum of ``max id + 1``); ``-1`` (ignore)
    stays ``-1``. Adds ``num_instances`` (B,) int64 = ``max id + 1`` per
    event (0 when it has none). With probability ``mix_prob`` (global numpy
    RNG) events are then mixed in pairs as by :func:`point_collate_fn`: the
    ids being unique in the batch, a merged event keeps every instance apart,
    and its ``num_instances`` is the pair's sum."""
    if _is_test_batch(batch):
        # Fragments without instance labels (a test Collect need not keep them) collate plainly.
        return collate_test_items(batch, lambda parts: inseg_collate_fn(parts) if all(
            "instance" in part for part in parts) else collate_fn(parts))
    shifted, num_instances, base = [], [], 0
    for sample in batch:
        if "instance" not in sample:
            raise KeyError(f"inseg_collate_fn needs an 'instance' entry in every event; got {sorted(sample)} "
                           "(list 'instance' in Collect(keys=...))")
        inst = _as_tensor(sample["instance"]).long()
        n_inst = int(inst.max()) + 1 if inst.numel() and int(inst.max()) >= 0 else 0
        sample = dict(sample)
        sample["instance"] = torch.where(inst >= 0, inst + base, inst)
        shifted.append(sample)
        num_instances.append(n_inst)
        base += n_inst
    out = collate_fn(shifted)
    out["num_instances"] = torch.tensor(num_instances, dtype=torch.long)
    if mix_prob > 0 and np.random.rand() < mix_prob:
        out = _mix_pairs(out, shift_instances=False)
    return out


def split_point_batch(batch: dict, parts: int) -> list[tuple[dict, int]]:
    """Split a collated point-cloud batch into at most ``parts`` batches of whole
    events (contiguous, balanced by point count), each with its point count as
    its weight (point models average their losses over points).

    By the leading dimension of each tensor: the point count N -> per-point,
    sliced by ``offset``; the event count B -> per-event, sliced by event;
    the total of another ``*offset*`` key -> sliced by that key's events. Every
    ``*offset*`` key is re-based to start at 0 in each part, lists of B items
    are sliced by event, and anything else (0-d tensors, other values) goes to
    every part. A tensor that fits none of these is a ValueError, as is an
    ambiguous one (N == B with events of other than one point)."""
    offset = batch.get("offset")
    if not isinstance(offset, torch.Tensor) or offset.ndim != 1 or len(offset) == 0:
        raise ValueError("split_point_batch needs a batch with a 1-D cumulative 'offset' tensor")
    ends = offset.long()
    num_events, num_points = len(ends), int(ends[-1])
    if num_points == num_events and not torch.equal(ends, torch.arange(1, num_events + 1, device=ends.device)):
        raise ValueError(f"the batch has as many points as events ({num_points}): per-point and per-event "
                         "entries cannot be told apart")
    other_offsets = {key: value.long() for key, value in batch.items()
                     if "offset" in key and key != "offset" and isinstance(value, torch.Tensor)
                     and value.ndim == 1 and len(value) == num_events}
    # Part k ends at the event boundary nearest to k/parts of the points; every part keeps at least one event.
    bounds = [0] + ends.tolist()  # bounds[e]: points before event e
    cuts = {0, num_events}
    for k in range(1, parts):
        target = num_points * k / parts
        after = min(max(bisect.bisect_left(bounds, target), 1), num_events - 1)  # first boundary >= target
        cuts.add(after - 1 if after > 1 and target - bounds[after - 1] < bounds[after] - target else after)
    cuts = sorted(cuts) if num_events > 1 else [0, num_events]
    out = []
    for first, last in zip(cuts, cuts[1:]):  # events [first, last)
        start = int(ends[first - 1]) if first else 0
        end = int(ends[last - 1])
        part = {}
        for key, value in batch.items():
            if key == "offset" or key in other_offsets:
                cumulative = ends if key == "offset" else other_offsets[key]
                base = cumulative[first - 1] if first else 0
                part[key] = (cumulative[first:last] - base).to(value.dtype)
            elif isinstance(value, torch.Tensor) and value.ndim > 0:
                part[key] = _slice_entry(key, value, (start, end, num_points), (first, last, num_events),
                                         other_offsets)
            elif isinstance(value, (list, tuple)) and len(value) == num_events:
                part[key] = value[first:last]
            else:
                part[key] = value
        out.append((part, end - start))
    return out


def _slice_entry(key, value, points, events, other_offsets) -> torch.Tensor:
    (start, end, num_points), (first, last, num_events) = points, events
    size = len(value)
    if size == num_points:
        return value[start:end]
    if size == num_events:
        return value[first:last]
    for cumulative in other_offsets.values():
        if size == int(cumulative[-1]):
            lo = int(cumulative[first - 1]) if first else 0
            return value[lo:int(cumulative[last - 1])]
    raise ValueError(f"entry {key!r} has {size} rows, neither the {num_points} points nor the {num_events} events "
                     "of the batch (nor the total of another *offset* entry)")


_POINT_KEYS = ("coord", "grid_coord", "feat")


def _is_point_batch(batch: Sequence) -> bool:
    """Point events, multi-view events (``*_offset`` entries) or test items."""
    first = batch[0] if len(batch) else None
    return isinstance(first, dict) and any(k in _POINT_KEYS or "offset" in k or k == "fragment_list" for k in first)


@COLLATE_FNS.register_module()
def fallback_collate_fn(batch: Sequence) -> Any:
    """Point events by :func:`collate_fn`, anything else by torch's
    ``default_collate`` (see the module doc)."""
    if _is_point_batch(batch):
        return collate_fn(batch)
    return default_collate(batch)


def _split_any_batch(batch: dict, parts: int) -> list:
    """Splits a batch of either kind, for the OOM back-off."""
    if isinstance(batch, dict) and "offset" in batch:
        return split_point_batch(batch, parts)
    return split_by_leading_dim(batch, parts)


for _collate in (collate_fn, point_collate_fn, inseg_collate_fn):
    _collate.split_batch = split_point_batch
fallback_collate_fn.split_batch = _split_any_batch
# The collate that mixes events in place of the plain one when a config sets
# mix_prob (the trainer's loader builder reads it; the engine knows no point clouds).
collate_fn.mixing = point_collate_fn
