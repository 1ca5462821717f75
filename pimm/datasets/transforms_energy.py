"""Energy and other scalar-feature transforms, under upstream pimm's names
and arguments: :class:`LogTransform` (energies onto [-1, 1]),
:class:`RelativeLogNormalize` (hit times relative to the event's first),
:class:`MomentumTransform` (log10 of momenta, sentinels kept),
:class:`EnergeticTranslation` and :class:`EnergyJitter` (augmentation).

Each returns a new dict and new arrays (upstream edits in place). Random
draws follow upstream's order on the same streams (see
:mod:`pimm.datasets.transform_args`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import MAX_REAL, Key, Keys, NonNeg, Positive, Prob, Real, Rule
from pimm.utils.errors import UserError

from .point_dict import _keys, _require
from .transform_args import check_args, need

__all__ = ["LogTransform", "RelativeLogNormalize", "MomentumTransform", "EnergeticTranslation", "EnergyJitter"]


@TRANSFORMS.register_module()
class LogTransform:
    """Map deposited energies (long-tailed) onto about [-1, 1].

    Upstream's form: for each of ``keys`` (default ``energy``),
    ``2 * (log10(x + min_val) - log10(min_val)) / (log10(max_val + min_val) - log10(min_val)) - 1``
    (``x = 0`` gives -1, ``x = max_val`` gives 1); ``log=False`` maps
    ``[min_val, max_val]`` linearly instead. ``clip=True`` first clips ``x``
    to ``[0, max_val]`` (log) or ``[min_val, max_val]`` (linear). A value the
    log cannot take (``x <= -min_val``) is an error naming the key, never NaN.

    pimm's earlier form is kept for existing configs and checkpoints: giving
    ``key``, ``scale`` or ``out_key`` computes ``log1p(max(x, 0) / scale)``
    (``scale`` default 1) from ``key`` (default ``energy``) into ``out_key``
    (default: in place). The two forms cannot be mixed.
    """

    domains = dict(min_val=Real(-MAX_REAL) | None, max_val=Real(-MAX_REAL) | None, keys=Key | Keys, key=Key | None,
                   scale=Positive | None, out_key=Key | None)

    def __init__(self, min_val: float | None = None, max_val: float | None = None, log: bool = True,
                 keys: Sequence[str] | str = ("energy",), clip: bool = False,
                 key: str | None = None, scale: float | None = None, out_key: str | None = None):
        self.legacy = key is not None or scale is not None or out_key is not None
        if self.legacy:
            if min_val is not None or max_val is not None:
                raise UserError("LogTransform: give either min_val/max_val (log10 map onto [-1, 1]) or "
                                "key/scale/out_key (log1p(x / scale)), not both")
            self.scale = 1.0 if scale is None else scale
            if not self.scale > 0:
                raise UserError(f"LogTransform scale={scale!r} must be positive")
            self.keys = (key or "energy",)
            self.out_key = out_key or self.keys[0]
            return
        self.min_val = 1.0e-2 if min_val is None else float(min_val)
        self.max_val = 20.0 if max_val is None else float(max_val)
        self.log, self.clip, self.keys = bool(log), bool(clip), _keys(keys)
        if self.log and not (self.min_val > 0 and self.max_val > 0):
            raise UserError(f"LogTransform: min_val={self.min_val} and max_val={self.max_val} must be positive")
        if not self.log and not self.max_val > self.min_val:
            raise UserError(f"LogTransform(log=False): max_val={self.max_val} must exceed min_val={self.min_val}")

    def _map(self, x: np.ndarray, key: str) -> np.ndarray:
        if self.log:
            if self.clip:
                x = np.clip(x, 0.0, self.max_val)
            shifted = x + self.min_val
            if shifted.size and not (shifted > 0).all():
                raise UserError(f"LogTransform: {key!r} has values <= -min_val ({-self.min_val}), whose log is "
                                "undefined; raise min_val or pass clip=True")
            low, high = np.log10(self.min_val), np.log10(self.max_val + self.min_val)
            return 2.0 * (np.log10(shifted) - low) / (high - low) - 1.0
        if self.clip:
            x = np.clip(x, self.min_val, self.max_val)
        return 2.0 * (x - self.min_val) / (self.max_val - self.min_val) - 1.0

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        for key in self.keys:
            value = np.asarray(_require(data, key, "LogTransform"), dtype=np.float64)
            if self.legacy:
                out[self.out_key] = np.log1p(np.maximum(value, 0.0) / self.scale).astype(np.float32)
            else:
                out[key] = self._map(value, key).astype(np.float32)
        return out


@TRANSFORMS.register_module()
class RelativeLogNormalize:
    """Per event, for each of ``keys`` (default ``time``): subtract the event's
    minimum, clip to ``[0, max_val]``, map ``log1p(x / scale) / log1p(max_val / scale)``
    onto ``[out_min, out_max]`` (float32). Only relative spacing survives (a
    trigger offset drops out)."""

    domains = dict(keys=Key | Keys, scale=Positive, max_val=Positive, out_min=Real(-1e9), out_max=Real(-1e9))
    domain_rules = (Rule(lambda a: a.out_max > a.out_min, "out_max", "a number greater than out_min"),)

    def __init__(self, keys: Sequence[str] | str = ("time",), scale: float = 50.0, max_val: float = 4000.0,
                 out_min: float = -1.0, out_max: float = 1.0):
        check_args(self, keys=keys, scale=scale, max_val=max_val, out_min=out_min, out_max=out_max)
        self.keys, self.scale, self.max_val = _keys(keys), float(scale), float(max_val)
        self.out_min, self.out_max = float(out_min), float(out_max)

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        for key in self.keys:
            x = np.asarray(need(data, key, "RelativeLogNormalize"), dtype=np.float32)
            if x.size == 0:
                out[key] = x
                continue
            x = np.clip(x - x.min(), 0.0, self.max_val)
            y = np.log1p(x / self.scale) / np.log1p(self.max_val / self.scale)
            y = self.out_min + y * (self.out_max - self.out_min)
            out[key] = np.clip(y, self.out_min, self.out_max).astype(np.float32)
        return out


@TRANSFORMS.register_module()
class MomentumTransform:
    """For each of ``keys`` present (default ``momentum``): positive entries
    become ``log10(max(x, 1e-6))``; zero and negative entries (sentinels) pass
    through unchanged."""

    domains = dict(keys=Key | Keys)

    def __init__(self, keys: Sequence[str] | str = ("momentum",)):
        check_args(self, keys=keys)
        self.keys = _keys(keys)

    def __call__(self, data: dict) -> dict:
        out = dict(data)
        for key in self.keys:
            if key in data:
                p = np.asarray(data[key])
                out[key] = np.where(p > 0, np.log10(np.clip(p, 1e-6, None)), p)
        return out


class _EnergyGate:
    """Act on ``energy`` with probability ``p`` (the draw is made only when the event has energy)."""

    def _fires(self, data: dict) -> bool:
        return "energy" in data and np.random.rand() < self.p


@TRANSFORMS.register_module()
class EnergeticTranslation(_EnergyGate):
    """With probability ``p``: add one offset, uniform in ``+-ratio``, to every
    point's ``energy``; clip to ``[-1, 1]`` (for energy already mapped there,
    e.g. by ``LogTransform``)."""

    domains = dict(p=Prob, ratio=NonNeg)

    def __init__(self, p: float = 0.95, ratio: float = 0.05):
        check_args(self, p=p, ratio=ratio)
        self.p, self.ratio = float(p), float(ratio)

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        energy = np.asarray(data["energy"])
        shift = (np.random.rand(1) - 0.5) * 2 * self.ratio
        out = dict(data)
        out["energy"] = np.clip(energy + shift, -1, 1).astype(_float_dtype(energy))
        return out


@TRANSFORMS.register_module()
class EnergyJitter(_EnergyGate):
    """With probability ``p``: multiply each ``energy`` entry by
    ``1 + uniform(-jitter_ratio, jitter_ratio)``; clip below at ``min_val``."""

    domains = dict(p=Prob, jitter_ratio=NonNeg, min_val=Real(-1e9))

    def __init__(self, p: float = 0.5, jitter_ratio: float = 0.005, min_val: float = 0.0):
        check_args(self, p=p, jitter_ratio=jitter_ratio, min_val=min_val)
        self.p, self.jitter_ratio, self.min_val = float(p), float(jitter_ratio), float(min_val)

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        energy = np.asarray(data["energy"])
        jitter = (np.random.rand(*energy.shape) * 2 - 1) * self.jitter_ratio
        out = dict(data)
        out["energy"] = np.clip(energy * (1 + jitter), self.min_val, None).astype(_float_dtype(energy))
        return out


def _float_dtype(array: np.ndarray) -> np.dtype:
    return array.dtype if array.dtype.kind == "f" else np.dtype(np.float32)
