"""``pimm plot RUN [RUN ...] [--keys train/loss,val/mIoU] [-o out.png]``: curve pictures.

Reads each run's ``metrics.jsonl`` (SPEC: one object per line with ``step``
and ``tag: value`` pairs; non-finite values are ``null``), draws one panel per
key with the global step on x and the runs overlaid (legend: run directory
names). Training curves (``train/*`` except the learning rate) are drawn
smoothed over the raw curve drawn faint; validation curves are drawn as they
are, with markers, and each run's best evaluation (highest, lowest for a
loss or error) is marked with a star and its value in the legend. All panels
share one step range. Values that are null, NaN, infinite or not numbers are
skipped; a cut last line (a killed run) is skipped and reported.

Default keys: ``train/loss``, ``train/lr`` and every ``val/*`` key any run has.
Default output: ``RUN/plots/curves.png`` of the first run. That file is ours
(derived from metrics.jsonl) and is rewritten on each call; a path given
with ``-o`` may be a user's file, so it is never replaced without
``--overwrite``.

matplotlib draws through its Agg canvas on a bare ``Figure`` (no pyplot, no
display, no global state), so it works headless and inside a training process.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from pimm.utils.errors import UserError
from pimm.utils.extras import require

from .tool_args import ToolParser, output_path, writing
from .jsonl import read_jsonl

__all__ = ["load_metrics", "smooth", "plot_runs", "best_index", "is_evaluation", "main"]

METRICS_FILE = "metrics.jsonl"
_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_metrics(run: str | Path) -> dict[str, tuple[list[int], list[float]]]:
    """``{tag: (steps, values)}`` of ``run``'s metrics.jsonl, finite numbers only, in file order."""
    directory = Path(run)
    if not directory.is_dir():
        raise UserError(f"{run}: no such run directory; give the save_path of a pimm run")
    path = directory / METRICS_FILE
    if not path.is_file():
        raise UserError(f"{run}: no {METRICS_FILE} in it (has this run logged a step yet?)")
    records, bad = read_jsonl(path)
    for line in bad:
        print(f"warning: skipped {line}", file=sys.stderr)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        step = record.get("step")
        if not _is_number(step):
            continue
        for tag, value in record.items():
            if tag not in ("step", "epoch") and _is_number(value):
                steps, values = series.setdefault(tag, ([], []))
                steps.append(int(step))
                values.append(float(value))
    return series


def parse_smoothing(spec: str) -> tuple[str, float]:
    """``auto`` | ``none`` | ``ema:W`` (0 <= W < 1, TensorBoard's slider) | ``mean:N`` (trailing window)."""
    if spec in ("auto", "none"):
        return spec, 0.0
    kind, _, value = spec.partition(":")
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if kind == "ema" and 0.0 <= number < 1.0:
        return kind, number
    if kind == "mean" and number >= 1 and number == int(number):
        return kind, number
    raise UserError(f"--smooth {spec!r} is invalid: use auto, none, ema:W with 0 <= W < 1, or mean:N with N >= 1")


def smooth(values: list[float], kind: str, param: float) -> list[float]:
    """Smoothed copy of ``values``. ``auto`` is a trailing mean over ~2 % of the points."""
    n = len(values)
    if kind == "auto":
        kind, param = "mean", max(1, round(n / 50))
    if kind == "none" or n == 0:
        return list(values)
    if kind == "ema":
        out, average, weight_sum = [], 0.0, 0.0
        for value in values:  # debiased, so the first points are not pulled towards 0
            average = param * average + (1.0 - param) * value
            weight_sum = param * weight_sum + (1.0 - param)
            out.append(average / weight_sum)
        return out
    window = int(param)
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _is_smoothed(key: str) -> bool:
    return key.startswith("train/") and key != "train/lr"


def is_evaluation(key: str) -> bool:
    """An evaluation curve (``val/*``, ``val_ema/*``, ``test/*``), whose best point is marked."""
    return key.split("/")[0].startswith(("val", "test"))


def best_index(key: str, values: list[float]) -> int:
    """Where ``values`` is best: lowest for a loss or error, highest otherwise (first on ties)."""
    name = key.rsplit("/", 1)[-1].lower()
    lower = any(word in name for word in ("loss", "error", "err", "nll", "perplexity", "mse", "mae"))
    best = min(values) if lower else max(values)
    return values.index(best)


