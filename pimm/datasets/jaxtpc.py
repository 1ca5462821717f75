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
from .jaxtpc_readers import (MODALITIES, _deposit_count, _Family, _merge_planes, _shard_id, lookup,  # noqa: F401
                             read_corr, read_labl, read_resp, read_seg, shard_files)
from .point_dataset import PointDataset

__all__ = ["JAXTPCDataset", "MODALITIES", "shard_files"]

logger = logging.getLogger(__name__)

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
