"""Reading the four shard families of a JAXTPC production (seg, resp, corr,
labl): files, events, and each family's arrays as upstream's readers give
them. :class:`~pimm.datasets.jaxtpc.JAXTPCDataset` fuses them."""

from __future__ import annotations

import glob
import os
import re
from typing import Sequence

import h5py
import numpy as np

from pimm.utils.errors import UserError

__all__ = ["MODALITIES", "shard_files", "read_seg", "read_resp", "read_corr", "read_labl", "lookup"]

MODALITIES = ("seg", "resp", "corr", "labl")
_PHYSICS = ("dx", "theta", "phi", "t0_us", "charge", "photons", "qs_fractions")
_IDS = ("pdg", "interaction_ids", "ancestor_track_ids")


def shard_files(root: str, split: str, name: str, kind: str) -> list[str]:
    """``<root>/<split>/<name>_<kind>_*.h5``, else ``<root>/<name>_<kind>_*.h5``
    (upstream's search), sorted."""
    for folder in (os.path.join(root, split), root):
        files = sorted(glob.glob(os.path.join(folder, f"{name}_{kind}_*.h5")))
        if files:
            return files
    return []


def _shard_id(path: str, kind: str) -> str:
    """``sim_seg_0003.h5`` -> ``0003``: what pairs shards across families."""
    match = re.search(rf"_{kind}_(.+)\.h5$", os.path.basename(path))
    return match.group(1) if match else os.path.basename(path)


class _Family:
    """One family's shards, opened lazily once per process (never pickled)."""

    def __init__(self, root: str, split: str, name: str, kind: str):
        self.kind, self.files = kind, shard_files(root, split, name, kind)
        if not self.files:
            raise UserError(f"no JAXTPC {kind} shards ({name}_{kind}_*.h5) in {os.path.join(root, split)} or {root}; "
                            f"check data_root, split and dataset_name, or drop {kind!r} from modalities")
        self.n_events, self.n_volumes = [], []
        for path in self.files:
            try:
                with h5py.File(path, "r") as f:
                    attrs = f["config"].attrs
                    self.n_events.append(int(attrs["n_events"]))
                    self.n_volumes.append(int(attrs.get("n_volumes", 1)))
            except (OSError, KeyError) as err:
                raise UserError(f"{path} is not a JAXTPC {kind} shard (needs a config group with an n_events "
                                f"attribute): {err}") from None
        self.by_id = {_shard_id(p, kind): i for i, p in enumerate(self.files)}
        self._open: dict[int, h5py.File] = {}
        self._pid = os.getpid()

    def __getstate__(self):
        return dict(self.__dict__, _open={}, _pid=None)

    def event(self, shard: int, number: int) -> h5py.Group:
        if self._pid != os.getpid():
            self._open, self._pid = {}, os.getpid()
        if shard not in self._open:
            self._open[shard] = h5py.File(self.files[shard], "r")
        key = f"event_{number:03d}"
        f = self._open[shard]
        if key not in f:
            raise UserError(f"{self.files[shard]} has no group {key} although its config says "
                            f"{self.n_events[shard]} events: the shard is incomplete")
        return f[key]


def _volumes(event: h5py.Group) -> list[tuple[int, h5py.Group]]:
    return sorted((int(k.split("_", 1)[1]), g) for k, g in event.items()
                  if k.startswith("volume_") and isinstance(g, h5py.Group))


def _deposit_count(event: h5py.Group) -> int:
    volumes = _volumes(event)
    if volumes:
        return sum(int(g.attrs.get("n_actual", g["positions"].shape[0] if "positions" in g else 0))
                   for _, g in volumes)
    return int(event["positions"].shape[0]) if "positions" in event else 0


def _read_deposits(group: h5py.Group, volume: int, physics: bool) -> dict:
    n = int(group.attrs.get("n_actual", group["positions"].shape[0]))
    origin = np.array([group.attrs[f"pos_origin_{a}"] for a in "xyz"], dtype=np.float32)
    out = {"coord": group["positions"][:n].astype(np.float32) * np.float32(group.attrs["pos_step_mm"]) + origin,
           "energy": group["de"][:n].astype(np.float32),
           "volume_id": np.full(n, volume, dtype=np.int32),
           "track_ids": group["track_ids"][:n].astype(np.int32),
           "group_ids": group["group_ids"][:n].astype(np.int32)}
    for key in _IDS:
        out[key] = group[key][:n].astype(np.int32) if key in group else np.full(n, -1, dtype=np.int32)
    for key in _PHYSICS if physics else ():
        if key in group:
            out[key] = group[key][:n].astype(np.float32)
    return out


def read_seg(event: h5py.Group, volume: int | None, physics: bool) -> dict:
    """The 3D deposits of every volume (or of ``volume``) as one cloud."""
    parts = [_read_deposits(g, v, physics) for v, g in _volumes(event) if volume is None or v == volume]
    if not _volumes(event) and "positions" in event:  # the older flat layout: one volume
        parts = [_read_deposits(event, 0, physics)]
    parts = [p for p in parts if len(p["coord"])]
    if not parts:
        ints = {k: np.zeros(0, dtype=np.int32) for k in ("track_ids", "group_ids") + _IDS}
        return dict(coord=np.zeros((0, 3), np.float32), energy=np.zeros((0, 1), np.float32),
                    volume_id=np.zeros((0, 1), np.int32), **ints)
    keys = [k for k in parts[0] if all(k in p for p in parts)]
    out = {k: np.concatenate([p[k] for p in parts]) for k in keys}
    for key in ("energy", "volume_id") + _PHYSICS:  # per-point features are columns, as upstream
        if key in out and out[key].ndim == 1:
            out[key] = out[key][:, None]
    return out


