"""``pimm plot``: one step range for every panel, the best evaluation starred."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")
from matplotlib.figure import Figure  # noqa: E402

from pimm.cli.plot import best_index, is_evaluation, plot_runs  # noqa: E402


def _run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_best_is_highest_for_scores_and_lowest_for_losses():
    assert best_index("val/acc", [0.5, 0.9, 0.8]) == 1
    assert best_index("val/loss", [0.5, 0.2, 0.3]) == 1
    assert best_index("val_ema/mIoU", [0.1, 0.1]) == 0
    assert is_evaluation("val/acc") and is_evaluation("val_ema/acc") and not is_evaluation("train/loss")


def test_panels_share_the_step_range_and_the_best_evaluation_is_marked(tmp_path, monkeypatch):
    a = _run(tmp_path / "a", [{"step": s, "train/loss": 1.0 / s} for s in range(1, 101)]
             + [{"step": 50, "val/acc": 0.7}, {"step": 100, "val/acc": 0.9}])
    b = _run(tmp_path / "b", [{"step": s, "train/loss": 2.0 / s} for s in range(1, 41)]
             + [{"step": 20, "val/acc": 0.8}, {"step": 40, "val/acc": 0.6}])
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *args, **kwargs: saved.append(self))
    plot_runs([a, b], keys=["train/loss", "val/acc"], smoothing="ema:0.5")
    axes = saved[0].axes
    assert [ax.get_xlim() for ax in axes] == [(1, 100), (1, 100)]  # val/acc alone would span 20..100
    stars = [line for line in axes[1].get_lines() if line.get_marker() == "*"]
    assert sorted((line.get_xdata()[0], line.get_ydata()[0]) for line in stars) == [(20, 0.8), (100, 0.9)]
    assert {line.get_label() for line in stars} == {"best 0.9 @ step 100", "best 0.8 @ step 20"}
    assert not [line for line in axes[0].get_lines() if line.get_marker() == "*"]  # training curves: none
