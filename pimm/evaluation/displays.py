"""Event displays: pictures of single events with their true and predicted labels.

Rendering only: each function returns an ``(H, W, 3)`` uint8 array (what
TensorBoard's ``add_image(..., dataformats="HWC")`` and ``wandb.Image``
take); the evaluators choose the events and the writer logs them.

* :func:`render_point_event`: a 3D point-cloud event as three projections
  (xy, xz, zy, one per row) coloured by class, true and predicted side by
  side, plus true and predicted instance ids when given, and a legend of the
  class names.
* :func:`render_ring_event`: a Cherenkov ring image ``(C, H, W)`` (the
  barrel unrolled: azimuth across, height up), the charge channel by default,
  titled with the true and predicted class (green when they agree, red when not).

Points are rasterized with numpy into one image per panel (about 3x faster
than a ``scatter`` with a colour per point) and shown with ``imshow`` on a
bare matplotlib ``Figure`` rendered by the Agg canvas: no pyplot, so no global figure state, no display and no
backend switch inside a training process. matplotlib is imported on first
use, so importing this module (and the evaluators) costs nothing. Large
events are subsampled to ``max_points`` (a fixed-seed choice, so the same
event looks the same at every evaluation).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["render_point_event", "render_ring_event", "event_slice", "to_numpy"]

_IGNORED_COLOR = (0.75, 0.75, 0.75, 1.0)
_PROJECTIONS = (("x", "y", 0, 1), ("x", "z", 0, 2), ("z", "y", 2, 1))


def to_numpy(value) -> np.ndarray:
    """A numpy array from a numpy array, list or torch tensor (any device)."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def event_slice(offset, index: int) -> slice:
    """The points of event ``index`` in a collated point batch (``offset``: cumulative end index per event)."""
    ends = to_numpy(offset).reshape(-1)
    if not 0 <= index < len(ends):
        raise IndexError(f"event {index} out of range for a batch of {len(ends)} events")
    return slice(int(ends[index - 1]) if index else 0, int(ends[index]))


def _figure(width_in: float, height_in: float, dpi: int):
    from matplotlib.figure import Figure

    # A fixed layout: constrained/tight layout measure every tick label and
    # cost several times the drawing itself.
    return Figure(figsize=(width_in, height_in), dpi=dpi)


def _to_rgb(figure) -> np.ndarray:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


def _class_colors(labels: np.ndarray, num_classes: int) -> np.ndarray:
    from matplotlib import colormaps

    palette = colormaps["tab10" if num_classes <= 10 else "tab20"]
    table = np.array([palette(i % palette.N) for i in range(num_classes)] + [_IGNORED_COLOR])
    index = np.where((labels >= 0) & (labels < num_classes), labels, num_classes)
    return table[index]


def _instance_colors(ids: np.ndarray) -> np.ndarray:
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    # tab20 without its two greys (grey means "no instance"); consecutive ids
    # are spread over the palette so neighbouring instances differ.
    table = np.array([palette(i) for i in range(palette.N) if i not in (14, 15)])
    colors = table[(ids.astype(np.int64) * 7) % len(table)]
    colors[ids < 0] = _IGNORED_COLOR
    return colors


def _rasterize(u: np.ndarray, v: np.ndarray, rgb: np.ndarray, origin: tuple[float, float],
               shape: tuple[int, int], scale: float, radius: int) -> np.ndarray:
    """Points ``(u, v)`` as ``(2 radius + 1)``-pixel squares on a white ``shape``
    image, row 0 at ``v = origin[1]``; later points cover earlier ones."""
    height, width = shape
    image = np.ones((height, width, 3))
    cols = np.clip(((u - origin[0]) * scale).astype(np.int64), 0, width - 1)
    rows = np.clip(((v - origin[1]) * scale).astype(np.int64), 0, height - 1)
    for dr in range(-radius, radius + 1):
        for dc in range(-radius, radius + 1):
            image[np.clip(rows + dr, 0, height - 1), np.clip(cols + dc, 0, width - 1)] = rgb
    return image


