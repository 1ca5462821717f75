"""Frozen copy of the LArTPC event generator before it was optimised (issue 14).

The baseline of ``bench/lartpc_generator.py`` and the oracle of
``tests/test_lartpc_generator.py``: ``pimm.datasets.lartpc.generate_event``
must return exactly what :func:`generate_event` here returns for the same
random generator and options, field by field and bit by bit. Only the
simulation is kept (no data set class, no registration); do not edit it,
except to follow a documented physics fix in both places.

Taken from ``pimm/datasets/lartpc.py`` at commit ded85bc.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

__all__ = ["generate_event", "DEFAULT_PHYSICS"]

MIP = 0.63  # MeV per unit (2.1 MeV/cm over 3 mm) for a minimum-ionising particle
X0 = 46.7  # radiation length of argon, 14 cm, in units
E_CRIT = 32.0  # MeV: below this an electron mostly ionises instead of radiating
CONVERSION_LENGTH = 60.0  # units (9/7 X0): mean photon path before pair production
COMPTON_CUT = 3.0  # MeV: softer photons leave a blip instead of a pair
MUON_MASS, PROTON_MASS = 105.7, 938.3
SHOWER, TRACK, MICHEL, DELTA, LOW_ENERGY = range(5)

# Physics knobs and their defaults (all exposed as dataset arguments).
DEFAULT_PHYSICS: dict[str, Any] = dict(
    muon_prob=0.85,  # chance an interaction has a muon
    protons=(0, 3),  # protons per interaction (inclusive range)
    showers=(0, 2),  # EM showers per interaction (inclusive range)
    photon_fraction=0.6,  # share of showers started by a photon (gap before the cascade)
    muon_length=(100.0, 450.0),  # units
    proton_length=(8.0, 80.0),  # units
    shower_energy=(40.0, 500.0),  # MeV, log-uniform
    michel_prob=0.9,  # chance a contained stopping muon decays to a visible Michel
    delta_rate=0.01,  # delta rays per unit of muon length
    blips=(15, 45),  # low-energy blips around each interaction
    background_blips=(0, 10),  # blips anywhere in the detector, per event
    energy_noise=0.05,  # relative Gaussian smearing of each deposit
)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.sqrt(np.sum(v * v, axis=-1, keepdims=True))


def _isotropic(rng: np.random.Generator) -> np.ndarray:
    return _unit(rng.normal(size=3))


def _deflect(rng: np.random.Generator, d: np.ndarray, theta: float) -> np.ndarray:
    """Rotate unit vector ``d`` by polar angle ``theta`` around a random azimuth.

    Written with scalar math: it runs thousands of times per second and numpy's
    per-call overhead on 3-vectors would dominate."""
    dx, dy, dz = float(d[0]), float(d[1]), float(d[2])
    # u = normalised d x helper, helper = x-axis unless d is nearly along it.
    if abs(dx) < 0.9:
        ux, uy, uz = 0.0, dz, -dy
    else:
        ux, uy, uz = -dz, 0.0, dx
    norm = math.sqrt(ux * ux + uy * uy + uz * uz)
    ux, uy, uz = ux / norm, uy / norm, uz / norm
    wx, wy, wz = dy * uz - dz * uy, dz * ux - dx * uz, dx * uy - dy * ux  # w = d x u
    phi = rng.uniform(0.0, 2.0 * math.pi)
    c, s, cp, sp = math.cos(theta), math.sin(theta), math.cos(phi), math.sin(phi)
    out = np.array([c * dx + s * (cp * ux + sp * wx), c * dy + s * (cp * uy + sp * wy),
                    c * dz + s * (cp * uz + sp * wz)])
    return out / math.sqrt(float(out @ out))


class _Event:
    """Accumulates energy deposits (position, MeV, source) and the source table.

    A *source* is one labelled particle: its row holds (segment, instance,
    interaction). Low-energy deposits of an interaction share one source.
    Paths are simulated in batches (:meth:`walk`) because per-call numpy
    overhead, not arithmetic, is what costs time at a few thousand points."""

    def __init__(self, rng: np.random.Generator, size: float, step: float, noise: float):
        self.rng, self.size, self.step, self.noise = rng, size, step, noise
        self.pos: list[np.ndarray] = []
        self.de: list[np.ndarray] = []
        self.src: list[np.ndarray] = []
        self.sources: list[tuple[int, int, int]] = []
        self.next_instance = 0

    def new_source(self, segment: int, interaction: int) -> int:
        instance = -1
        if segment != LOW_ENERGY:
            instance, self.next_instance = self.next_instance, self.next_instance + 1
        self.sources.append((segment, instance, interaction))
        return len(self.sources) - 1

    def deposit(self, pos: np.ndarray, de: np.ndarray, src) -> None:
        self.pos.append(pos)
        self.de.append(de)
        self.src.append(np.broadcast_to(np.asarray(src, dtype=np.int64), (len(de),)))

    def walk(self, starts, dirs, lengths, theta0_fn):
        """Step along several paths at once, with multiple scattering.

        ``theta0_fn(residual, path)`` gives the rms scattering angle of each
        step from its residual path length and path index. Returns the step
        midpoints, their residual lengths and path indices, and each path's end
        point and final direction."""
        starts, dirs = np.asarray(starts, float).reshape(-1, 3), np.asarray(dirs, float).reshape(-1, 3)
        lengths = np.asarray(lengths, float)
        n = np.maximum(np.ceil(lengths / self.step).astype(np.int64), 1)
        path = np.repeat(np.arange(len(n)), n)
        first = np.cumsum(n) - n
        local = np.arange(len(path)) - first[path]
        residual = np.maximum(lengths[path] - (local + 0.5) * self.step, 0.25 * self.step)
        # A running sum of Gaussian kicks makes the direction a random walk whose
        # spread grows like sqrt(path length), as multiple Coulomb scattering does.
        kicks = self.rng.normal(size=(len(path), 3)) * theta0_fn(residual, path)[:, None]
        step_dirs = _unit(dirs[path] + _segmented_cumsum(kicks, first, path))
        pos = starts[path] + (_segmented_cumsum(step_dirs, first, path) - 0.5 * step_dirs) * self.step
        last = first + n - 1
        return pos, residual, path, pos[last] + 0.5 * self.step * step_dirs[last], step_dirs[last]

    def _highland(self, p: np.ndarray, mass) -> np.ndarray:
        beta_cp = p * p / np.sqrt(p * p + mass * mass)
        return np.minimum(13.6 / beta_cp * np.sqrt(self.step / X0), 0.5)

    def stopping_tracks(self, starts, dirs, lengths, kinds, srcs):
        """Muons/protons (``kinds`` rows: mass, momentum coefficient, Bragg
        range). dE/dx follows the Bragg-Kleeman law, rising as
        residual_range**-0.42 toward the stopping end (never below MIP); the
        momentum, hence the scattering, falls like residual_range**0.57."""
        mass, p_coef, bragg = np.asarray(kinds, float).reshape(-1, 3).T
        pos, res, path, _, _ = self.walk(
            starts, dirs, lengths, lambda r, k: self._highland(p_coef[k] * r**0.57, mass[k]))
        dedx = MIP * np.maximum((bragg[path] / res) ** 0.42, 1.0)
        self.deposit(pos, dedx * self.step, np.asarray(srcs)[path])
        return pos, path

    def electrons(self, starts, dirs, lengths, energies, srcs):
        """Electrons ionising at MIP while losing energy; the softer they get
        the more they scatter, which gives the characteristic wiggle."""
        lengths, energies = np.asarray(lengths, float), np.asarray(energies, float)
        pos, _, path, ends, end_dirs = self.walk(
            starts, dirs, lengths,
            lambda r, k: self._highland(np.maximum(energies[k] - MIP * (lengths[k] - r), 1.0), 0.511))
        self.deposit(pos, np.full(len(pos), MIP * self.step), np.asarray(srcs)[path])
        return ends, end_dirs

    def blips(self, centers, src: int) -> None:
        """Low-energy deposits: each centre gets one to three deposits within a
        voxel or so, of 0.05-0.6 MeV each."""
        centers = np.asarray(centers, dtype=float).reshape(-1, 3)
        if len(centers) == 0:
            return
        pos = np.repeat(centers, self.rng.integers(1, 4, size=len(centers)), axis=0)
        pos = pos + self.rng.uniform(-0.8, 0.8, size=pos.shape)
        self.deposit(pos, self.rng.uniform(0.05, 0.6, size=len(pos)), src)

    def showers(self, primaries: list, le_src: int) -> None:
        """Branching EM cascades, one generation of all showers per round.

        ``primaries`` holds (is_photon, start, direction, MeV, source). Photons
        fly an exponential distance (the visible gap) and convert into an e+e-
        pair; soft photons leave a low-energy blip instead. Electrons above
        E_CRIT ionise for an exponential distance, then radiate a photon and
        go on; softer electrons ionise until they stop."""
        rng = self.rng
        photons = [p[1:] for p in primaries if p[0]]
        electrons = [p[1:] for p in primaries if not p[0]]
        soft = []
        while photons or electrons:
            for pos, d, e, src in photons:
                pos = pos + d * rng.exponential(CONVERSION_LENGTH)
                if e < COMPTON_CUT:
                    soft.append(pos)
                    continue
                u = rng.uniform(0.15, 0.85)
                opening = min(0.6, 2.0 / e + 0.02)
                for frac in (u, 1.0 - u):
                    electrons.append((pos, _deflect(rng, d, abs(rng.normal(0.0, opening))), e * frac, src))
            photons = []
            if not electrons:
                break
            energy = np.array([e[2] for e in electrons])
            radiating = energy >= E_CRIT
            travel = np.where(radiating, np.minimum(rng.exponential(0.5 * X0, len(energy)) + 1.0, energy / MIP),
                              np.maximum(energy / MIP, self.step))
            ends, end_dirs = self.electrons([e[0] for e in electrons], [e[1] for e in electrons], travel,
                                            energy, [e[3] for e in electrons])
            left = energy - MIP * travel
            y = rng.uniform(0.2, 0.7, size=len(energy))  # hard part of the bremsstrahlung spectrum
            srcs = [e[3] for e in electrons]
            electrons = []
            for k in np.flatnonzero(radiating & (left > 1.0)):
                photons.append((ends[k], _deflect(rng, end_dirs[k], abs(rng.normal(0.0, 0.08))), y[k] * left[k], srcs[k]))
                electrons.append((ends[k], end_dirs[k], (1.0 - y[k]) * left[k], srcs[k]))
        self.blips(soft, le_src)

    def voxel_keys(self, voxel_size: float, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Linear voxel key of every deposit inside the detector (from the
        ``since``-th deposit batch on), and the inside mask."""
        pos = np.concatenate(self.pos[since:])
        n_vox = int(np.ceil(self.size / voxel_size))
        idx = np.floor(pos / voxel_size).astype(np.int64)
        inside = np.all((idx >= 0) & (idx < n_vox) & (pos < self.size), axis=1)
        idx = idx[inside]
        return (idx[:, 0] * n_vox + idx[:, 1]) * n_vox + idx[:, 2], inside


