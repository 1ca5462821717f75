"""The shipped detector config (``configs/lartpc/panseg-detector.py``) end to
end through ``tools/train.py``, shrunk to 8 steps: it trains, evaluates with
``InstanceSegmentationEvaluator`` (upstream's metric names in metrics.jsonl),
and a run SIGKILLed at step 6 (newest checkpoint: step 4) and resumed ends
with bit-identical weights and the same per-step losses as the run left
alone (PT-v3's random serialisation orders, the random matcher subsampling
and the data order included)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.support.run import ROOT, final_weights, run_tool, train_losses

CONFIG = ROOT / "configs" / "lartpc" / "panseg-detector.py"
STEPS = 8
WRAPPER = '''
_base_ = [{base!r}]
custom_imports = ["tests.support.toy"]
hooks = [
    dict(type="InstanceSegmentationEvaluator", every_n_steps=3, iou_thresh=0.5, labels=("particle", "interaction"),
         primary_label="particle",
         class_names={{"particle": ["photon", "electron", "muon", "pion", "proton"],
                      "interaction": ["stuff", "thing"]}}),
    dict(type="AttentionMaskAnnealingHook", log_frequency=2),
    dict(type="KillAtStep", step=10**9, signal_name="SIGKILL", wait_for_commit=True),
]
'''
# 16 small training events in batches of 2 (8 steps), 4 validation events, a checkpoint every 4 steps.
OPTIONS = ["batch_size=2", "batch_size_val=2", "num_worker=0", "data.train.num_events=16", "data.val.num_events=4",
           "data.train.points_per_event=(300,500)", "data.val.points_per_event=(300,500)",
           "scheduler.warmup_steps=2", "default_hooks.checkpoint.save_freq=4",
           "default_hooks.information_writer.log_frequency=1"]


@pytest.fixture
def wrapper(tmp_path):
    path = tmp_path / "panseg-detector-tiny.py"
    path.write_text(WRAPPER.format(base=str(CONFIG)))
    return path


@pytest.mark.slow
def test_detector_config_trains_evaluates_and_resumes_after_sigkill_bit_identically(wrapper, tmp_path):
    ref = tmp_path / "ref"
    done = run_tool("train", wrapper, f"save_path={ref}", *OPTIONS, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(ref / "metrics.jsonl")]
    val = [r for r in records if "val/particle/ins_det_f1" in r]
    assert [r["step"] for r in val] == [3, 6, 8]  # every 3 steps and the final weights
    assert {"val/particle/ins_det_precision", "val/particle/ins_pq", "val/interaction/ins_det_recall",
            "val/particle/ins_cls_macro_f1"} <= set(val[-1])
    assert all(math.isfinite(v) for v in (r["train/loss"] for r in records if "train/loss" in r))
    assert any("anneal/average" in r for r in records)

    run = tmp_path / "run"
    killed = run_tool("train", wrapper, f"save_path={run}", *OPTIONS, "hooks.KillAtStep.step=6", timeout=600)
    assert killed.returncode in (-9, 137), killed.stderr[-3000:]
    resumed = run_tool("train", wrapper, f"save_path={run}", *OPTIONS, "resume=True", "hooks.KillAtStep.step=0",
                       timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from step000000004" in (run / "train.log").read_text()
    want, got = final_weights(ref)["state_dict"], final_weights(run)["state_dict"]
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
    assert train_losses(run) == train_losses(ref) and len(train_losses(ref)) == STEPS
