"""Charged-particle paths of the synthetic LArTPC generator, and the deposit ledger.

Every visible particle of :mod:`pimm.datasets.lartpc` is a path stepped in
half-voxel steps with multiple Coulomb scattering; this module does that
stepping and keeps the resulting energy deposits. It is the generator's hot
spot, so it is written for small arrays: a path batch costs a fixed ~20 numpy
calls whatever its length, per-path bookkeeping stays in Python lists (a few
paths per call), and 3-vectors that are drawn one at a time are Python floats
normalised in batches.

The events must stay what they were before this was optimised, bit for bit
(``bench/lartpc_generator_reference.py`` is the original), so every float
operation here is the one the original did, in the same order: cumulative
sums run over one call's paths and are then offset per path, the squared
norm of a row is ``(x*x + y*y) + z*z`` (what ``np.sum(axis=-1)`` gives), a
deflected direction is normalised with a BLAS dot product (``np.vecdot``
calls the same ``ddot`` as ``v @ v``), and the random draws come in the
original order and shapes.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

MIP = 0.63  # MeV per unit (2.1 MeV/cm over 3 mm) for a minimum-ionising particle
X0 = 46.7  # radiation length of argon, 14 cm, in units
ELECTRON_MASS = 0.511
SHOWER, TRACK, MICHEL, DELTA, LOW_ENERGY = range(5)


def unit_rows(v: np.ndarray) -> np.ndarray:
    """Rows of ``v`` (n, 3) scaled to unit length."""
    sq = v * v
    norm = sq[:, 0] + sq[:, 1]
    norm += sq[:, 2]
    return v / np.sqrt(norm, out=norm)[:, None]


def isotropic(rng: np.random.Generator) -> list[float]:
    """A random unit vector, as three floats."""
    x, y, z = rng.normal(size=3).tolist()
    norm = math.sqrt(x * x + y * y + z * z)
    return [x / norm, y / norm, z / norm]


def deflected(rng: np.random.Generator, d, theta: float) -> list[float]:
    """Unit vector ``d`` rotated by polar angle ``theta`` around a random
    azimuth, *not yet normalised*: pass a batch through :func:`normalised`."""
    dx, dy, dz = d
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
    return [c * dx + s * (cp * ux + sp * wx), c * dy + s * (cp * uy + sp * wy),
            c * dz + s * (cp * uz + sp * wz)]


def normalised(vectors: list) -> np.ndarray:
    """Rows of a (k, 3) list scaled to unit length with the BLAS dot product."""
    v = np.array(vectors, dtype=float)
    return v / np.sqrt(np.vecdot(v, v))[:, None]


@lru_cache(maxsize=8)
def _step_offsets(step: float, count: int) -> np.ndarray:
    """Distance from a path's start to the middle of each of its steps."""
    return (np.arange(count) + 0.5) * step


def _path_cumsum(x: np.ndarray, first_count: int, previous_ends, later_counts) -> np.ndarray:
    """Cumulative sum over all rows of a call, then minus the total up to the
    previous path's end for every later path (not a restart: bit for bit what
    the original did). ``previous_ends`` is None for a single path."""
    total = x.cumsum(axis=0)
    if previous_ends is not None:
        total[first_count:] -= total[previous_ends].repeat(later_counts, axis=0)
    return total


