"""Colour transforms, under upstream pimm's names and arguments (the energy
ones are in :mod:`pimm.datasets.transforms_energy`).

They act on ``color`` (RGB in ``[0, 255]``, the first three columns; more
columns are left alone unless said otherwise) and do nothing when the event
has no ``color``, as upstream. Each returns a new dict and new arrays,
keeping the input's dtype (upstream edits in place).

Random draws follow upstream's order on the same global streams, so a seed
gives upstream's result (see :mod:`pimm.datasets.transform_args`).
"""

from __future__ import annotations

import numbers
import numpy as np
import torch

from pimm.engines.registries import TRANSFORMS
from pimm.utils.domains import NonNeg, Pair, Prob, Real

from .transform_args import check_args, need

__all__ = ["NormalizeColor", "ChromaticAutoContrast", "ChromaticTranslation", "ChromaticJitter", "RandomColorGrayScale",
           "RandomColorJitter", "HueSaturationTranslation", "RandomColorDrop"]


def _with_rgb(color: np.ndarray, rgb: np.ndarray) -> np.ndarray:
    """``color`` with its first three columns replaced (cast to its dtype)."""
    out = np.array(color, copy=True)
    out[:, :3] = rgb
    return out


def _gray(color: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma, (..., 1), in ``color``'s dtype."""
    if color.shape[-1] < 3:
        raise ValueError(f"color needs 3 channels (R, G, B), got shape {color.shape}")
    luma = 0.2989 * color[..., 0] + 0.587 * color[..., 1] + 0.114 * color[..., 2]
    return luma.astype(color.dtype)[..., None]


@TRANSFORMS.register_module()
class NormalizeColor:
    """``color / 255``: colours from ``[0, 255]`` into ``[0, 1]``."""

    def __call__(self, data: dict) -> dict:
        if "color" not in data:
            return data
        color = np.asarray(data["color"])
        out = dict(data)
        out["color"] = color / (color.dtype.type(255) if color.dtype.kind == "f" else np.float32(255))
        return out


class _ColorGate:
    """Shared gate: act on ``color`` with probability ``p`` (the draw is made only when colour exists)."""

    key = "color"

    def _fires(self, data: dict) -> bool:
        return self.key in data and np.random.rand() < self.p


@TRANSFORMS.register_module()
class ChromaticAutoContrast(_ColorGate):
    """With probability ``p``: stretch each RGB channel to span ``[0, 255]``
    and blend ``(1 - b) * color + b * stretched``, ``b = blend_factor`` (``None``:
    uniform in ``[0, 1)`` per call). A channel with one value throughout
    cannot be stretched and is kept."""

    domains = dict(p=Prob, blend_factor=Prob | None)

    def __init__(self, p: float = 0.2, blend_factor: float | None = None):
        check_args(self, p=p, blend_factor=blend_factor)
        self.p, self.blend_factor = float(p), blend_factor

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        color = np.asarray(data["color"])
        rgb = color[:, :3].astype(np.float64)
        low, high = rgb.min(0, keepdims=True), rgb.max(0, keepdims=True)
        span = high - low
        stretched = np.where(span > 0, (rgb - low) * (255.0 / np.where(span > 0, span, 1.0)), rgb)
        b = np.random.rand() if self.blend_factor is None else self.blend_factor
        out = dict(data)
        out["color"] = _with_rgb(color, (1 - b) * rgb + b * stretched)
        return out


@TRANSFORMS.register_module()
class ChromaticTranslation(_ColorGate):
    """With probability ``p``: add one offset per channel, uniform in
    ``+-255 * ratio``, to every point; clip to ``[0, 255]``."""

    domains = dict(p=Prob, ratio=NonNeg)

    def __init__(self, p: float = 0.95, ratio: float = 0.05):
        check_args(self, p=p, ratio=ratio)
        self.p, self.ratio = float(p), float(ratio)

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        color = np.asarray(data["color"])
        shift = (np.random.rand(1, 3) - 0.5) * 255 * 2 * self.ratio
        out = dict(data)
        out["color"] = _with_rgb(color, np.clip(color[:, :3] + shift, 0, 255))
        return out


@TRANSFORMS.register_module()
class ChromaticJitter(_ColorGate):
    """With probability ``p``: add Gaussian noise of std ``255 * std`` to each
    point's RGB independently; clip to ``[0, 255]``."""

    domains = dict(p=Prob, std=NonNeg)

    def __init__(self, p: float = 0.95, std: float = 0.005):
        check_args(self, p=p, std=std)
        self.p, self.std = float(p), float(std)

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        color = np.asarray(data["color"])
        noise = np.random.randn(color.shape[0], 3) * (self.std * 255)
        out = dict(data)
        out["color"] = _with_rgb(color, np.clip(color[:, :3] + noise, 0, 255))
        return out


@TRANSFORMS.register_module()
class RandomColorDrop(_ColorGate):
    """With probability ``p``: multiply ``color`` by ``color_augment`` (0 drops it)."""

    domains = dict(p=Prob, color_augment=Real(0, 1e3))

    def __init__(self, p: float = 0.2, color_augment: float = 0.0):
        check_args(self, p=p, color_augment=color_augment)
        self.p, self.color_augment = float(p), float(color_augment)

    def __call__(self, data: dict) -> dict:
        if not self._fires(data):
            return data
        color = np.asarray(data["color"])
        out = dict(data)
        out["color"] = (color * self.color_augment).astype(color.dtype)
        return out


@TRANSFORMS.register_module()
class RandomColorGrayScale:
    """With probability ``p``: every channel of ``color`` becomes the luma
    ``0.2989 R + 0.587 G + 0.114 B``. Needs ``color`` (3 or more channels)."""

    domains = dict(p=Prob)

    def __init__(self, p: float):
        check_args(self, p=p)
        self.p = float(p)

    def __call__(self, data: dict) -> dict:
        if np.random.rand() >= self.p:
            return data
        color = np.asarray(need(data, "color", "RandomColorGrayScale"))
        out = dict(data)
        out["color"] = np.repeat(_gray(color), color.shape[-1], axis=-1)
        return out


def _rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """Hue and saturation in [0, 1), value in ``rgb``'s scale (the colorsys formulas, vectorised)."""
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    high, low = rgb[..., :3].max(-1), rgb[..., :3].min(-1)
    spread = high - low
    grey = spread == 0
    s = np.where(grey, 0.0, spread / np.where(grey, 1.0, high))
    safe = np.where(grey, 1.0, spread)
    rc, gc, bc = (high - r) / safe, (high - g) / safe, (high - b) / safe
    rc, gc, bc = (np.where(grey, 0.0, c) for c in (rc, gc, bc))
    h = np.select([r == high, g == high], [bc - gc, 2.0 + rc - bc], default=4.0 + gc - rc)
    return np.stack([(h / 6.0) % 1.0, s, high], axis=-1)


def _hsv_parts(h, s, v):
    """The three levels an HSV-to-RGB conversion picks from (``f``: where ``h`` lies within its sixth)."""
    f = h * 6.0 - np.floor(h * 6.0)
    return v * (1.0 - s), v * (1.0 - s * f), v * (1.0 - s * (1.0 - f))


@TRANSFORMS.register_module()
class RandomColorJitter:
    """torchvision's ``ColorJitter`` for point colours in ``[0, 255]``.

    ``brightness``, ``contrast``, ``saturation``: a number ``m`` (factor in
    ``[max(0, 1 - m), 1 + m]``) or a ``(low, high)`` range; ``hue``: a number
    ``m <= 0.5`` (shift in ``[-m, m]``) or a range within ``[-0.5, 0.5]``; 0
    turns one off. Each call draws an order of the four (``torch.randperm``)
    and their factors, then applies each enabled one with probability ``p``."""

    domains = dict(brightness=NonNeg | Pair(NonNeg), contrast=NonNeg | Pair(NonNeg),
                   saturation=NonNeg | Pair(NonNeg), hue=Real(0, 0.5) | Pair(Real(-0.5, 0.5)), p=Prob)

    def __init__(self, brightness=0, contrast=0, saturation=0, hue=0, p: float = 0.95):
        check_args(self, brightness=brightness, contrast=contrast, saturation=saturation, hue=hue, p=p)
        self.brightness = self._range(brightness, center=1.0, clip_at_zero=True)
        self.contrast = self._range(contrast, center=1.0, clip_at_zero=True)
        self.saturation = self._range(saturation, center=1.0, clip_at_zero=True)
        self.hue = self._range(hue, center=0.0, clip_at_zero=False)
        self.p = float(p)

    @staticmethod
    def _range(value, center: float, clip_at_zero: bool) -> tuple[float, float] | None:
        if isinstance(value, numbers.Number):
            low, high = center - float(value), center + float(value)
            low = max(low, 0.0) if clip_at_zero else low
        else:
            low, high = float(value[0]), float(value[1])
        return None if low == high == center else (low, high)

    @staticmethod
    def _blend(color: np.ndarray, other, ratio: float) -> np.ndarray:
        return (ratio * color + (1.0 - ratio) * other).clip(0, 255.0).astype(color.dtype)

    @staticmethod
    def _shift_hue(color: np.ndarray, shift: float) -> np.ndarray:
        hsv = _rgb_to_hsv(color / 255.0)
        h, s, v = (hsv[..., 0] + shift) % 1.0, hsv[..., 1], hsv[..., 2]
        p, q, t = _hsv_parts(h, s, v)
        p, q, t = (np.clip(x, 0.0, 1.0) for x in (p, q, t))
        sector = np.floor(h * 6.0).astype(np.int64) % 6
        table = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)]
        rgb = np.stack([np.select([sector == i for i in range(6)], [row[c] for row in table])
                        for c in range(3)], axis=-1)
        return (rgb * 255.0).astype(color.dtype)

    def __call__(self, data: dict) -> dict:
        order = torch.randperm(4)
        factors = [None if r is None else np.random.uniform(r[0], r[1])
                   for r in (self.brightness, self.contrast, self.saturation, self.hue)]
        if all(f is None for f in factors):
            return data
        color = np.asarray(need(data, "color", "RandomColorJitter"))
        for fn in order.tolist():
            if factors[fn] is None or np.random.rand() >= self.p:
                continue
            if fn == 0:
                color = self._blend(color, np.zeros_like(color), factors[0])
            elif fn == 1:
                color = self._blend(color, np.mean(_gray(color)), factors[1])
            elif fn == 2:
                color = self._blend(color, _gray(color), factors[2])
            else:
                color = self._shift_hue(color, factors[3])
        out = dict(data)
        out["color"] = color
        return out