def _segmented_cumsum(x: np.ndarray, first: np.ndarray, path: np.ndarray) -> np.ndarray:
    """Cumulative sum along axis 0 restarting at every path's first row."""
    total = np.cumsum(x, axis=0)
    before = np.zeros((len(first),) + x.shape[1:])
    before[1:] = total[first[1:] - 1]
    return total - before[path]


def _interaction(ev: _Event, interaction: int, phys: dict) -> None:
    """One neutrino-like interaction: a vertex with a muon, protons, showers,
    and the Michel, delta rays and low-energy blips they bring along."""
    rng, size = ev.rng, ev.size
    vertex = rng.uniform(0.15 * size, 0.85 * size, size=3)
    le_src = ev.new_source(LOW_ENERGY, interaction)
    has_muon = rng.random() < phys["muon_prob"]
    n_protons = rng.integers(phys["protons"][0], phys["protons"][1] + 1)
    kinds = [(MUON_MASS, 10.6, 60.0)] * has_muon + [(PROTON_MASS, 68.0, 262.0)] * n_protons
    lengths = [rng.uniform(*phys["muon_length"])] * has_muon + list(
        np.exp(rng.uniform(*np.log(phys["proton_length"]), size=n_protons)))
    if kinds:
        srcs = [ev.new_source(TRACK, interaction) for _ in kinds]
        dirs = _unit(rng.normal(size=(len(kinds), 3)))
        pos, path = ev.stopping_tracks(np.tile(vertex, (len(kinds), 1)), dirs, lengths, kinds, srcs)
    if has_muon:
        # The muon is path 0: it may decay at its end and it kicks out delta rays.
        mu = pos[path == 0]
        starts, dirs, travel, energies, srcs = [], [], [], [], []
        end = mu[-1]
        if np.all((end > 2.0) & (end < size - 2.0)) and rng.random() < phys["michel_prob"]:
            energy = 52.8 * rng.beta(3.0, 1.6)  # Michel spectrum peaks at the endpoint
            # Only part of the energy shows up as the ionising track; the rest is
            # radiated and mostly escapes as diffuse photons.
            starts.append(end), dirs.append(_isotropic(rng)), travel.append(max(0.6 * energy / MIP, 3.0))
            energies.append(energy), srcs.append(ev.new_source(MICHEL, interaction))
        inside = np.all((mu >= 0) & (mu < size), axis=1)
        # Delta rays start away from the stopping end so they never mimic a Michel.
        candidates = np.flatnonzero(inside[: max(len(mu) - int(10 / ev.step), 1)])
        n_delta = rng.poisson(phys["delta_rate"] * inside.sum() * ev.step) if len(candidates) else 0
        parent_dirs = _unit(np.diff(mu, axis=0, prepend=vertex[None]))
        t_min, t_max = 2.0, 25.0
        for k in rng.choice(candidates, size=n_delta) if n_delta else []:
            # Knock-on electrons follow a 1/T^2 spectrum (inverse-CDF sample).
            energy = 1.0 / (1.0 / t_min - rng.random() * (1.0 / t_min - 1.0 / t_max))
            starts.append(mu[k]), dirs.append(_deflect(rng, parent_dirs[k], rng.uniform(0.4, 1.2)))
            travel.append(max(0.8 * energy / MIP, 3.0)), energies.append(energy)
            srcs.append(ev.new_source(DELTA, interaction))
        if starts:
            ev.electrons(starts, dirs, travel, energies, srcs)
    primaries = []
    for _ in range(rng.integers(phys["showers"][0], phys["showers"][1] + 1)):
        energy = np.exp(rng.uniform(*np.log(phys["shower_energy"])))
        photon = rng.random() < phys["photon_fraction"]
        primaries.append((photon, vertex, _isotropic(rng), energy, ev.new_source(SHOWER, interaction)))
    ev.showers(primaries, le_src)
    n_blips = rng.integers(phys["blips"][0], phys["blips"][1] + 1)
    ev.blips(vertex + rng.normal(0.0, 60.0, size=(n_blips, 3)), le_src)


