"""The particle truth of PILArNet's ``cluster_extra`` rows, both ways.

PILArNet v2 / v3 store per cluster ``(mass [MeV], |p| [GeV], vertex x, y, z)``,
v3 adds ``is_primary`` and its packed layout (9 or 11 values) the momentum
components ``px, py, pz`` [GeV]; -1 marks missing truth (low-energy
deposits). Reading, each point gets its cluster's ``momentum`` (N, 1),
``vertex`` (N, 3) and the unit momentum direction ``momentum_vec`` (N, 3)
(all -1 where there are no components: v2, or missing truth), upstream's
keys for its detector's query heads. Writing, a generated event's per-point
truth (:mod:`pimm.datasets.lartpc`) becomes those rows, in the packed v3
layout, so the detector trains on files as on generated events.
"""

from __future__ import annotations

import numpy as np

__all__ = ["cluster_truth", "truth_rows", "PID_MASS_MEV"]

_MISSING = -1.0
# Rest mass per particle type (photon, electron, muon, pion, proton) in MeV; LED: missing.
PID_MASS_MEV = (0.0, 0.511, 105.66, 139.57, 938.27)


def cluster_truth(extra: np.ndarray | None, n_clusters: int, revision: str) -> dict[str, np.ndarray]:
    """Per-cluster ``momentum`` (k,), ``momentum_vec`` (k, 3) and ``vertex``
    (k, 3) of one event's ``cluster_extra`` (v1: momentum and vertex 0, as
    upstream, direction missing)."""
    if revision == "v1" or extra is None or n_clusters == 0:  # v1, or an event without points
        zeros = np.zeros(n_clusters, np.float32)
        return dict(momentum=zeros, vertex=np.zeros((n_clusters, 3), np.float32),
                    momentum_vec=np.full((n_clusters, 3), _MISSING, np.float32))
    rows = np.asarray(extra, dtype=np.float32).reshape(n_clusters, -1)
    direction = np.full((n_clusters, 3), _MISSING, np.float32)
    if revision == "v3" and rows.shape[1] >= 9:
        components = rows[:, 6:9]
        valid = ~(components == _MISSING).all(axis=1)
        norm = np.linalg.norm(components[valid], axis=1, keepdims=True)
        direction[valid] = components[valid] / np.clip(norm, 1e-9, None)
    return dict(momentum=rows[:, 1].copy(), vertex=rows[:, 2:5].copy(), momentum_vec=direction)


def truth_rows(event: dict, first: np.ndarray, revision: str) -> tuple[np.ndarray, np.ndarray]:
    """The ``pid`` column (k,) and ``cluster_extra`` rows (k, 5 | 9) of the
    clusters whose first points (in ``event``'s order) are ``first``; all
    missing (-1) when the event carries no truth."""
    width = 5 if revision == "v2" else 9
    extra = np.full((len(first), width), _MISSING, dtype=np.float32)
    pid = np.full(len(first), -1, dtype=np.int64)
    if "segment_pid" not in event:
        return pid, extra
    n = len(np.asarray(event["coord"]).reshape(-1, 3))
    pid_all = np.asarray(event["segment_pid"]).reshape(n)[first].astype(np.int64)
    particle = (pid_all >= 0) & (pid_all < len(PID_MASS_MEV))
    pid[particle] = pid_all[particle]
    momentum = np.asarray(event["momentum"], dtype=np.float32).reshape(n)[first]
    direction = np.asarray(event["momentum_vec"], dtype=np.float32).reshape(n, 3)[first]
    extra[particle, 0] = np.asarray(PID_MASS_MEV, dtype=np.float32)[pid[particle]]
    extra[:, 1] = momentum
    extra[:, 2:5] = np.asarray(event["vertex"], dtype=np.float32).reshape(n, 3)[first]
    if revision == "v3":
        extra[:, 5] = np.asarray(event["is_primary"]).reshape(n)[first]
        has_p = particle & (momentum >= 0)
        extra[has_p, 6:9] = direction[has_p] * momentum[has_p, None]
    return pid, extra
