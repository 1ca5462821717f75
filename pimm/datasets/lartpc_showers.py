"""Electromagnetic showers of the synthetic LArTPC generator.

A shower is what makes LArTPC segmentation hard: one particle that becomes
many disconnected fragments. Here a cascade branches generation by
generation, all showers of an interaction at once: photons fly an
exponential distance (the visible gap) and convert into an e+e- pair, soft
photons leave a low-energy blip instead; electrons above the critical energy
ionise for an exponential distance, then radiate a photon and go on, softer
ones ionise until they stop.

Generations depend on each other (a photon starts where its electron
radiated), so they are simulated one after the other; within a generation
the electrons are stepped as one batch (:meth:`Deposits.electrons`) and the
per-particle bookkeeping stays in Python floats and lists, cheaper than
numpy calls on a handful of values. Draws come in the order of the original
generator (``bench/lartpc_generator_reference.py``), whose events this
reproduces bit for bit.
"""

from __future__ import annotations

import numpy as np

from .lartpc_paths import MIP, X0, Deposits, deflected, normalised

E_CRIT = 32.0  # MeV: below this an electron mostly ionises instead of radiating
CONVERSION_LENGTH = 60.0  # units (9/7 X0): mean photon path before pair production
COMPTON_CUT = 3.0  # MeV: softer photons leave a blip instead of a pair


def simulate_showers(ev: Deposits, primaries: list, low_energy_src: int) -> None:
    """Cascade every primary (is_photon, start, unit direction, MeV, source);
    starts and directions are float triples."""
    rng = ev.rng
    photons = [p[1:] for p in primaries if p[0]]
    electrons = [p[1:] for p in primaries if not p[0]]
    soft = []
    while photons or electrons:
        raw_dirs = []
        for (x, y, z), d, e, src in photons:
            t = rng.exponential(CONVERSION_LENGTH)
            pos = (x + d[0] * t, y + d[1] * t, z + d[2] * t)
            if e < COMPTON_CUT:
                soft.append(pos)
                continue
            u = rng.uniform(0.15, 0.85)
            opening = min(0.6, 2.0 / e + 0.02)
            for frac in (u, 1.0 - u):
                raw_dirs.append(deflected(rng, d, abs(rng.normal(0.0, opening))))
                electrons.append((pos, None, e * frac, src))
        photons = []
        if not electrons:
            break
        dirs = np.empty((len(electrons), 3))
        first_new = len(electrons) - len(raw_dirs)
        if first_new:
            dirs[:first_new] = [e[1] for e in electrons[:first_new]]
        if raw_dirs:
            dirs[first_new:] = normalised(raw_dirs)
        energy = [e[2] for e in electrons]
        srcs = [e[3] for e in electrons]
        flights = rng.exponential(0.5 * X0, len(energy)).tolist()
        travel, radiating = [], []
        for e, flight in zip(energy, flights):
            radiating.append(e >= E_CRIT)
            travel.append(min(flight + 1.0, e / MIP) if e >= E_CRIT else max(e / MIP, ev.step))
        ends, end_dirs = ev.electrons(np.array([e[0] for e in electrons]), dirs, travel, energy, srcs)
        y = rng.uniform(0.2, 0.7, size=len(energy)).tolist()  # hard part of the bremsstrahlung spectrum
        ends, end_dirs_list = ends.tolist(), end_dirs.tolist()
        electrons, photon_dirs, photon_rest = [], [], []
        for k, (e, length) in enumerate(zip(energy, travel)):
            left = e - MIP * length
            if radiating[k] and left > 1.0:
                photon_dirs.append(deflected(rng, end_dirs_list[k], abs(rng.normal(0.0, 0.08))))
                photon_rest.append((ends[k], y[k] * left, srcs[k]))
                electrons.append((ends[k], end_dirs[k], (1.0 - y[k]) * left, srcs[k]))
        if photon_dirs:
            photons = [(pos, d, e, src) for (pos, e, src), d in zip(photon_rest, normalised(photon_dirs).tolist())]
    if soft:
        ev.blips(np.array(soft), low_energy_src)