def generate_event(rng: np.random.Generator, voxel_size: float = 1.0,
                   points_per_event: int | Sequence[int] = (1000, 2500),
                   max_interactions: int = 32, detector_size: float = 768.0,
                   energy_threshold: float = 0.0, **physics: Any) -> dict[str, np.ndarray]:
    """Simulate and voxelise one event using only ``rng``.

    Interactions are added until the voxel count reaches a target drawn from
    ``points_per_event`` (or ``max_interactions`` is hit); the last interaction
    is kept whole, so an event can overshoot the upper bound by one
    interaction's worth of points."""
    phys = {**DEFAULT_PHYSICS, **physics}
    bounds = np.atleast_1d(points_per_event)
    target = rng.integers(int(bounds[0]), int(bounds[-1]) + 1)
    ev = _Event(rng, detector_size, step=min(0.5 * voxel_size, 2.0), noise=phys["energy_noise"])
    count = 0
    for interaction in range(max_interactions):
        since = len(ev.pos)
        _interaction(ev, interaction, phys)
        # Voxels shared between interactions are counted twice; they are rare
        # and the target is approximate anyway, while a full recount is not free.
        count += len(np.unique(ev.voxel_keys(voxel_size, since)[0]))
        if count >= target:
            break
    bg_src = ev.new_source(LOW_ENERGY, -1)
    n_blips = rng.integers(phys["background_blips"][0], phys["background_blips"][1] + 1)
    ev.blips(rng.uniform(0.0, detector_size, size=(n_blips, 3)), bg_src)
    return _voxelise(ev, voxel_size, energy_threshold)


