"""Straight tracks from a common vertex: a small, fast instance-proposal task.

Each event is planar (the detector plane; ``coord`` z is 0) with 1 to 3
straight tracks leaving the vertex at the origin, their directions at least
``min_separation_deg`` apart, plus uniform noise hits. A track is a muon or a
proton, told apart the way a LArTPC tells them apart:

* a **muon** is minimum-ionising: a long track (``muon_length``) whose hits
  deposit about ``muon_dedx`` each, flat along the track;
* a **proton** stops quickly: a short track (``proton_length``), so its hits
  are denser, depositing several times more and rising towards the end
  (the Bragg peak).

Both carry ``hits_per_track`` hits spread along their length with angular
noise ``angle_noise``; noise hits deposit a uniform ``noise_dedx`` range that
overlaps both species. A policy must find each track's direction and type
from the unordered points.

Per event: ``coord`` (N, 3) float32, ``feat`` (N, 1) float32 (the hit's
deposit, MeV/cm), ``segment`` (N,) int64 (0 noise, 1 muon, 2 proton),
``instance`` (N,) int64 (track index, -1 for noise), and the truth
``track_angle`` (1, 3) float32 radians and ``track_class`` (1, 3) int64
(0 muon, 1 proton, -1 for no track); collated, these become ``(B, 3)``.

Everything is drawn from ``np.random.default_rng([seed, split, index])``, so
an event depends only on (seed, split, index): resumed runs and any number
of data workers see the same data.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from pimm.engines.registries import DATASETS
from pimm.utils.errors import UserError

from .point_dataset import SPLITS, PointDataset
from pimm.utils.domains import Choice, Count, Int, NonNeg, Pair, PosInt, Positive, Real, Transforms

__all__ = ["StraightTracksDataset", "TRACK_CLASSES", "MAX_TRACKS"]

TRACK_CLASSES = ("muon", "proton")
MAX_TRACKS = 3
NOISE, MUON, PROTON = 0, 1, 2  # segment labels


def _range(name: str, value, low: float, integer: bool = False) -> tuple:
    ok = isinstance(value, (list, tuple)) and len(value) == 2 and all(
        not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) for v in value)
    if not ok or value[0] > value[1] or value[0] < low or (integer and any(v != int(v) for v in value)):
        kind = "integers" if integer else "numbers"
        raise UserError(f"StraightTracksDataset: {name}={value!r} must be a (min, max) pair of {kind} "
                        f">= {low} with min <= max")
    return (int(value[0]), int(value[1])) if integer else (float(value[0]), float(value[1]))


def _count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"StraightTracksDataset: {name}={value!r} must be an integer >= {low}")
    return value


@DATASETS.register_module()
class StraightTracksDataset(PointDataset):
    """Events of 1-3 straight muon/proton tracks from the origin plus noise hits.

    Args:
        num_events: ``len(dataset)``.
        seed: with ``split`` and the index, fully determines an event.
        split: ``train``, ``val`` or ``test`` (disjoint event streams).
        num_tracks: (min, max) tracks per event, within 1..3.
        min_separation_deg: smallest angle between two tracks of an event.
        hits_per_track: hits on each track.
        noise_hits: (min, max) uniform noise hits in the unit disk.
        angle_noise: rms angular scatter of a track's hits (radians).
        muon_length, proton_length: (min, max) track lengths (the disk has radius 1).
        muon_dedx: mean deposit of a muon hit; protons deposit ``proton_dedx``
            at the start, rising by ``bragg_rise`` times at the end.
        dedx_spread: relative Gaussian spread of every track hit's deposit.
        noise_dedx: (min, max) deposit of noise hits.
        transform: optional transform pipeline (see ``PointDataset``).
        test_mode, test_cfg: test fragments (see ``PointDataset``).
    """

    domains = dict(num_events=PosInt, seed=Count, split=Choice("train", "val", "test"), num_tracks=Pair(Int(1, 64)),
                   min_separation_deg=Real(0, 180), hits_per_track=Int(2, 10**5), noise_hits=Pair(Int(0, 10**5)),
                   angle_noise=Real(0, 10), muon_length=Pair(Positive), proton_length=Pair(Positive),
                   muon_dedx=Positive, proton_dedx=Positive, bragg_rise=NonNeg, dedx_spread=Real(0, 10),
                   noise_dedx=Pair(Positive), transform=Transforms)

    def __init__(self, num_events: int = 1000, seed: int = 0, split: str = "train",
                 num_tracks: Sequence[int] = (1, 3), min_separation_deg: float = 30.0, hits_per_track: int = 12,
                 noise_hits: Sequence[int] = (10, 10), angle_noise: float = 0.02,
                 muon_length: Sequence[float] = (0.6, 1.0), proton_length: Sequence[float] = (0.25, 0.5),
                 muon_dedx: float = 2.1, proton_dedx: float = 5.0, bragg_rise: float = 1.5,
                 dedx_spread: float = 0.15, noise_dedx: Sequence[float] = (0.5, 6.0), transform: Any = None,
                 test_mode: bool = False, test_cfg: dict | None = None):
        super().__init__(split=split, transform=transform, test_mode=test_mode, test_cfg=test_cfg)
        self.num_events = _count("num_events", num_events, 1)
        self.seed = _count("seed", seed, 0)
        self.split_code = SPLITS.index(split)
        self.num_tracks = _range("num_tracks", num_tracks, 1, integer=True)
        if self.num_tracks[1] > MAX_TRACKS:
            raise UserError(f"StraightTracksDataset: num_tracks={num_tracks!r} allows at most {MAX_TRACKS} tracks")
        if isinstance(min_separation_deg, bool) or not isinstance(min_separation_deg, (int, float)) \
                or not 0 <= min_separation_deg * self.num_tracks[1] < 360:
            raise UserError(f"StraightTracksDataset: min_separation_deg={min_separation_deg!r} must be >= 0 and "
                            f"leave room for {self.num_tracks[1]} tracks around the vertex")
        self.min_separation = math.radians(min_separation_deg)
        self.hits_per_track = _count("hits_per_track", hits_per_track, 2)
        self.noise_hits = _range("noise_hits", noise_hits, 0, integer=True)
        self.muon_length = _range("muon_length", muon_length, 0.0)
        self.proton_length = _range("proton_length", proton_length, 0.0)
        self.noise_dedx = _range("noise_dedx", noise_dedx, 0.0)
        for name, value in (("angle_noise", angle_noise), ("muon_dedx", muon_dedx), ("proton_dedx", proton_dedx),
                            ("bragg_rise", bragg_rise), ("dedx_spread", dedx_spread)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise UserError(f"StraightTracksDataset: {name}={value!r} must be a finite number >= 0")
        self.angle_noise, self.muon_dedx, self.proton_dedx = float(angle_noise), float(muon_dedx), float(proton_dedx)
        self.bragg_rise, self.dedx_spread = float(bragg_rise), float(dedx_spread)

    def __len__(self) -> int:
        return self.num_events

    def _directions(self, rng: np.random.Generator, count: int) -> np.ndarray:
        # Rejection sampling; with at most 3 tracks and separations well below
        # 120 degrees a few tries suffice.
        while True:
            angles = rng.uniform(0.0, 2.0 * math.pi, size=count)
            diff = np.abs((angles[:, None] - angles[None, :] + math.pi) % (2.0 * math.pi) - math.pi)
            np.fill_diagonal(diff, math.inf)
            if count == 1 or diff.min() >= self.min_separation:
                return angles

    def get_data(self, idx: int) -> dict:
        rng = np.random.default_rng([self.seed, self.split_code, idx])
        count = int(rng.integers(self.num_tracks[0], self.num_tracks[1] + 1))
        angles = self._directions(rng, count)
        classes = rng.integers(0, len(TRACK_CLASSES), size=count)
        n = self.hits_per_track
        xy, dedx, segment, instance = [], [], [], []
        for track, (angle, cls) in enumerate(zip(angles, classes)):
            proton = cls == 1
            length = rng.uniform(*(self.proton_length if proton else self.muon_length))
            # Hits spread along the track, starting a little off the vertex.
            t = (np.arange(n) + rng.uniform(0.2, 0.8, size=n)) / n
            radius = length * t
            phi = angle + rng.normal(0.0, self.angle_noise, size=n)
            xy.append(np.stack([radius * np.cos(phi), radius * np.sin(phi)], axis=1))
            mean = self.proton_dedx * (1.0 + self.bragg_rise * t ** 4) if proton else np.full(n, self.muon_dedx)
            dedx.append(mean * (1.0 + self.dedx_spread * rng.normal(size=n)))
            segment.append(np.full(n, PROTON if proton else MUON))
            instance.append(np.full(n, track))
        noise = int(rng.integers(self.noise_hits[0], self.noise_hits[1] + 1))
        radius = np.sqrt(rng.uniform(0.0, 1.0, size=noise))
        phi = rng.uniform(0.0, 2.0 * math.pi, size=noise)
        xy.append(np.stack([radius * np.cos(phi), radius * np.sin(phi)], axis=1))
        dedx.append(rng.uniform(*self.noise_dedx, size=noise))
        segment.append(np.full(noise, NOISE))
        instance.append(np.full(noise, -1))
        order = rng.permutation(count * n + noise)  # points carry no order
        xy = np.concatenate(xy)[order]
        coord = np.zeros((len(xy), 3), dtype=np.float32)
        coord[:, :2] = xy
        track_angle = np.zeros((1, MAX_TRACKS), dtype=np.float32)
        track_class = np.full((1, MAX_TRACKS), -1, dtype=np.int64)
        track_angle[0, :count] = np.remainder(angles, 2.0 * math.pi)
        track_class[0, :count] = classes
        return {
            "coord": coord,
            "feat": np.clip(np.concatenate(dedx)[order], 0.0, None).astype(np.float32)[:, None],
            "segment": np.concatenate(segment)[order].astype(np.int64),
            "instance": np.concatenate(instance)[order].astype(np.int64),
            "track_angle": track_angle,
            "track_class": track_class,
        }
