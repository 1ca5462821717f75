"""End to end: a config written in upstream pimm's vocabulary (upstream's tiny
semantic-segmentation test, with only the model replaced by pimm's SparseUNet)
trains one epoch through tools/train.py on files written by
tools/export_pilarnet.py.

Two variants (configs in tests/support/upstream_style/):

* ``tiny_semseg_pimm_runtime.py`` -- the data, transform and evaluator
  vocabulary on pimm's own runtime defaults: must pass.
* ``tiny_semseg.py`` -- the same on upstream's runtime section; the test also
  checks that every runtime key, default hook and tester it names is one the
  engine implements (an unknown top-level key would otherwise pass silently).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from pimm.utils.config import Config
from tests.support.run import ROOT, env, run_tool

CONFIGS = ROOT / "tests" / "support" / "upstream_style"
TINY = CONFIGS / "tests" / "tiny_semseg.py"
TINY_PIMM_RUNTIME = CONFIGS / "tests" / "tiny_semseg_pimm_runtime.py"

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pilarnet")
    for split, events in (("train", 8), ("val", 4)):
        res = subprocess.run([sys.executable, str(ROOT / "tools" / "export_pilarnet.py"), "--out", str(root),
                              "--num-events", str(events), "--seed", "3", "--split", split,
                              "--events-per-file", "4"], capture_output=True, text=True, timeout=300, env=env())
        assert res.returncode == 0, res.stderr
    return root


def train_and_check(config, exported, save_path):
    res = run_tool("train", config, f"save_path={save_path}", f"data.train.data_root={exported}",
                   f"data.val.data_root={exported}", timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    records = [json.loads(line) for line in open(save_path / "metrics.jsonl")]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)  # 8 events, batch_size 4, one epoch
    val = next(r for r in records if "val/mIoU" in r)
    # The evaluator got its classes and names from data.num_classes / data.names.
    assert {f"val/iou_{name}" for name in ("shower", "track", "michel", "delta", "led")} <= set(val)
    assert 0.0 <= val["val/allAcc"] <= 1.0
    log = (save_path / "train.log").read_text()
    assert "PILArNetH5Dataset train: 8 of 8 events" in log and "PILArNetH5Dataset val: 4 of 4 events" in log
    state = torch.load(save_path / "model" / "model_last.pth", weights_only=True)["state_dict"]
    assert state["seg_head.weight"].shape[0] == 5


@pytest.mark.slow
def test_upstream_vocabulary_on_pimm_runtime(exported, tmp_path):
    train_and_check(TINY_PIMM_RUNTIME, exported, tmp_path / "run")


def runtime_vocabulary_gaps() -> list[str]:
    """The upstream runtime keys, default hooks and tester that pimm's engine
    does not implement."""
    import pimm.evaluation  # noqa: F401  (registers the evaluators and testers, as tools/train.py does)
    from pimm.engines import registries
    from pimm.engines.run.runtime import RUNTIME_DEFAULTS

    base = Config.fromfile(CONFIGS / "_base_" / "default_runtime.py")
    body = set(Config.fromfile(CONFIGS / "tests" / "tiny_semseg_body.py"))
    runtime = set(base) | (set(Config.fromfile(TINY)) - body)
    gaps = sorted(runtime - set(RUNTIME_DEFAULTS))
    gaps += [f"hook {h['type']}" for h in base["hooks"] if h["type"] not in registries.HOOKS]
    testers = getattr(registries, "TESTERS", None)
    if testers is None or base["test"]["type"] not in testers:
        gaps.append(f"tester {base['test']['type']}")
    return gaps


@pytest.mark.slow
def test_upstream_tiny_semseg_with_upstream_runtime(exported, tmp_path):
    train_and_check(TINY, exported, tmp_path / "run")
    gaps = runtime_vocabulary_gaps()
    assert not gaps, f"upstream runtime vocabulary the engine does not implement: {gaps}"
