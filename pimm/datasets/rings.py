"""Synthetic water-Cherenkov ring events: electron vs muon images.

A small, fast stand-in for a Super-Kamiokande-like detector, so image
classification can be trained and tested end to end without any data files.
Each event is one charged particle (electron or muon) starting inside an
upright cylindrical water tank. The photomultiplier-lined barrel wall is
unrolled into a 2D image: columns are the azimuth ``phi`` (periodic), rows are
the height ``z``. The end caps are not instrumented in this toy, so light that
reaches them is lost, and rings near the top/bottom are clipped.

What tells the classes apart is what does in a real detector: a muon is a
single straight track that radiates until it falls below the Cherenkov
threshold, so its ring has a sharp outer edge and is filled towards the
inside (the cone angle shrinks as it slows and the emission point moves
towards the wall). An electron showers: light comes from many scattered
low-energy secondaries, so its ring is a fuzzy, diffuse-edged blob at the
full 41 degree angle. Momenta are randomised over the same range for both
species, so the total charge overlaps and is no give-away on its own.

Everything is generated on the fly from ``np.random.default_rng([seed,
split_code, index])``: an event depends only on (seed, split, index), never on
the global RNG, worker id or access order, so resumed and multi-worker runs
see the same data. See ``docs/rings.md`` for the model and its simplifications.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pimm.engines.registries import DATASETS
from pimm.utils.errors import UserError
from pimm.utils.domains import Choice, Count, Int, Length, NonNeg, Pair, PosInt, Positive, Prob, Real, Seq

__all__ = ["CherenkovRingDataset", "ELECTRON_MASS", "MUON_MASS"]

ELECTRON_MASS = 0.511  # MeV/c^2
MUON_MASS = 105.66  # MeV/c^2
SPEED_OF_LIGHT = 29.98  # cm/ns
WATER_X0 = 36.08  # radiation length of water, cm
WATER_CRITICAL_ENERGY = 78.3  # MeV, sets where an EM shower peaks
_HIT_THRESHOLD_PE = 0.25  # smallest charge a hit pixel reports
_SPLIT_CODES = {"train": 0, "val": 1, "test": 2}


def _positive(name: str, value, allow_zero: bool = False) -> float:
    """Reject non-numbers and non-positive values with a message naming the argument."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"CherenkovRingDataset: {name} must be a finite number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"CherenkovRingDataset: {name} must be {bound}, got {value!r}")
    return float(value)