class Deposits:
    """Energy deposits (position, MeV, source) of one event and its source table.

    A *source* is one labelled particle: its row holds (segment, instance,
    interaction). Low-energy deposits of an interaction share one source.
    ``truth`` maps a source to its particle truth (:meth:`set_truth`), which
    the generator records from values it has already drawn: recording it
    never draws from ``rng``, so events stay what they were without it."""

    def __init__(self, rng: np.random.Generator, size: float, step: float, noise: float):
        self.rng, self.size, self.step, self.noise = rng, size, step, noise
        self.pos: list[np.ndarray] = []
        self.de: list[np.ndarray] = []
        self.src: list[np.ndarray] = []
        self.sources: list[tuple[int, int, int]] = []
        self.truth: dict[int, tuple] = {}
        self.next_instance = 0

    def new_source(self, segment: int, interaction: int) -> int:
        instance = -1
        if segment != LOW_ENERGY:
            instance, self.next_instance = self.next_instance, self.next_instance + 1
        self.sources.append((segment, instance, interaction))
        return len(self.sources) - 1

    def set_truth(self, src: int, pid: int, momentum: float, direction, vertex, primary: bool) -> None:
        """Particle truth of source ``src``: particle type (0 photon, 1
        electron, 2 muon, 3 pion, 4 proton), |p| in MeV, unit direction, the
        interaction vertex and whether it leaves the vertex (primary)."""
        self.truth[src] = (pid, float(momentum), *(float(c) for c in direction), *(float(c) for c in vertex),
                           int(bool(primary)))

    def deposit(self, pos: np.ndarray, de: np.ndarray, src: np.ndarray) -> None:
        self.pos.append(pos)
        self.de.append(de)
        self.src.append(src)

    # -- stepping ---------------------------------------------------------------

    def _steps(self, lengths: list) -> tuple[list[int], np.ndarray, np.ndarray]:
        """Steps per path, the residual path length at every step's middle and
        each path's length at every step."""
        step = self.step
        counts = [max(math.ceil(length / step), 1) for length in lengths]
        offsets = _step_offsets(step, max(64, 1 << (max(counts) - 1).bit_length()))
        if len(counts) == 1:
            per_step_length = lengths[0]
            residual = per_step_length - offsets[: counts[0]]
        else:
            per_step_length = np.array(lengths, dtype=float).repeat(counts)
            residual = per_step_length - np.concatenate([offsets[:c] for c in counts])
        return counts, np.maximum(residual, 0.25 * step, out=residual), per_step_length

    @staticmethod
    def _per_step(values, counts: list[int]):
        """A per-path value for every step (a scalar when there is one path)."""
        if len(counts) == 1:
            return values[0]
        return np.asarray(values).repeat(counts, axis=0)

    def _scatter(self, starts: np.ndarray, dirs: np.ndarray, counts: list[int], theta: np.ndarray):
        """Walk the paths with Gaussian direction kicks of rms ``theta`` per step.

        A running sum of the kicks makes the direction a random walk whose
        spread grows like sqrt(path length), as multiple scattering does.
        ``starts`` is (k, 3) or one (3,) start shared by every path. Returns
        the step midpoints and each path's end point and final direction
        (both (k, 3))."""
        kicks = self.rng.normal(size=(len(theta), 3))
        kicks *= theta[:, None]
        if len(counts) == 1:
            last, previous_ends, later = slice(-1, None), None, None
        else:
            last = np.array(counts).cumsum()
            last -= 1
            previous_ends, later = last[:-1], counts[1:]
        step_dirs = _path_cumsum(kicks, counts[0], previous_ends, later)
        step_dirs += dirs[0] if later is None else dirs.repeat(counts, axis=0)
        sq = step_dirs * step_dirs
        norm = sq[:, 0] + sq[:, 1]
        norm += sq[:, 2]
        step_dirs /= np.sqrt(norm, out=norm)[:, None]
        pos = _path_cumsum(step_dirs, counts[0], previous_ends, later)
        pos -= 0.5 * step_dirs
        pos *= self.step
        if starts.ndim == 2:
            starts = starts[0] if later is None else starts.repeat(counts, axis=0)
        pos += starts
        end_dirs = step_dirs[last]
        return pos, pos[last] + 0.5 * self.step * end_dirs, end_dirs

    def _highland(self, p: np.ndarray, mass_squared) -> np.ndarray:
        """Highland rms scattering angle per step (capped at 0.5 rad) from the
        momentum ``p`` (MeV) and the particle's squared mass."""
        pp = p * p
        beta_cp = pp / np.sqrt(pp + mass_squared)
        theta = np.divide(13.6, beta_cp, out=beta_cp)
        theta *= np.sqrt(self.step / X0)
        return np.minimum(theta, 0.5, out=theta)

    # -- particles --------------------------------------------------------------

    def stopping_tracks(self, start: np.ndarray, dirs: np.ndarray, lengths: list, kinds: list, srcs: list):
        """Muons/protons from one ``start`` (``kinds`` rows: mass, momentum
        coefficient, Bragg range). dE/dx follows the Bragg-Kleeman law, rising
        as residual_range**-0.42 toward the stopping end (never below MIP);
        the momentum, hence the scattering, falls like residual_range**0.57.
        Returns the step midpoints and the steps per path."""
        counts, residual, _ = self._steps(lengths)
        mass, p_coef, bragg = zip(*kinds)
        momentum = residual**0.57
        momentum *= self._per_step(p_coef, counts)
        mass_squared = self._per_step([m * m for m in mass], counts)
        pos, _, _ = self._scatter(start, dirs, counts, self._highland(momentum, mass_squared))
        dedx = self._per_step(bragg, counts) / residual
        dedx = dedx**0.42
        np.maximum(dedx, 1.0, out=dedx)
        dedx = MIP * dedx
        dedx *= self.step
        self.deposit(pos, dedx, np.array(srcs, dtype=np.int64).repeat(counts))
        return pos, counts

    def electrons(self, starts: np.ndarray, dirs: np.ndarray, lengths: list, energies: list, srcs: list):
        """Electrons ionising at MIP while losing energy; the softer they get
        the more they scatter, which gives the characteristic wiggle. Returns
        each path's end point and final direction."""
        counts, residual, per_step_length = self._steps(lengths)
        momentum = per_step_length - residual
        momentum *= MIP
        momentum = np.subtract(self._per_step(energies, counts), momentum, out=momentum)
        np.maximum(momentum, 1.0, out=momentum)
        pos, ends, end_dirs = self._scatter(starts, dirs, counts,
                                            self._highland(momentum, ELECTRON_MASS * ELECTRON_MASS))
        de = np.empty(len(pos))
        de.fill(MIP * self.step)
        self.deposit(pos, de, np.array(srcs, dtype=np.int64).repeat(counts))
        return ends, end_dirs

    def blips(self, centers: np.ndarray, src: int) -> None:
        """Low-energy deposits: each centre gets one to three deposits within a
        voxel or so, of 0.05-0.6 MeV each."""
        if len(centers) == 0:
            return
        rng = self.rng
        pos = np.repeat(centers, rng.integers(1, 4, size=len(centers)), axis=0)
        pos += rng.uniform(-0.8, 0.8, size=pos.shape)
        self.deposit(pos, rng.uniform(0.05, 0.6, size=len(pos)), np.full(len(pos), src, dtype=np.int64))

    # -- voxels -----------------------------------------------------------------

    def voxel_keys(self, voxel_size: float, since: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Linear voxel key of every deposit inside the detector (from the
        ``since``-th deposit batch on), and the inside mask."""
        pos = np.concatenate(self.pos[since:])
        n_vox = int(np.ceil(self.size / voxel_size))
        corner = np.floor(pos / voxel_size)
        # Reductions along the short axis are slow in numpy: combine columns.
        ok = (corner >= 0) & (corner < n_vox) & (pos < self.size)
        inside = ok[:, 0] & ok[:, 1]
        inside &= ok[:, 2]
        idx = corner.astype(np.int64)
        keys = (idx[:, 0] * n_vox + idx[:, 1]) * n_vox + idx[:, 2]
        return (keys if inside.all() else keys[inside]), inside