def _voxelise(ev: _Event, voxel_size: float, energy_threshold: float) -> dict[str, np.ndarray]:
    """Merge deposits per voxel: energies add up, labels come from the source
    with the largest summed energy in the voxel."""
    keys, inside = ev.voxel_keys(voxel_size)
    de = np.concatenate(ev.de)
    # Detector response: smear every deposit (one draw for the whole event).
    de = (de * np.clip(1.0 + ev.noise * ev.rng.normal(size=len(de)), 0.2, None))[inside]
    src = np.concatenate(ev.src)[inside]
    n_src = len(ev.sources)
    # First sum per (voxel, source) pair, then pick the strongest pair per voxel.
    pairs, inv = np.unique(keys * n_src + src, return_inverse=True)
    pair_e = np.bincount(inv, weights=de)
    pair_vox, pair_src = pairs // n_src, pairs % n_src
    order = np.lexsort((-pair_e, pair_vox))
    first = np.ones(len(order), dtype=bool)
    first[1:] = pair_vox[order][1:] != pair_vox[order][:-1]
    vox = pair_vox[order][first]
    dominant = pair_src[order][first]
    group = np.cumsum(first) - 1
    energy = np.bincount(group, weights=pair_e[order])
    keep = energy >= energy_threshold
    vox, dominant, energy = vox[keep], dominant[keep], energy[keep]
    n_vox = int(np.ceil(ev.size / voxel_size))
    ijk = np.stack([vox // (n_vox * n_vox), (vox // n_vox) % n_vox, vox % n_vox], axis=1)
    table = np.asarray(ev.sources, dtype=np.int64).reshape(-1, 3)
    segment, instance, interaction = table[dominant, 0], _compact(table[dominant, 1]), table[dominant, 2]
    # Group points by cluster as PILArNet files do: low-energy deposits first
    # (one cluster per interaction), then one cluster per particle instance.
    is_particle = instance >= 0
    order = np.lexsort((vox, np.where(is_particle, instance, interaction), is_particle))
    return dict(
        coord=(ijk[order] * voxel_size).astype(np.float32),
        energy=energy[order].astype(np.float32)[:, None],
        segment=segment[order],
        instance=instance[order],
        interaction=interaction[order],
    )


def _compact(instance: np.ndarray) -> np.ndarray:
    """Renumber instance ids to 0..K-1 in order of first id (particles that lost
    every voxel to others leave no gaps); -1 stays -1."""
    out = np.full_like(instance, -1)
    valid = instance >= 0
    out[valid] = np.unique(instance[valid], return_inverse=True)[1]
    return out