def _labels(runs: list[Path]) -> list[str]:
    """The shortest trailing path of each run that tells them apart."""
    parts = [p.resolve().parts for p in runs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        labels = ["/".join(p[-depth:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in runs]


def _default_keys(all_series: list[dict]) -> list[str]:
    present = set().union(*(s.keys() for s in all_series))
    keys = [k for k in ("train/loss", "train/lr") if k in present]
    return keys + sorted(k for k in present if k.startswith("val/"))


def _output_path(first_run: Path, out: str | Path | None, overwrite: bool) -> Path:
    if out is not None and Path(out).suffix.lower() not in _SUFFIXES:
        raise UserError(f"-o {out}: use a file name ending in one of {', '.join(_SUFFIXES)}")
    return output_path(first_run / "plots" / "curves.png", out, overwrite)


def plot_runs(runs, keys: list[str] | None = None, out=None, smoothing: str = "auto",
              overwrite: bool = False) -> Path:
    """Draw the curves of ``runs`` (run directories) into one picture; returns its path."""
    runs = [Path(r) for r in runs]
    if not runs:
        raise UserError("give at least one run directory")
    kind, param = parse_smoothing(smoothing)
    all_series = [load_metrics(run) for run in runs]
    if keys is None:
        keys = _default_keys(all_series)
        if not keys:
            raise UserError(f"{', '.join(map(str, runs))}: metrics.jsonl has no train/loss, train/lr or val/* values yet")
    else:
        present = set().union(*(s.keys() for s in all_series))
        for key in keys:
            if key not in present:
                known = ", ".join(sorted(present)) or "none"
                raise UserError(f"--keys: no run has metric {key!r} (known: {known})")
    path = _output_path(runs[0], out, overwrite)
    require("matplotlib", "plot", "pimm plot")

    from matplotlib.figure import Figure  # imported here: `pimm --help` must not pay for it

    columns = 1 if len(keys) == 1 else 2
    rows = math.ceil(len(keys) / columns)
    figure = Figure(figsize=(6.0 * columns, 3.4 * rows), dpi=100, layout="constrained")
    colors = [f"C{i % 10}" for i in range(len(runs))]
    # One x range for every panel, so a step lines up across them.
    plotted = [s[key][0] for s in all_series for key in keys if key in s and s[key][0]]
    x_range = (min(min(p) for p in plotted), max(max(p) for p in plotted)) if plotted else None
    for index, key in enumerate(keys):
        axes = figure.add_subplot(rows, columns, index + 1)
        for label, series, color in zip(_labels(runs), all_series, colors):
            if key not in series:
                continue
            steps, values = series[key]
            if _is_smoothed(key) and kind != "none" and len(values) > 2:
                axes.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                axes.plot(steps, smooth(values, kind, param), color=color, linewidth=1.6, label=label)
            else:
                marker = "o" if len(values) <= 50 else None
                axes.plot(steps, values, color=color, linewidth=1.4, marker=marker, markersize=3, label=label)
            if is_evaluation(key) and values:
                at = best_index(key, values)
                axes.plot([steps[at]], [values[at]], linestyle="none", marker="*", markersize=13, color=color,
                          markeredgecolor="black", markeredgewidth=0.6, zorder=5,
                          label=f"best {values[at]:.4g} @ step {steps[at]}")
        if x_range is not None and x_range[0] < x_range[1]:
            axes.set_xlim(*x_range)
        axes.set_title(key)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if len(runs) > 1 or index == 0 or is_evaluation(key):
            axes.legend(fontsize="small")
    with writing(path):
        figure.savefig(path)
    return path


def main(argv: list[str], prog: str = "pimm plot") -> int:
    parser = ToolParser(prog=prog, description="Plot training and validation curves from metrics.jsonl.")
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run directories (save_path); several are overlaid")
    parser.add_argument("--keys", help="comma-separated tags, e.g. train/loss,val/mIoU "
                                       "(default: train/loss, train/lr and every val/* key)")
    parser.add_argument("-o", "--output", metavar="OUT", help="picture file (default FIRST_RUN/plots/curves.png)")
    parser.add_argument("--smooth", default="auto", metavar="HOW",
                        help="training curves: auto (trailing mean over ~2%% of the points), none, ema:0.9, mean:50")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    args = parser.parse_args(argv)
    keys = None
    if args.keys is not None:
        keys = [k.strip() for k in args.keys.split(",") if k.strip()]
        if not keys:
            raise UserError("--keys is empty; give tags such as train/loss,val/mIoU")
    path = plot_runs(args.runs, keys, args.output, args.smooth, args.overwrite)
    print(f"wrote {path}")
    return 0
