"""``pimm plot``: curves from metrics.jsonl, on hand-written files and on a real run."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import main as pimm_main  # noqa: E402
from pimm.cli.plot import load_metrics, plot_runs, smooth  # noqa: E402
from tests.support import forkserver  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402
from tests.support.run import run_tool, write_toy_config  # noqa: E402


def png_pixels(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(str(path))


def write_metrics(run: Path, records: list[dict], tail: str = "") -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + tail)
    return run


def synthetic(scale: float) -> list[dict]:
    records = []
    for step in range(1, 121):
        loss = None if step % 17 == 0 else scale * math.exp(-step / 40)
        records.append({"step": step, "epoch": 1 + step // 60, "train/loss": loss, "train/lr": 0.01})
        if step % 40 == 0:
            records.append({"step": step, "epoch": 1, "val/mIoU": 0.2 + step / 400 * scale, "val/acc": None})
    return records


def test_two_runs_with_null_values(tmp_path, capsys):
    run_a = write_metrics(tmp_path / "a", synthetic(1.0), tail='{"step": 121, "train/lo')  # cut last line
    run_b = write_metrics(tmp_path / "b", synthetic(0.5))
    series = load_metrics(run_a)
    assert "val/acc" not in series  # only nulls: nothing to draw
    steps, values = series["train/loss"]
    assert len(steps) == 120 - 7 and 17 not in steps and all(math.isfinite(v) for v in values)
    assert "metrics.jsonl:" in capsys.readouterr().err  # the cut line is reported

    out = plot_runs([run_a, run_b])
    assert out == run_a / "plots" / "curves.png"
    pixels = png_pixels(out)
    assert pixels.shape[0] > 200 and pixels.shape[1] > 200
    assert pixels[..., :3].std() > 0.05  # something was drawn

    # Overlaying b adds its curves: the picture of a alone differs.
    alone = plot_runs([run_a], out=tmp_path / "alone.png")
    assert png_pixels(alone).shape == pixels.shape and not np.array_equal(png_pixels(alone), pixels)


def test_keys_option_and_bad_input(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", synthetic(1.0))
    one = plot_runs([run], keys=["val/mIoU"], out=tmp_path / "one.png")
    four = plot_runs([run], keys=["train/loss", "train/lr", "val/mIoU", "train/loss"], out=tmp_path / "four.png")
    assert png_pixels(one).shape[0] < png_pixels(four).shape[0]  # one panel vs a 2x2 grid

    assert pimm_main(["plot", str(run), "--keys", "val/nope"]) == 2
    assert "error: --keys: no run has metric 'val/nope'" in capsys.readouterr().err
    assert pimm_main(["plot", str(tmp_path / "missing")]) == 2
    assert "no such run directory" in capsys.readouterr().err
    (tmp_path / "bare").mkdir()
    assert pimm_main(["plot", str(tmp_path / "bare")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert pimm_main(["plot", str(run), "--smooth", "ema:2"]) == 2
    assert "--smooth 'ema:2' is invalid" in capsys.readouterr().err


def test_explicit_output_is_never_overwritten_without_the_flag(tmp_path, capsys):
    run = write_metrics(tmp_path / "run", synthetic(1.0))
    mine = tmp_path / "mine.png"
    mine.write_bytes(b"not ours")
    keys = ["--keys", "val/mIoU"]
    assert pimm_main(["plot", str(run), "-o", str(mine), *keys]) == 2
    assert "exists" in capsys.readouterr().err and mine.read_bytes() == b"not ours"
    assert pimm_main(["plot", str(run), "-o", str(mine), "--overwrite", *keys]) == 0
    assert png_pixels(mine).size
    # The default picture is ours (derived from metrics.jsonl): a second call rewrites it.
    assert pimm_main(["plot", str(run), *keys]) == 0 and pimm_main(["plot", str(run), *keys]) == 0


def test_smoothing():
    values = [0.0, 10.0, 0.0, 10.0, 0.0, 10.0]
    assert smooth(values, "none", 0) == values
    assert smooth(values, "mean", 2) == [0.0, 5.0, 5.0, 5.0, 5.0, 5.0]
    ema = smooth(values, "ema", 0.5)
    assert ema[0] == 0.0 and ema[1] == pytest.approx(10 * 0.5 / 0.75)  # debiased
    assert smooth(list(range(100)), "auto", 0)[-1] == pytest.approx(98.5)  # trailing mean over 2 points


@pytest.mark.slow
def test_plot_of_a_real_training_run(tmp_path):
    save_path = tmp_path / "toy"
    config = write_toy_config(tmp_path, save_path)
    train = run_tool("train", config, "epoch=2")
    assert train.returncode == 0, train.stderr
    proc = forkserver.run([sys.executable, "-m", "pimm.cli", "plot", str(save_path)], env=tool_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = save_path / "plots" / "curves.png"
    assert f"wrote {out}" in proc.stdout
    assert out.stat().st_size > 10_000 and png_pixels(out)[..., :3].std() > 0.05
    series = load_metrics(save_path)
    assert {"train/loss", "train/lr", "val/acc"} <= set(series)