@TRANSFORMS.register_module()
class HueSaturationTranslation:
    """Shift the hue of ``color``'s RGB by ``uniform(-hue_max, hue_max)`` (mod
    1) and scale saturation by ``1 + uniform(-saturation_max, saturation_max)``
    (clipped to [0, 1]); every call, no probability. The result is rounded
    down to whole RGB values, as upstream (its HSV-to-RGB step returns uint8)."""

    domains = dict(hue_max=Real(0, 1), saturation_max=NonNeg)

    def __init__(self, hue_max: float = 0.5, saturation_max: float = 0.2):
        check_args(self, hue_max=hue_max, saturation_max=saturation_max)
        self.hue_max, self.saturation_max = float(hue_max), float(saturation_max)

    def __call__(self, data: dict) -> dict:
        if "color" not in data:
            return data
        color = np.asarray(data["color"])
        hsv = _rgb_to_hsv(color[:, :3].astype(np.float64))
        hue_shift = (np.random.rand() - 0.5) * 2 * self.hue_max
        saturation = 1 + (np.random.rand() - 0.5) * 2 * self.saturation_max
        h = np.remainder(hsv[:, 0] + hue_shift + 1, 1)
        s = np.clip(hsv[:, 1] * saturation, 0, 1)
        v = hsv[:, 2]
        p, q, t = _hsv_parts(h, s, v)
        sector = (h * 6.0).astype(np.uint8) % 6
        cases = [s == 0.0] + [sector == i for i in range(1, 6)]
        r = np.select(cases, [v, q, p, p, t, v], default=v)
        g = np.select(cases, [v, v, v, q, p, p], default=t)
        b = np.select(cases, [v, p, t, v, v, q], default=p)
        rgb = np.stack([r, g, b], axis=-1).astype(np.uint8)
        out = dict(data)
        out["color"] = _with_rgb(color, np.clip(rgb, 0, 255))
        return out