def render_point_event(
    coord,
    segment,
    pred_segment,
    class_names: Sequence[str] | None = None,
    instance=None,
    pred_instance=None,
    title: str | None = None,
    max_points: int = 20000,
    panel_inches: tuple[float, float] = (3.0, 2.4),
    dpi: int = 80,
) -> np.ndarray:
    """Projections of one event's points, true vs predicted; returns ``(H, W, 3)`` uint8.

    ``coord`` (N, 3); ``segment`` / ``pred_segment`` (N,) class ids (a label
    outside ``[0, num_classes)``, e.g. -1, is drawn grey); ``instance`` /
    ``pred_instance`` (N,) ids (-1 grey) add two columns when given.
    ``num_classes`` is ``len(class_names)`` or the largest label + 1."""
    coord = to_numpy(coord).astype(np.float64).reshape(-1, 3)
    columns = [("true class", to_numpy(segment).reshape(-1)), ("predicted class", to_numpy(pred_segment).reshape(-1))]
    if (instance is None) != (pred_instance is None):
        raise ValueError("render_point_event: give both instance and pred_instance, or neither")
    if instance is not None:
        columns += [("true instance", to_numpy(instance).reshape(-1)),
                    ("predicted instance", to_numpy(pred_instance).reshape(-1))]
    for name, labels in columns:
        if len(labels) != len(coord):
            raise ValueError(f"render_point_event: {name} has {len(labels)} labels for {len(coord)} points")
    if class_names is None:
        top = max((int(labels.max()) for _, labels in columns[:2] if labels.size), default=-1)
        class_names = [str(i) for i in range(max(top + 1, 1))]
    num_classes = len(class_names)

    keep = np.arange(len(coord))
    if len(coord) > max_points:
        keep = np.sort(np.random.default_rng(0).choice(len(coord), max_points, replace=False))
    coord = coord[keep]
    colors = [_class_colors(labels[keep].astype(np.int64), num_classes) if i < 2
              else _instance_colors(labels[keep]) for i, (_, labels) in enumerate(columns)]
    radius = 1 if len(coord) < 20000 else 0

    width, height = panel_inches[0] * len(columns), panel_inches[1] * 3 + 0.9
    figure = _figure(width, height, dpi)
    grid = figure.subplots(3, len(columns), squeeze=False, gridspec_kw=dict(
        left=0.25 / width, right=1 - 0.05 / width, bottom=0.45 / height, top=1 - 0.45 / height,
        wspace=0.05, hspace=0.12))
    low, high = (coord.min(axis=0), coord.max(axis=0)) if len(coord) else (np.zeros(3), np.ones(3))
    pad = 0.03 * max(float((high - low).max()), 1e-6)
    low, high = low - pad, high + pad
    panel_pixels = (panel_inches[0] * dpi * 0.95, panel_inches[1] * dpi * 0.9)
    for row, (xname, yname, xi, yi) in enumerate(_PROJECTIONS):
        # Points are drawn into an image at about the panel's pixel size, in the
        # same place in every panel of a row (true aspect ratio): scatter with a
        # colour per point costs several times more.
        extent = (high[xi] - low[xi], high[yi] - low[yi])
        scale = min(panel_pixels[0] / extent[0], panel_pixels[1] / extent[1])
        shape = (max(1, int(np.ceil(extent[1] * scale))), max(1, int(np.ceil(extent[0] * scale))))
        for col, ((name, _), color) in enumerate(zip(columns, colors)):
            axes = grid[row][col]
            image = _rasterize(coord[:, xi], coord[:, yi], color[:, :3], (low[xi], low[yi]), shape, scale, radius)
            axes.imshow(image, origin="lower", extent=(low[xi], high[xi], low[yi], high[yi]),
                        interpolation="nearest", aspect="equal")
            axes.set_xticks([])  # ticks cost more than the points; the axis names say enough
            axes.set_yticks([])
            if row == 0:
                axes.set_title(name, fontsize=9)
            if col == 0:
                axes.set_ylabel(f"{yname}  ({xname}{yname} view)", fontsize=8)
            axes.set_xlabel(xname, fontsize=7, labelpad=1)
    from matplotlib.patches import Patch

    handles = [Patch(color=c, label=n) for n, c in zip(class_names, _class_colors(np.arange(num_classes), num_classes))]
    figure.legend(handles=handles, loc="lower center", ncol=min(num_classes, 8), fontsize=8, frameon=False,
                  borderaxespad=0.2)
    if title:
        figure.suptitle(title, fontsize=10)
    return _to_rgb(figure)


def render_ring_event(
    image,
    label: int,
    pred_label: int,
    class_names: Sequence[str] | None = None,
    probability: float | None = None,
    channel: int = 0,
    title: str | None = None,
    inches: tuple[float, float] = (5.0, 3.0),
    dpi: int = 80,
) -> np.ndarray:
    """One ring image ``(C, H, W)`` (or ``(H, W)``), channel ``channel``, titled
    with the true and predicted class (and ``probability`` of the prediction
    when given); returns ``(H, W, 3)`` uint8."""
    array = to_numpy(image).astype(np.float32)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3:
        raise ValueError(f"render_ring_event: expected an image (C, H, W), got shape {array.shape}")
    if not 0 <= channel < array.shape[0]:
        raise ValueError(f"render_ring_event: channel {channel} out of range for {array.shape[0]} channel(s)")

    def name(index: int) -> str:
        index = int(index)
        return class_names[index] if class_names is not None and 0 <= index < len(class_names) else str(index)

    figure = _figure(inches[0], inches[1], dpi)
    axes = figure.add_axes((0.13, 0.16, 0.72, 0.72))
    shown = axes.imshow(array[channel], origin="lower", cmap="viridis", aspect="auto", interpolation="nearest")
    figure.colorbar(shown, cax=figure.add_axes((0.87, 0.16, 0.03, 0.72))).ax.tick_params(labelsize=6)
    axes.set_xlabel("azimuth (pixel)", fontsize=8)
    axes.set_ylabel("height (pixel)", fontsize=8)
    axes.tick_params(labelsize=6)
    verdict = f"true: {name(label)}   predicted: {name(pred_label)}"
    if probability is not None:
        verdict += f" (p={float(probability):.2f})"
    axes.set_title(verdict, fontsize=9, color="tab:green" if int(label) == int(pred_label) else "tab:red")
    if title:
        figure.suptitle(title, fontsize=9)
    return _to_rgb(figure)
