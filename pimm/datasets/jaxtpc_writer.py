"""Write JAXTPC-format shards (seg, resp, corr, labl) from pimm's LArTPC events.

No JAXTPC simulation runs here; this turns generated events (``coord``,
``energy``, ``segment``, ``instance``, ``interaction``) into the four families
:class:`~pimm.datasets.jaxtpc.JAXTPCDataset` reads, so the reader, its fusion
of modalities and a training config can be exercised on this machine:

* the detector is cut at the middle of ``x`` into two volumes, each deposit
  keeps its voxel position (``positions`` x ``pos_step_mm`` + the volume's
  origin, in mm), ``de`` is its energy, its track is its particle (low-energy
  deposits: one track per interaction), ``pdg`` a plausible code for its
  semantic type;
* ``labl`` maps each volume's track ids to ``particle`` (the semantic type),
  ``cluster`` (the particle) and ``interaction``;
* ``resp``: three wire planes per volume (U and V at +-60 degrees, Y
  vertical), ``time`` from ``x``; the charge of every (wire, time) pixel, delta-
  encoded and digitised to uint16 above a pedestal;
* ``corr``: per plane, each track's pixels with its share of their charge,
  stored as upstream does (per group: centre, peak charge, sizes; per entry:
  offsets and the charge as a 16-bit fraction of the peak); ``group_to_track``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from pimm.utils.errors import UserError

__all__ = ["write_jaxtpc_shards", "PDG_OF_SEMANTIC"]

PDG_OF_SEMANTIC = {0: 22, 1: 13, 2: 11, 3: 11, 4: 11}  # shower (photon), track (muon), Michel, delta, low-energy
POS_STEP_MM = 3.0
PEDESTAL = 100
ADC_PER_MEV = 200.0
PLANES = {"U": np.pi / 3, "V": -np.pi / 3, "Y": 0.0}


def _tracks(event: dict) -> np.ndarray:
    """A track id per point: 1 + the particle, or 10000 + the interaction for
    deposits of no particle."""
    instance = np.asarray(event.get("instance", np.full(len(event["coord"]), -1))).reshape(-1)
    interaction = np.asarray(event.get("interaction", np.zeros(len(instance)))).reshape(-1)
    return np.where(instance >= 0, instance + 1, 10000 + np.maximum(interaction, 0)).astype(np.int32)


def _pixels(coord: np.ndarray, angle: float) -> tuple[np.ndarray, np.ndarray]:
    wire = np.floor(coord[:, 1] * np.cos(angle) + coord[:, 2] * np.sin(angle)).astype(np.int64)
    return wire - wire.min(initial=0), np.floor(coord[:, 0]).astype(np.int64)


def _write_plane_signal(group: h5py.Group, wire, time, charge) -> None:
    keys, inverse = np.unique(np.stack([wire, time], 1), axis=0, return_inverse=True)
    total = np.bincount(inverse.reshape(-1), weights=charge, minlength=len(keys))
    adc = np.clip(np.round(total * ADC_PER_MEV), 0, 65535 - PEDESTAL).astype(np.uint16) + PEDESTAL
    start_w, start_t = (int(keys[0, 0]), int(keys[0, 1])) if len(keys) else (0, 0)
    group.attrs.update(wire_start=start_w, time_start=start_t, pedestal=PEDESTAL)
    group["delta_wire"] = np.diff(keys[:, 0], prepend=start_w).astype(np.int32)
    group["delta_time"] = np.diff(keys[:, 1], prepend=start_t).astype(np.int32)
    group["values"] = adc


def _write_plane_corr(group: h5py.Group, wire, time, charge, group_of_point) -> None:
    rows = np.stack([group_of_point, wire, time], 1)
    keys, inverse = np.unique(rows, axis=0, return_inverse=True)  # (group, pixel) entries, sorted by group
    share = np.bincount(inverse.reshape(-1), weights=charge, minlength=len(keys))
    groups, starts, sizes = np.unique(keys[:, 0], return_index=True, return_counts=True)
    peak = np.maximum.reduceat(share, starts) if len(keys) else np.zeros(0)
    center_w = np.round(np.add.reduceat(keys[:, 1], starts) / np.maximum(sizes, 1)).astype(np.int32) if len(keys) \
        else np.zeros(0, np.int32)
    center_t = np.round(np.add.reduceat(keys[:, 2], starts) / np.maximum(sizes, 1)).astype(np.int32) if len(keys) \
        else np.zeros(0, np.int32)
    group["group_ids"] = groups.astype(np.int32)
    group["group_sizes"] = sizes.astype(np.int32)
    group["center_wires"], group["center_times"] = center_w, center_t
    group["peak_charges"] = peak.astype(np.float32)
    group["delta_wires"] = (keys[:, 1] - np.repeat(center_w, sizes)).astype(np.int16)
    group["delta_times"] = (keys[:, 2] - np.repeat(center_t, sizes)).astype(np.int16)
    group["charges_u16"] = np.round(share / np.repeat(np.where(peak > 0, peak, 1), sizes) * 65535).astype(np.uint16)


def write_jaxtpc_shards(events: Iterable[dict], folder: str | os.PathLike, shard: int = 0,
                        dataset_name: str = "sim") -> int:
    """Write ``<folder>/<name>_{seg,resp,corr,labl}_<shard:04d>.h5``; returns
    the number of events. Each file is written under a temporary name and
    renamed, and an existing shard is never overwritten."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {kind: folder / f"{dataset_name}_{kind}_{shard:04d}.h5" for kind in ("seg", "resp", "corr", "labl")}
    existing = [str(p) for p in paths.values() if p.exists()]
    if existing:
        raise UserError(f"{existing[0]} already exists; write another shard number or folder")
    tmp = {kind: p.with_name(f".{p.name}.tmp") for kind, p in paths.items()}
    files = {kind: h5py.File(t, "w") for kind, t in tmp.items()}
    count = 0
    try:
        for number, event in enumerate(events):
            _write_event(files, f"event_{number:03d}", event)
            count += 1
        for f in files.values():
            f.create_group("config").attrs.update(n_events=count, n_volumes=2)
    finally:
        for f in files.values():
            f.close()
    for kind in paths:
        os.replace(tmp[kind], paths[kind])
    return count