def _orthonormal_basis(axis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two unit vectors perpendicular to each row of ``axis`` (N,3) and to each other.

    Branch-free construction (Duff et al. 2017), much cheaper than cross
    products with a helper vector for the thousands of photons of an event."""
    x, y, z = axis[:, 0], axis[:, 1], axis[:, 2]
    sign = np.where(z >= 0.0, 1.0, -1.0)
    a = -1.0 / (sign + z)
    b = x * y * a
    u = np.stack([1.0 + sign * x * x * a, sign * b, -sign * x], axis=1)
    v = np.stack([b, sign + y * y * a, -y], axis=1)
    return u, v


def _random_azimuth(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``n`` uniform azimuths.

    Evaluated in float32, where numpy's trig is vectorised (~10x faster than
    float64); 1e-7 precision is far below a pixel."""
    azimuth = rng.random(n, dtype=np.float32) * np.float32(2.0 * math.pi)
    return np.cos(azimuth).astype(np.float64), np.sin(azimuth).astype(np.float64)


def _tilt(axis: np.ndarray, cos_theta, sin_theta, cos_az: np.ndarray, sin_az: np.ndarray) -> np.ndarray:
    """Unit vectors at polar angle theta and azimuth ``az`` around ``axis``: one (3,)
    vector shared by all, or one row of an (N,3) array each."""
    if axis.ndim == 1:
        u, v = (w[0] for w in _orthonormal_basis(axis[None, :]))
    else:
        u, v = _orthonormal_basis(axis)
    # (N,1) * (3,) and (N,1) * (N,3) both broadcast to (N,3).
    return (
        cos_theta[:, None] * axis
        + (sin_theta * cos_az)[:, None] * u
        + (sin_theta * sin_az)[:, None] * v
    )


def _barrel_distance(origin: np.ndarray, direction: np.ndarray, radius: float) -> np.ndarray:
    """Path length from points inside the infinite cylinder ``x^2+y^2 = radius^2`` to its wall.

    ``origin`` (N,3) or (3,), ``direction`` (N,3) unit vectors. Rays along z never
    reach the barrel: they get +inf."""
    ox, oy = origin[..., 0], origin[..., 1]
    dx, dy = direction[:, 0], direction[:, 1]
    a = dx * dx + dy * dy
    b = 2.0 * (ox * dx + oy * dy)
    c = ox * ox + oy * oy - radius * radius  # < 0 inside, so the root below is real
    safe_a = np.maximum(a, 1e-12)
    dist = (np.sqrt(np.maximum(b * b - 4.0 * safe_a * c, 0.0)) - b) / (2.0 * safe_a)
    return np.where(a > 1e-12, dist, np.inf)


@DATASETS.register_module()
class CherenkovRingDataset(torch.utils.data.Dataset):
    """Electron (label 0) vs muon (label 1) rings on an unrolled cylindrical barrel.

    Args:
        num_events: number of events (``len(dataset)``).
        seed: base seed; with ``split`` and the index it fully determines an event.
        split: ``"train"``, ``"val"`` or ``"test"``: disjoint event streams.
        image_size: ``(H, W)`` = (z bins, phi bins) of the unrolled barrel.
        with_time: add a second channel with the mean hit time of each pixel.
        momentum_range: ``(min, max)`` momentum in MeV/c, drawn uniformly for both species.
            The minimum must be above the muon Cherenkov threshold (~121 MeV/c).
        tank_radius, tank_half_height: tank size in cm.
        fiducial_margin: vertices are at least this far (cm) from every wall.
        min_towall: the direction is re-drawn (up to a few times) until the
            distance from the vertex to the barrel along it is at least this (cm),
            so rings are not vanishingly small.
        max_abs_cos_zenith: directions have ``|dir_z|`` below this, so most light
            reaches the barrel rather than the caps.
        refractive_index: of water (Cherenkov angle ``cos = 1/(n beta)``).
        pe_per_cm: detected photo-electrons per cm of track at the maximum
            Cherenkov angle (light yield times coverage and quantum efficiency).
        dedx: energy loss, MeV/cm, used for the muon range and the electron
            shower's total track length.
        shower_spread: typical angle (rad) of shower secondaries to the electron
            axis: the electron ring's blur.
        attenuation_length: light attenuation length in water, cm.
        noise_rate: mean dark-noise photo-electrons per pixel per event.
        gain_spread: relative single-photo-electron charge resolution.
        time_jitter: photomultiplier time resolution, ns.
        time_scale: hit times (ns after the first signal photon) are divided by this.
        log_charge: store ``log1p(charge)`` rather than the raw charge (PE).
        in_memory: generate every event once, at construction, and serve it from
            memory (``num_events * C * H * W`` float32). Same values as on the fly,
            just no regeneration each epoch; built before any DataLoader worker
            starts, so workers share it.
    """

    class_names = ("electron", "muon")
    num_classes = 2

    domains = dict(num_events=PosInt, seed=Count, split=Choice("train", "val", "test"),
                   image_size=Seq(Int(4, 4096), length=2), momentum_range=Pair(Positive), tank_radius=Length,
                   tank_half_height=Length, fiducial_margin=NonNeg, min_towall=NonNeg,
                   max_abs_cos_zenith=Real(0, 1, lo_open=True), refractive_index=Real(1, 10, lo_open=True),
                   pe_per_cm=Positive, dedx=Positive, shower_spread=NonNeg, attenuation_length=Length,
                   noise_rate=Prob, gain_spread=Real(0, 10), time_jitter=NonNeg, time_scale=Positive)

    def __init__(
        self,
        num_events: int,
        seed: int = 0,
        split: str = "train",
        image_size: tuple[int, int] = (32, 64),
        with_time: bool = True,
        momentum_range: tuple[float, float] = (200.0, 1000.0),
        tank_radius: float = 400.0,
        tank_half_height: float = 600.0,
        fiducial_margin: float = 100.0,
        min_towall: float = 200.0,
        max_abs_cos_zenith: float = 0.5,
        refractive_index: float = 1.33,
        pe_per_cm: float = 5.0,
        dedx: float = 2.0,
        shower_spread: float = 0.12,
        attenuation_length: float = 5000.0,
        noise_rate: float = 0.02,
        gain_spread: float = 0.3,
        time_jitter: float = 1.5,
        time_scale: float = 20.0,
        log_charge: bool = True,
        in_memory: bool = False,
    ):
        super().__init__()
        if isinstance(num_events, bool) or not isinstance(num_events, (int, np.integer)) or num_events <= 0:
            raise UserError(f"CherenkovRingDataset: num_events must be a positive integer, got {num_events!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise UserError(f"CherenkovRingDataset: seed must be a non-negative integer, got {seed!r}")
        if split not in _SPLIT_CODES:
            raise UserError(f"CherenkovRingDataset: split must be one of {sorted(_SPLIT_CODES)}, got {split!r}")
        try:
            height, width = (int(s) for s in image_size)
        except (TypeError, ValueError):
            raise UserError(f"CherenkovRingDataset: image_size must be (H, W), got {image_size!r}") from None
        if height < 4 or width < 4:
            raise UserError(f"CherenkovRingDataset: image_size must be at least (4, 4), got {image_size!r}")
        try:
            p_lo, p_hi = (float(p) for p in momentum_range)
        except (TypeError, ValueError):
            raise UserError(
                f"CherenkovRingDataset: momentum_range must be (min, max) in MeV/c, got {momentum_range!r}"
            ) from None
        n = _positive("refractive_index", refractive_index)
        if n <= 1.0:
            raise UserError(f"CherenkovRingDataset: refractive_index must be > 1, got {refractive_index!r}")
        muon_threshold = MUON_MASS / math.sqrt(n * n - 1.0)
        if not (muon_threshold < p_lo <= p_hi):
            raise UserError(
                f"CherenkovRingDataset: momentum_range must satisfy {muon_threshold:.1f} "
                f"(muon Cherenkov threshold, MeV/c) < min <= max, got {momentum_range!r}"
            )
        self.num_events = int(num_events)
        self.seed = int(seed)
        self.split = split
        self.image_size = (height, width)
        self.with_time = bool(with_time)
        self.momentum_range = (p_lo, p_hi)
        self.tank_radius = _positive("tank_radius", tank_radius)
        self.tank_half_height = _positive("tank_half_height", tank_half_height)
        self.fiducial_margin = _positive("fiducial_margin", fiducial_margin, allow_zero=True)
        if self.fiducial_margin >= min(self.tank_radius, self.tank_half_height):
            raise UserError(
                f"CherenkovRingDataset: fiducial_margin ({fiducial_margin}) must be smaller than "
                "tank_radius and tank_half_height"
            )
        self.min_towall = _positive("min_towall", min_towall, allow_zero=True)
        self.max_abs_cos_zenith = _positive("max_abs_cos_zenith", max_abs_cos_zenith)
        if self.max_abs_cos_zenith > 1.0:
            raise UserError(f"CherenkovRingDataset: max_abs_cos_zenith must be in (0, 1], got {max_abs_cos_zenith!r}")
        self.refractive_index = n
        self.pe_per_cm = _positive("pe_per_cm", pe_per_cm)
        self.dedx = _positive("dedx", dedx)
        self.shower_spread = _positive("shower_spread", shower_spread, allow_zero=True)
        self.attenuation_length = _positive("attenuation_length", attenuation_length)
        self.noise_rate = _positive("noise_rate", noise_rate, allow_zero=True)
        self.gain_spread = _positive("gain_spread", gain_spread, allow_zero=True)
        self.time_jitter = _positive("time_jitter", time_jitter, allow_zero=True)
        self.time_scale = _positive("time_scale", time_scale)
        self.log_charge = bool(log_charge)
        self.in_channels = 2 if self.with_time else 1
        # Kinetic energy at which a muon stops radiating; the cone closes there.
        self._muon_threshold_kinetic = math.hypot(muon_threshold, MUON_MASS) - MUON_MASS
        self._sin2_max = 1.0 - 1.0 / n**2
        self._memory: dict[str, torch.Tensor] | None = None
        if in_memory:
            events = [self.generate(i) for i in range(self.num_events)]
            self._memory = {
                "img": torch.from_numpy(np.stack([e["img"] for e in events])),
                "label": torch.tensor([e["label"] for e in events], dtype=torch.int64),
                "momentum": torch.tensor([e["momentum"] for e in events], dtype=torch.float32),
            }

    def __len__(self) -> int:
        return self.num_events

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        index = int(index)
        if index < 0:
            index += self.num_events
        if not 0 <= index < self.num_events:
            raise IndexError(f"CherenkovRingDataset index {index} out of range for {self.num_events} events")
        if self._memory is not None:
            # Clone so a caller mutating its sample cannot corrupt the stored event.
            return {key: value[index].clone() for key, value in self._memory.items()}
        event = self.generate(index)
        return {
            "img": torch.from_numpy(event["img"]),
            "label": torch.tensor(event["label"], dtype=torch.int64),
            "momentum": torch.tensor(event["momentum"], dtype=torch.float32),
        }

    # ------------------------------------------------------------------ physics

    def generate(self, index: int) -> dict:
        """Simulate event ``index``; returns numpy arrays and the truth (vertex, direction too)."""
        rng = np.random.default_rng([self.seed, _SPLIT_CODES[self.split], index])
        label = int(rng.integers(2))
        momentum = float(rng.uniform(*self.momentum_range))
        vertex, direction = self._sample_kinematics(rng)
        if label == 1:
            origins, parents, cos_cone, t_emit = self._muon_photons(rng, vertex, direction, momentum)
        else:
            origins, parents, cos_cone, t_emit = self._electron_photons(rng, vertex, direction, momentum)
        img = self._detect(rng, origins, parents, cos_cone, t_emit)
        return {"img": img, "label": label, "momentum": momentum, "vertex": vertex, "direction": direction}

    def _sample_kinematics(self, rng: np.random.Generator, tries: int = 8) -> tuple[np.ndarray, np.ndarray]:
        """Vertex uniform in the fiducial volume; direction isotropic in azimuth with
        bounded zenith, re-drawn until the barrel is at least ``min_towall`` away."""
        r_fid = self.tank_radius - self.fiducial_margin
        z_fid = self.tank_half_height - self.fiducial_margin
        r = r_fid * math.sqrt(rng.random())
        phi = rng.uniform(0.0, 2.0 * math.pi)
        vertex = np.array([r * math.cos(phi), r * math.sin(phi), rng.uniform(-z_fid, z_fid)])
        cz = rng.uniform(-self.max_abs_cos_zenith, self.max_abs_cos_zenith, size=tries)
        az = rng.uniform(0.0, 2.0 * math.pi, size=tries)
        sz = np.sqrt(1.0 - cz**2)
        candidates = np.stack([sz * np.cos(az), sz * np.sin(az), cz], axis=1)
        towall = _barrel_distance(vertex, candidates, self.tank_radius)
        ok = np.flatnonzero(towall >= self.min_towall)
        pick = ok[0] if ok.size else int(np.argmax(towall))
        return vertex, candidates[pick]

    def _exit_distance(self, vertex: np.ndarray, direction: np.ndarray) -> float:
        """Path length from ``vertex`` along ``direction`` to the tank wall (barrel or cap)."""
        barrel = float(_barrel_distance(vertex, direction[None, :], self.tank_radius)[0])
        dz = direction[2]
        cap = (math.copysign(self.tank_half_height, dz) - vertex[2]) / dz if abs(dz) > 1e-12 else math.inf
        return min(barrel, cap)

    def _muon_photons(self, rng, vertex, direction, momentum):
        """A straight track losing ``dedx`` per cm; it radiates until below threshold
        or until it leaves the tank. Multiple scattering blurs the direction a little."""
        mass = MUON_MASS
        kinetic0 = math.hypot(momentum, mass) - mass
        radiating = (kinetic0 - self._muon_threshold_kinetic) / self.dedx
        length = max(min(radiating, self._exit_distance(vertex, direction)), 0.0)
        n_try = rng.poisson(self.pe_per_cm * length)
        s = rng.uniform(0.0, length, size=n_try)
        energy = kinetic0 - self.dedx * s + mass
        beta = np.sqrt(np.clip(1.0 - (mass / energy) ** 2, 0.0, None))
        cos_cone = np.clip(1.0 / (self.refractive_index * beta), None, 1.0)
        # Frank-Tamm: photons per cm scale with sin^2 of the cone angle; thin the
        # uniform candidates accordingly (a thinned Poisson process stays Poisson).
        keep = rng.random(n_try) * self._sin2_max < (1.0 - cos_cone**2)
        s, beta, cos_cone = s[keep], beta[keep], cos_cone[keep]
        p_local = beta * energy[keep]
        # Highland multiple-scattering angle accumulated up to s; applied per photon
        # (a blur, not a coherent track kink).
        theta0 = 13.6 / np.maximum(beta * p_local, 1.0) * np.sqrt(s / WATER_X0)
        parents = self._scatter(rng, direction, theta0)
        origins = vertex + s[:, None] * direction
        return origins, parents, cos_cone, s / SPEED_OF_LIGHT

    def _electron_photons(self, rng, vertex, direction, momentum):
        """An EM shower: the light of all its charged secondaries, emitted along a
        gamma-distributed longitudinal profile from directions spread around the axis."""
        energy = math.hypot(momentum, ELECTRON_MASS)
        track_length = energy / self.dedx  # total charged track length of the shower
        n_photons = rng.poisson(self.pe_per_cm * track_length)
        # Longitudinal profile dE/dt ~ t^(a-1) exp(-b t) (t in X0), peaking at ln(E/Ec) - 0.5.
        b = 0.5
        t_max = max(math.log(energy / WATER_CRITICAL_ENERGY) - 0.5, 0.2)
        depth = rng.gamma(b * t_max + 1.0, 1.0 / b, size=n_photons) * WATER_X0
        # Shower particles that leave the tank radiate outside it: their light is lost.
        depth = depth[depth < self._exit_distance(vertex, direction)]
        # Secondaries deeper in the shower are softer and more scattered.
        spread = self.shower_spread * np.sqrt(depth / (t_max * WATER_X0) + 0.25)
        parents = self._scatter(rng, direction, spread)
        origins = vertex + depth[:, None] * direction
        cos_cone = np.full(depth.shape[0], 1.0 / self.refractive_index)  # secondaries are ultra-relativistic
        return origins, parents, cos_cone, depth / SPEED_OF_LIGHT

    @staticmethod
    def _scatter(rng, direction: np.ndarray, sigma: np.ndarray) -> np.ndarray:
        """Copies of ``direction`` deflected by a 2D-Gaussian angle of width ``sigma`` (per row)."""
        n = sigma.shape[0]
        angle = (sigma * np.sqrt(-2.0 * np.log1p(-rng.random(n)))).astype(np.float32)  # Rayleigh
        # float32 trig for speed (see _random_azimuth); sin is taken directly, not
        # from cos, so small angles keep their relative precision.
        cos_a, sin_a = np.cos(angle).astype(np.float64), np.sin(angle).astype(np.float64)
        return _tilt(direction, cos_a, sin_a, *_random_azimuth(rng, n))

    def _detect(self, rng, origins, parents, cos_cone, t_emit) -> np.ndarray:
        """Send each photon along its Cherenkov cone to the barrel and histogram
        the surviving ones (plus dark noise) into charge and mean-time images."""
        height, width = self.image_size
        n = cos_cone.shape[0]
        sin_cone = np.sqrt(np.maximum(1.0 - cos_cone * cos_cone, 0.0))
        photons = _tilt(parents, cos_cone, sin_cone, *_random_azimuth(rng, n))
        dist = _barrel_distance(origins, photons, self.tank_radius)
        hit = origins + dist[:, None] * photons
        survive = (np.abs(hit[:, 2]) < self.tank_half_height) & (
            rng.random(n) < np.exp(-np.minimum(dist, 1e9) / self.attenuation_length)
        )
        hit, dist, t_emit = hit[survive], dist[survive], t_emit[survive]
        phi = np.arctan2(hit[:, 1], hit[:, 0])
        col = np.minimum(((phi + math.pi) / (2.0 * math.pi) * width).astype(np.int64), width - 1)
        row = np.minimum(((hit[:, 2] + self.tank_half_height) / (2.0 * self.tank_half_height) * height).astype(np.int64), height - 1)
        pixel = row * width + col
        times = t_emit + dist * self.refractive_index / SPEED_OF_LIGHT
        times = times + self.time_jitter * rng.standard_normal(times.shape[0])
        # The trigger fires on the first signal photon; dark hits fall anywhere in the readout window.
        t_ref = float(times.min()) if times.size else 0.0
        n_noise = rng.poisson(self.noise_rate * height * width)
        pixel = np.concatenate([pixel, rng.integers(0, height * width, size=n_noise)])
        times = np.concatenate([times - t_ref, rng.uniform(-20.0, 80.0, size=n_noise)])

        counts = np.bincount(pixel, minlength=height * width).astype(np.float64)
        # Sum of per-PE gains ~ N(n, gain_spread^2 n). A hit pixel passed the
        # discriminator, so it reports at least the threshold charge (keeps every
        # pixel with a time also visible in the charge channel).
        lit = np.flatnonzero(counts)
        charge = np.zeros_like(counts)
        charge[lit] = np.maximum(
            counts[lit] + self.gain_spread * np.sqrt(counts[lit]) * rng.standard_normal(lit.shape[0]),
            _HIT_THRESHOLD_PE,
        )
        if self.log_charge:
            charge = np.log1p(charge)
        channels = [charge]
        if self.with_time:
            time_sum = np.bincount(pixel, weights=times, minlength=height * width)
            channels.append(np.divide(time_sum, counts, out=np.zeros_like(time_sum), where=counts > 0) / self.time_scale)
        return np.stack(channels).reshape(len(channels), height, width).astype(np.float32)
