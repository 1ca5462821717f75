"""JAXTPC simulation output: 3D deposits, wire-plane signals, their
correspondence and label tables, in co-indexed HDF5 shards (upstream's format).

A JAXTPC production writes four families of shards, ``<name>_<kind>_<NNNN>.h5``
with ``kind`` one of ``seg`` (3D energy deposits), ``resp`` (sparse wire-plane
signals), ``corr`` (which deposit group made which wire/time pixel, with its
share of the charge) and ``labl`` (per-volume track id -> particle / cluster /
interaction label tables). Shard ``NNNN`` of every family holds the same events
(``config.attrs["n_events"]``, groups ``event_000``, ``event_001``, ...), each
split into detector volumes (``volume_<v>`` groups).

:class:`JAXTPCDataset` (upstream's name and arguments) reads any subset of the
families and fuses them as upstream does: with ``seg``, ``coord`` is the 3D
deposit cloud and ``segment`` comes from ``labl`` through each deposit's track
id; without ``seg``, ``corr`` + ``labl`` make a labelled 2D cloud (one point
per (pixel, group) entry, overlaps kept); with ``resp`` alone, every plane's
pixels are one 2D cloud with ``plane_id``. Other modalities' keys stay
namespaced (``resp_*``, ``corr_*``, ``plane.<plane>.*``, ``labl_v<v>_*``).

Where upstream filters only the seg family by ``min_deposits`` and then reads
the other families at the same *position* (so they drift apart once an event
is skipped), events here are addressed by ``(shard, event number)`` in every
family, and a missing or shorter counterpart shard is an error naming it.
:mod:`pimm.datasets.jaxtpc_writer` writes all four families from pimm's
LArTPC generator.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from typing import Any, Sequence

import h5py
import numpy as np

from pimm.engines.registries import DATASETS
from pimm.utils.domains import Choice, Count, FilePath, Int, Key, Keys, PosInt, Seq, Text, Transforms
from pimm.utils.errors import ConfigError, UserError

from .fragments import TEST_CFG
from .point_dataset import PointDataset

__all__ = ["JAXTPCDataset", "MODALITIES", "shard_files"]

logger = logging.getLogger(__name__)

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


@DATASETS.register_module()
class JAXTPCDataset(PointDataset):
    """Events of a JAXTPC production (see the module docstring), upstream's arguments.

    Args:
        data_root: the production folder; each family is looked for in
            ``<data_root>/<kind>`` when that exists, else in ``data_root``,
            then under ``<split>/`` or directly.
        split: the sub-folder of the split (``""``: none).
        transform: list of transform configs.
        modalities: any of ``"seg"``, ``"resp"``, ``"corr"``, ``"labl"``.
        dataset_name: the shard prefix (``sim`` for ``sim_seg_0000.h5``).
        volume: read only this detector volume (its deposits and planes).
        label_key: the ``labl`` column that becomes ``segment``
            (``particle``, ``cluster``, ``interaction``).
        min_deposits: skip events with fewer 3D deposits (needs ``seg``).
        max_len: keep at most this many events (``-1``/``0``: all), before ``loop``.
        loop: repeat the events this many times per epoch.
        include_physics: also read ``dx``, ``theta``, ``phi``, ``t0_us``,
            ``charge``, ``photons``, ``qs_fractions`` when present.
        label_keys: the ``labl`` columns to read (``None``: all).
        test_mode, test_cfg: upstream's test fragments, scored on every
            deposit (:mod:`pimm.datasets.fragments`); ``loop`` is 1 then.
    """

    domains = dict(data_root=FilePath, split=Text("a split folder name", empty=True), transform=Transforms,
                   modalities=Seq(Choice(*MODALITIES), min_len=1, what="a non-empty list of seg/resp/corr/labl"),
                   dataset_name=Key, volume=Int(0, 1 << 16) | None, label_key=Key, min_deposits=Count,
                   max_len=Int(-1) | None, loop=PosInt, label_keys=Keys | None, test_cfg=TEST_CFG)

    def __init__(self, data_root: str, split: str = "train", transform: Sequence[Any] | None = None,
                 modalities: Sequence[str] = ("seg",), dataset_name: str = "sim", volume: int | None = None,
                 label_key: str = "particle", min_deposits: int = 0, max_len: int | None = -1, loop: int = 1,
                 include_physics: bool = True, label_keys: Sequence[str] | None = None, test_mode: bool = False,
                 test_cfg: Any = None):
        super().__init__(split="train", transform=transform, test_mode=test_mode, test_cfg=test_cfg)
        self.split = split if isinstance(split, str) else "custom"
        self.modalities = tuple(dict.fromkeys(modalities))
        unknown = [m for m in self.modalities if m not in MODALITIES]
        if unknown:
            raise ConfigError(f"JAXTPCDataset: modality {unknown[0]!r} is not one of {', '.join(MODALITIES)}")
        if min_deposits and "seg" not in self.modalities:
            raise ConfigError("JAXTPCDataset: min_deposits counts 3D deposits, so it needs 'seg' in modalities")
        root = os.path.expanduser(str(data_root))
        if not os.path.isdir(root):
            raise UserError(f"JAXTPCDataset: data_root={data_root!r} is not a folder")
        self.volume, self.label_key, self.loop = volume, label_key, 1 if test_mode else loop
        self.include_physics, self.label_keys = bool(include_physics), label_keys
        self.planes = None if volume is None else [f"volume_{volume}_{p}" for p in "UVY"]
        self.families = {kind: _Family(os.path.join(root, kind) if os.path.isdir(os.path.join(root, kind)) else root,
                                       split, dataset_name, kind) for kind in self.modalities}
        self.index = self._build_index(min_deposits, max_len)
        if len(self.index) == 0:
            raise UserError(f"JAXTPCDataset: no event is kept in {root} (min_deposits={min_deposits}, "
                            f"max_len={max_len})")
        if {"resp", "labl"} <= set(self.modalities) and not {"seg", "corr"} & set(self.modalities):
            logger.warning("JAXTPCDataset: modalities %s give no 'segment': wire pixels reach the label tables "
                           "only through 'corr' (2D labels) or 'seg' (3D labels)", self.modalities)
        logger.info("JAXTPCDataset %s: %d events, modalities=%s, volume=%s", split, len(self.index),
                    "/".join(self.modalities), volume)

    def _build_index(self, min_deposits: int, max_len: int | None) -> np.ndarray:
        """``(shard, event number)`` of the kept events, in the canonical
        family's shard order; every other family must have the same shards."""
        canonical = next(self.families[k] for k in MODALITIES if k in self.families)
        for family in self.families.values():
            for shard_id, i in canonical.by_id.items():
                j = family.by_id.get(shard_id)
                if j is None:
                    raise UserError(f"{canonical.files[i]} has no {family.kind} counterpart (*_{family.kind}_"
                                    f"{shard_id}.h5); the families of a JAXTPC production must be co-indexed")
                if family.n_events[j] < canonical.n_events[i]:
                    raise UserError(f"{family.files[j]} holds {family.n_events[j]} events but "
                                    f"{canonical.files[i]} holds {canonical.n_events[i]}: the shards are not "
                                    "co-indexed (an incomplete production?)")
        entries = []
        for i, count in enumerate(canonical.n_events):
            numbers = np.arange(count)
            if min_deposits > 0:
                seg = self.families["seg"]
                shard = seg.by_id[_shard_id(canonical.files[i], canonical.kind)]
                numbers = np.array([n for n in numbers if _deposit_count(seg.event(shard, int(n))) >= min_deposits],
                                   dtype=np.int64)
            entries.append(np.stack([np.full(len(numbers), i), numbers], axis=1))
        index = np.concatenate(entries).astype(np.int64) if entries else np.zeros((0, 2), np.int64)
        return index[:max_len] if max_len is not None and max_len > 0 else index

    def __len__(self) -> int:
        return len(self.index) * self.loop

    def _event(self, kind: str, shard: int, number: int) -> h5py.Group:
        canonical = next(self.families[k] for k in MODALITIES if k in self.families)
        family = self.families[kind]
        return family.event(family.by_id[_shard_id(canonical.files[shard], canonical.kind)], number)

    def get_data_name(self, idx: int) -> str:
        shard, number = (int(v) for v in self.index[idx % len(self.index)])
        canonical = next(self.families[k] for k in MODALITIES if k in self.families)
        return f"{os.path.basename(canonical.files[shard])}_evt{number:03d}"

    def get_data(self, idx: int) -> dict:
        shard, number = (int(v) for v in self.index[idx % len(self.index)])
        read = lambda kind: self._event(kind, shard, number)  # noqa: E731
        has = set(self.modalities)
        data = read_seg(read("seg"), self.volume, self.include_physics) if "seg" in has else {}
        labels = read_labl(read("labl"), self.label_keys) if "labl" in has else {}
        if "seg" in has and labels:
            data["segment"] = self._deposit_labels(data, labels)
        resp = read_resp(read("resp"), self.planes) if "resp" in has else {}
        corr = read_corr(read("corr"), self.planes) if "corr" in has else {}
        if resp:
            data.update(_merge_planes(resp, "plane.", ("wire", "time", "value"), "resp_"))
            data.update(resp)
        if corr and labels:
            data.update(self._corr_cloud(corr, labels))
        elif corr:
            data.update(corr)
        if "seg" not in has:  # the 2D cloud with labels, else the signal, owns coord
            source = "corr_" if "corr_coord" in data else "resp_" if "resp_coord" in data else None
            if source is not None:
                for key in ("coord", "energy", "segment", "instance", "plane_id"):
                    if source + key in data:
                        data[key] = data[source + key]
        for key, value in labels.items():
            data.setdefault(key, value)
        data.update(name=self.get_data_name(idx), split=self.split)
        return data

    def _deposit_labels(self, data: dict, labels: dict) -> np.ndarray:
        """Each deposit's ``label_key`` through its track id, per volume."""
        out = np.full(len(data["track_ids"]), -1, dtype=np.int32)
        volume_of = data["volume_id"].reshape(-1)
        for key in labels:
            match = re.fullmatch(r"labl_v(\d+)_track_ids", key)
            column = f"labl_v{match.group(1)}_{self.label_key}" if match else None
            if column not in labels:
                continue
            mask = volume_of == int(match.group(1))
            out[mask] = lookup(labels[key], labels[column], data["track_ids"][mask])
        return out

    def _corr_cloud(self, corr: dict, labels: dict) -> dict:
        """One 2D point per (pixel, group) entry; its label through group ->
        track (``g2t``) -> ``label_key``."""
        merged = _merge_planes(corr, "corr.", ("wire", "time", "charge"), "corr_")
        group_ids, segments, planes = [], [], sorted({k.split(".")[1] for k in corr if k.endswith(".wire")})
        for plane in planes:
            gid = corr[f"corr.{plane}.group_id"]
            volume = plane.split("_")[1] if plane.startswith("volume_") else "0"
            g2t = corr.get(f"g2t_v{volume}")
            label = np.full(len(gid), -1, dtype=np.int32)
            if g2t is not None and f"labl_v{volume}_{self.label_key}" in labels:
                valid = (gid >= 0) & (gid < len(g2t))
                tracks = np.where(valid, g2t[np.clip(gid, 0, max(len(g2t) - 1, 0))], -1)
                label = np.where(valid, lookup(labels[f"labl_v{volume}_track_ids"],
                                               labels[f"labl_v{volume}_{self.label_key}"], tracks), -1)
            group_ids.append(gid.astype(np.int32))
            segments.append(label.astype(np.int32))
        merged["corr_instance"] = np.concatenate(group_ids) if group_ids else np.zeros(0, np.int32)
        merged["corr_segment"] = np.concatenate(segments) if segments else np.zeros(0, np.int32)
        return merged


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