def _write_event(files: dict, key: str, event: dict) -> None:
    coord = np.asarray(event["coord"], dtype=np.float64).reshape(-1, 3)
    energy = np.asarray(event["energy"], dtype=np.float64).reshape(-1)
    segment = np.asarray(event["segment"]).reshape(-1).astype(np.int64)
    interaction = np.asarray(event.get("interaction", np.zeros(len(coord)))).reshape(-1).astype(np.int64)
    tracks = _tracks(event)
    middle = np.floor(np.median(coord[:, 0])) if len(coord) else 0.0
    groups = {kind: f.create_group(key) for kind, f in files.items()}
    for volume, mask in enumerate((coord[:, 0] < middle, coord[:, 0] >= middle)):
        name = f"volume_{volume}"
        pos, de, trk = coord[mask], energy[mask], tracks[mask]
        table, group_of_point = np.unique(trk, return_inverse=True)  # group g <-> track table[g]
        group_of_point = group_of_point.reshape(-1)
        origin = np.array([0.0 if volume == 0 else middle * POS_STEP_MM, 0.0, 0.0])
        seg = groups["seg"].create_group(name)
        seg.attrs.update(n_actual=int(mask.sum()), pos_step_mm=POS_STEP_MM,
                         **{f"pos_origin_{a}": float(o) for a, o in zip("xyz", origin)})
        local = pos - origin / POS_STEP_MM
        seg["positions"] = local.astype(np.int32)
        seg["de"] = de.astype(np.float32)
        seg["track_ids"], seg["group_ids"] = trk, group_of_point.astype(np.int32)
        seg["interaction_ids"] = interaction[mask].astype(np.int32)
        seg["ancestor_track_ids"] = trk
        sem = segment[mask]
        pdg = np.array([PDG_OF_SEMANTIC.get(int(s), 0) for s in sem], dtype=np.int32)
        pdg[(sem == 1) & (trk % 2 == 0)] = 2212  # every other track particle a proton
        seg["pdg"] = pdg
        seg["dx"] = np.full(len(de), POS_STEP_MM, dtype=np.float32)
        labl = groups["labl"].create_group(name)
        first = np.unique(group_of_point, return_index=True)[1] if len(trk) else np.zeros(0, int)
        labl["track_ids"] = table.astype(np.int32)
        labl["particle"] = sem[first].astype(np.int32)
        labl["cluster"] = np.where(table < 10000, table - 1, -1).astype(np.int32)
        labl["interaction"] = interaction[mask][first].astype(np.int32)
        resp, corr = groups["resp"].create_group(name), groups["corr"].create_group(name)
        corr["group_to_track"] = table.astype(np.int32)
        for plane, angle in PLANES.items():
            wire, time = _pixels(pos, angle)
            _write_plane_signal(resp.create_group(plane), wire, time, de)
            _write_plane_corr(corr.create_group(plane), wire, time, de, group_of_point)
