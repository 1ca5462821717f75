"""Writing LUCiD-format shards, and a small generator of them fed by the ring simulator.

:func:`write_lucid_shards` writes events (per-PMT hits, per-particle hits and
3D track segments) as the co-indexed ``sensor/`` and ``seg/`` shard families
that :class:`~pimm.datasets.lucid.LUCiDDataset` (and upstream's readers)
read. :func:`simulate_lucid_event` turns one event of
:class:`~pimm.datasets.rings.CherenkovRingDataset`'s toy water-Cherenkov
detector into that form: every pixel of the unrolled barrel is a PMT (its
centre on the barrel wall is its position), a lit pixel is one hit (PE = its
charge, T = its mean time in ns), and the primary's straight path is cut into
track segments. The toy does not track which photons came from dark noise, so
the one particle of an event owns all its hits; its category is the species
(0 electron, 1 muon). An event is a pure function of (seed, split, species,
index), so generated productions are reproducible. ``tools/make_lucid.py`` is
the command line.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Iterable

import h5py
import numpy as np

from pimm.utils.errors import UserError

from .rings import ELECTRON_MASS, MUON_MASS, WATER_CRITICAL_ENERGY, WATER_X0, CherenkovRingDataset

__all__ = ["write_lucid_shards", "simulate_lucid_event", "pmt_positions", "generate_lucid", "check_dataset_name",
           "SPECIES"]

#: Species the generator simulates: name -> (category, PDG code, mass MeV/c^2).
SPECIES = {"electron": (0, 11, ELECTRON_MASS), "muon": (1, 13, MUON_MASS)}
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}
# A shard-file prefix: one plain name, so shards land in their own folder (never "../x" or "a/b").
_DATASET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
SEGMENT_STEP = 10.0  # cm of track per segment
_SPEED_OF_LIGHT = 29.98  # cm/ns


def pmt_positions(ring: CherenkovRingDataset) -> np.ndarray:
    """(H*W, 3) centres of the barrel pixels (row-major: z bins, then phi bins) on the wall."""
    height, width = ring.image_size
    phi = (np.arange(width) + 0.5) / width * 2 * math.pi - math.pi
    z = (np.arange(height) + 0.5) / height * 2 * ring.tank_half_height - ring.tank_half_height
    zz, pp = np.meshgrid(z, phi, indexing="ij")
    return np.stack([ring.tank_radius * np.cos(pp), ring.tank_radius * np.sin(pp), zz], -1).reshape(-1, 3).astype(
        np.float32)


def simulate_lucid_event(ring: CherenkovRingDataset, species: str, index: int, seed: int = 0,
                         split: str = "train") -> dict:
    """One event of ``species`` as hits and segments (see the module doc)."""
    category, pdg, mass = SPECIES[species]
    rng = np.random.default_rng([seed, _SPLIT_CODES[split], category, index])
    momentum = float(rng.uniform(*ring.momentum_range))
    vertex, direction = ring._sample_kinematics(rng)
    photons = (ring._muon_photons if species == "muon" else ring._electron_photons)(rng, vertex, direction, momentum)
    charge, mean_time = ring._detect(rng, *photons)  # (2, H, W): raw PE and mean time (ns)
    lit = np.flatnonzero(charge.reshape(-1) > 0)
    kinetic = math.hypot(momentum, mass) - mass
    exit_distance = ring._exit_distance(vertex, direction)
    if species == "muon":
        length = min(kinetic / ring.dedx, exit_distance)  # it keeps ionising below the Cherenkov threshold
    else:  # the shower's extent: a few radiation lengths past its maximum
        t_max = max(math.log(math.hypot(momentum, mass) / WATER_CRITICAL_ENERGY) - 0.5, 0.2)
        length = min((t_max + 4.0) * WATER_X0, exit_distance)
    n_segments = max(1, int(math.ceil(length / SEGMENT_STEP)))
    edges = np.linspace(0.0, length, n_segments + 1)
    start, end = vertex + edges[:-1, None] * direction, vertex + edges[1:, None] * direction
    return dict(
        hit_sensor=lit.astype(np.int32), hit_pe=charge.reshape(-1)[lit].astype(np.float32),
        hit_t=mean_time.reshape(-1)[lit].astype(np.float32), particle_category=np.array([category], np.int32),
        seg_start=start.astype(np.float32), seg_end=end.astype(np.float32),
        seg_edep=np.full(n_segments, kinetic / n_segments, np.float32),
        seg_time=(edges[:-1] / _SPEED_OF_LIGHT).astype(np.float32),
        track_pdg=pdg, track_energy=math.hypot(momentum, mass))


def _ring_for_lucid(**ring_options) -> CherenkovRingDataset:
    # Raw PE and times in ns: the shards hold physical values, not network inputs.
    options = dict(num_events=1, with_time=True, log_charge=False, time_scale=1.0)
    options.update(ring_options)
    return CherenkovRingDataset(**options)


def _write_shard(sensor_path: Path, seg_path: Path, events: list[dict], positions: np.ndarray) -> None:
    n = len(events)
    hits = [len(e["hit_sensor"]) for e in events]
    segments = [len(e["seg_edep"]) for e in events]

    def cat(key, dtype):
        return np.concatenate([np.asarray(e[key], dtype) for e in events]) if events else np.zeros(0, dtype)

    hit_offsets = np.r_[0, np.cumsum(hits)].astype(np.int64)
    for path, writer in ((sensor_path, "sensor"), (seg_path, "seg")):
        tmp = path.with_name(f".{path.name}.tmp")
        with h5py.File(tmp, "w") as f:
            f.attrs["n_events"] = n
            f.create_dataset("event_number", data=np.arange(n, dtype=np.int64))
            if writer == "sensor":
                f.attrs["n_sensors"] = len(positions)
                f.create_dataset("event_hit_offsets", data=hit_offsets)
                for name, key, dtype in (("sensor_idx", "hit_sensor", np.int32), ("PE", "hit_pe", np.float32),
                                         ("T", "hit_t", np.float32)):
                    values = cat(key, dtype)
                    f.create_dataset(f"event_hit_{name}", data=values)
                    f.create_dataset(f"particle_hit_{name}", data=values)  # one particle owns every hit
                f.create_dataset("particle_event_offset", data=np.arange(n + 1, dtype=np.int64))
                f.create_dataset("particle_hit_offsets", data=hit_offsets)
                f.create_dataset("particle_category", data=cat("particle_category", np.int32))
                f.create_group("config").create_dataset("pmt_positions", data=positions)
            else:
                f.create_dataset("track_event_offset", data=np.arange(n + 1, dtype=np.int64))
                f.create_dataset("segment_offset", data=np.r_[0, np.cumsum(segments)].astype(np.int64))
                start, end = cat("seg_start", np.float32).reshape(-1, 3), cat("seg_end", np.float32).reshape(-1, 3)
                for axis, name in enumerate("xyz"):
                    f.create_dataset(f"start_{name}", data=start[:, axis])
                    f.create_dataset(f"end_{name}", data=end[:, axis])
                f.create_dataset("edep", data=cat("seg_edep", np.float32))
                f.create_dataset("time", data=cat("seg_time", np.float32))
                f.create_dataset("track_id", data=np.ones(n, np.int32))
                f.create_dataset("parent_id", data=np.zeros(n, np.int32))
                f.create_dataset("pdg", data=np.array([e["track_pdg"] for e in events], np.int32))
                f.create_dataset("initial_energy", data=np.array([e["track_energy"] for e in events], np.float32))
        os.replace(tmp, path)


def check_dataset_name(name: str) -> None:
    """Refuse a shard prefix that is not one plain name (it would put shards outside their folders)."""
    if not isinstance(name, str) or not _DATASET_NAME.fullmatch(name) or ".." in name:
        raise UserError(f"dataset name {name!r} is not a plain file-name prefix: use letters, digits, '_', '-' "
                        "and '.' (no '/' or '..'), e.g. wc")


def write_lucid_shards(events: Iterable[dict], out: str | os.PathLike, positions: np.ndarray,
                       dataset_name: str = "wc", events_per_file: int = 1000, overwrite: bool = False) -> int:
    """Write ``events`` (:func:`simulate_lucid_event`'s dicts) to ``out/sensor/`` and
    ``out/seg/`` as ``<dataset_name>_sensor_NNNN.h5`` / ``_seg_NNNN.h5``; returns the
    number written. Existing shards are refused unless ``overwrite``;
    ``dataset_name`` must be a plain file-name prefix."""
    check_dataset_name(dataset_name)
    out = Path(out)
    folders = {family: out / family for family in ("sensor", "seg")}
    existing = [p for family, d in folders.items() for p in sorted(d.glob(f"{dataset_name}_{family}_*.h5"))]
    if existing and not overwrite:
        raise UserError(f"{existing[0]} already exists; choose another --out or pass --overwrite")
    for path in existing:
        path.unlink()
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    block: list[dict] = []
    written = part = 0
    for event in events:
        block.append(event)
        if len(block) == events_per_file:
            _write_shard(folders["sensor"] / f"{dataset_name}_sensor_{part:04d}.h5",
                         folders["seg"] / f"{dataset_name}_seg_{part:04d}.h5", block, positions)
            written, part, block = written + len(block), part + 1, []
    if block or part == 0:
        _write_shard(folders["sensor"] / f"{dataset_name}_sensor_{part:04d}.h5",
                     folders["seg"] / f"{dataset_name}_seg_{part:04d}.h5", block, positions)
        written += len(block)
    return written


def generate_lucid(out: str | os.PathLike, num_events: int, species: str, seed: int = 0, split: str = "train",
                   dataset_name: str = "wc", events_per_file: int = 1000, overwrite: bool = False,
                   **ring_options) -> int:
    """Simulate ``num_events`` events of ``species`` and write them under ``out``."""
    if species not in SPECIES:
        raise UserError(f"species {species!r} is not one of {', '.join(SPECIES)}")
    if split not in _SPLIT_CODES:
        raise UserError(f"split {split!r} is not one of {', '.join(_SPLIT_CODES)}")
    ring = _ring_for_lucid(**ring_options)
    events = (simulate_lucid_event(ring, species, i, seed, split) for i in range(num_events))
    return write_lucid_shards(events, out, pmt_positions(ring), dataset_name, events_per_file, overwrite)