def _planes(event: h5py.Group, marker: str) -> list[tuple[str, int | None, h5py.Group]]:
    """``(label, volume, group)`` of each wire plane: ``volume_<v>/<plane>``
    (label ``volume_<v>_<plane>``) or, in older files, a plane group directly
    under the event."""
    found = []
    for key, group in event.items():
        if not isinstance(group, h5py.Group):
            continue
        if key.startswith("volume_"):
            found += [(f"{key}_{p}", int(key.split("_", 1)[1]), g) for p, g in group.items()
                      if isinstance(g, h5py.Group) and marker in g]
        elif marker in group:
            found.append((key, None, group))
    return sorted(found, key=lambda t: t[0])


def read_resp(event: h5py.Group, planes: Sequence[str] | None, digitized: bool = True) -> dict:
    """Each plane's sparse signal, delta-decoded: ``plane.<label>.wire/time/value``."""
    out = {}
    for label, _, g in _planes(event, "delta_wire"):
        if planes is not None and label not in planes:
            continue
        values = g["values"][:]
        if digitized and values.dtype == np.uint16:
            values = values.astype(np.float32) - np.float32(g.attrs.get("pedestal", 0))
        out[f"plane.{label}.wire"] = (int(g.attrs["wire_start"]) + np.cumsum(g["delta_wire"][:])).astype(np.int32)
        out[f"plane.{label}.time"] = (int(g.attrs["time_start"]) + np.cumsum(g["delta_time"][:])).astype(np.int32)
        out[f"plane.{label}.value"] = values.astype(np.float32)
    return out


def read_corr(event: h5py.Group, planes: Sequence[str] | None) -> dict:
    """Each plane's (pixel, group) entries, ``corr.<label>.wire/time/group_id/
    charge``, and each volume's group -> track table ``g2t_v<v>``."""
    out = {}
    for volume, group in _volumes(event):
        if "group_to_track" in group:
            out[f"g2t_v{volume}"] = group["group_to_track"][:].astype(np.int32)
    for label, _, g in _planes(event, "group_ids"):
        if planes is not None and label not in planes:
            continue
        sizes = g["group_sizes"][:].astype(np.int64)
        repeat = lambda name: np.repeat(g[name][:], sizes)  # noqa: E731  (group value -> its entries)
        prefix = f"corr.{label}"
        out[f"{prefix}.wire"] = (repeat("center_wires").astype(np.int32) + g["delta_wires"][:].astype(np.int32))
        out[f"{prefix}.time"] = (repeat("center_times").astype(np.int32) + g["delta_times"][:].astype(np.int32))
        out[f"{prefix}.group_id"] = repeat("group_ids").astype(np.int32)
        out[f"{prefix}.charge"] = (repeat("peak_charges").astype(np.float32)
                                   * g["charges_u16"][:].astype(np.float32) / np.float32(65535.0))
    return out


def read_labl(event: h5py.Group, label_keys: Sequence[str] | None) -> dict:
    """Each volume's ``labl_v<v>_track_ids`` and label columns."""
    out = {}
    for volume, group in _volumes(event):
        if "track_ids" not in group:
            continue
        out[f"labl_v{volume}_track_ids"] = group["track_ids"][:].astype(np.int32)
        for key, column in group.items():
            if key != "track_ids" and (label_keys is None or key in label_keys):
                out[f"labl_v{volume}_{key}"] = column[:].astype(np.int32)
    return out


def lookup(table_ids: np.ndarray, table_values: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``table_values`` at each of ``ids`` in ``table_ids``; -1 where absent."""
    out = np.full(len(ids), -1, dtype=np.int32)
    if len(table_ids) == 0:
        return out
    order = np.argsort(table_ids, kind="stable")
    pos = np.clip(np.searchsorted(table_ids[order], ids), 0, len(order) - 1)
    hit = table_ids[order][pos] == ids
    out[hit] = table_values[order][pos[hit]]
    return out


def _merge_planes(arrays: dict, prefix: str, fields: tuple[str, str, str], out: str) -> dict:
    """All planes' ``(wire, time)`` as one ``(M, 2)`` cloud with its value
    column and ``plane_id`` (the plane's position in sorted label order)."""
    planes = sorted({k[len(prefix):].rsplit(".", 1)[0] for k in arrays if k.startswith(prefix)
                     and k.endswith("." + fields[0])})
    coords, values, ids = [], [], []
    for i, plane in enumerate(planes):
        wire, time, value = (arrays[f"{prefix}{plane}.{f}"] for f in fields)
        coords.append(np.stack([wire, time], axis=1).astype(np.float32))
        values.append(value.astype(np.float32)[:, None])
        ids.append(np.full((len(wire), 1), i, dtype=np.int32))
    if not planes:
        return {}
    return {f"{out}coord": np.concatenate(coords), f"{out}energy": np.concatenate(values),
            f"{out}plane_id": np.concatenate(ids)}
