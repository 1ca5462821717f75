"""``DINOEnhancedSegmentor`` (issue 47, item 6): upstream's segmentor that
adds per-point DINO image features to the point features.

* against upstream's own model on a tiny PT-v3m2 run on CPU
  (``tests/fixtures/dino_segmentor/reference.pt.xz``, its ``make_reference.py``
  says how): a traceable decoder's hypercolumn and an encoder-only one, eval
  and train, frozen or not; the checkpoint loads strictly through
  ``weight=``'s loader and ``pimm.from_pretrained``;
* without a backbone, against the direct computation (nearest feature
  point of the same event by brute force, then the head);
* the docs' example config (``docs/models.md``: the LArTPC generator with a
  stand-in transform drawing random features, ``tests/support/dino_features.py``)
  trains two steps through the trainer.
"""

from __future__ import annotations

import json
import math
import re
from copy import deepcopy
from pathlib import Path

import pytest
import torch

import pimm
import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError
from tests.support.detector_reference import compare, expected, flatten, load_reference, load_upstream_checkpoint
from tests.support.detector_reference import upstream_state

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "dino_segmentor" / "reference.pt.xz"


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


@pytest.mark.parametrize("name", ["eval", "train", "eval-enc-mode", "train-frozen"])
def test_dino_segmentor_computes_upstreams_function_from_its_checkpoint(reference, name, tmp_path):
    run = next(r for r in reference["runs"] if r["name"] == name)
    model = MODELS.build(deepcopy(dict(reference["kwargs"], **run["overrides"])))
    load_upstream_checkpoint(model, reference, run, tmp_path)
    model.train(run["mode"] == "train")
    caught = {}
    model.seg_head.register_forward_hook(lambda m, i, o: caught.__setitem__("head_output", o.detach()))
    torch.manual_seed(run["seed"])
    with torch.no_grad():
        out = model({k: v.clone() for k, v in reference["input"].items()})
    if run["mode"] == "train":  # pimm also returns the logits in training
        assert torch.equal(out.pop("seg_logits"), caught["head_output"])
    diffs = compare(flatten({**out, **caught}), expected(reference, run["output"]), name)
    assert {"loss", "head_output"} <= set(diffs) and max(diffs.values()) <= 1e-4
    if name == "train-frozen":
        assert not any(p.requires_grad for p in model.backbone.parameters())
    if name == "eval-enc-mode":
        assert run["unused_params"] and all(".dec." in k for k in run["unused_params"])


def test_an_upstream_checkpoint_loads_strictly_through_from_pretrained(reference, tmp_path):
    state = upstream_state(reference)
    torch.save({"epoch": 1, "state_dict": {"module." + k: v for k, v in state.items()}}, tmp_path / "model_best.pth")
    model = pimm.from_pretrained(str(tmp_path / "model_best.pth"), model_config=reference["kwargs"])
    assert set(model.state_dict()) == set(state) and not model.training
    out = model({k: v.clone() for k, v in reference["input"].items()})
    want = expected(reference, next(r for r in reference["runs"] if r["name"] == "eval")["output"])
    assert (out["seg_logits"] - want["seg_logits"]).abs().max() <= 1e-4


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    n, m = (30, 45), (20, 7)
    origin = torch.rand(sum(n), 3, generator=g) * 4
    return dict(origin_coord=origin, origin_offset=torch.tensor(n).cumsum(0), coord=origin.clone(),
                offset=torch.tensor(n).cumsum(0), dino_coord=torch.rand(sum(m), 3, generator=g) * 4,
                dino_feat=torch.randn(sum(m), 5, generator=g), dino_offset=torch.tensor(m).cumsum(0),
                segment=torch.randint(0, 3, (sum(n),), generator=g))


def test_without_a_backbone_each_point_takes_its_nearest_feature_point_of_its_event():
    model = MODELS.build(dict(type="DINOEnhancedSegmentor", num_classes=3, backbone_out_channels=5)).train()
    data = _batch()
    out = model(data)
    bounds, dino_bounds = [0, 30, 75], [0, 20, 27]
    nearest = []
    for i, p in enumerate(data["origin_coord"]):
        e = 0 if i < 30 else 1
        d = ((data["dino_coord"][dino_bounds[e]:dino_bounds[e + 1]] - p) ** 2).sum(1)
        nearest.append(dino_bounds[e] + int(d.argmin()))
    assert bounds[-1] == len(nearest)
    want = model.seg_head(data["dino_feat"][nearest])
    assert torch.allclose(out["seg_logits"], want, atol=1e-6)
    assert torch.isclose(out["loss"], torch.nn.functional.cross_entropy(want, data["segment"]))
    out["loss"].backward()
    assert model.seg_head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("dino_feat"), r"lacks \['dino_feat'\]: events must carry DINO features"),
    (lambda d: d.pop("origin_offset"), r"lacks \['origin_offset'\]"),
    (lambda d: d.update(dino_offset=torch.tensor([27, 27])), "45 points have no DINO feature point in their event"),
    (lambda d: d.pop("segment"), "trains on the batch key 'segment'"),
])
def test_bad_batches_are_one_line(change, words):
    model = MODELS.build(dict(type="DINOEnhancedSegmentor", num_classes=3, backbone_out_channels=5))
    data = _batch()
    change(data)
    with pytest.raises(ConfigError, match=words) as err:
        model(data)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="backbone_out_channels=9 but the backbone and DINO features are 5 wide"):
        MODELS.build(dict(type="DINOEnhancedSegmentor", num_classes=3, backbone_out_channels=9))(_batch())


def _docs_config() -> str:
    text = (ROOT / "docs" / "models.md").read_text()
    block = next(b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
                 if "DINOEnhancedSegmentor" in b and "_base_" in b)
    base = ROOT / "configs" / "lartpc" / "semseg-ptv3.py"
    return block.replace('_base_ = "semseg-ptv3.py"', f"_base_ = {str(base)!r}")


def test_the_docs_example_trains_two_steps_through_the_trainer(tmp_path, capsys):
    import pimm.cli

    pimm.cli.register_all()
    from pimm.engines.run.launch import main as launch_main

    config = tmp_path / "semseg-ptv3-dino.py"
    config.write_text(_docs_config())
    save = tmp_path / "run"
    code = launch_main(["--config-file", str(config), "--options", f"save_path={save}", "data.train.num_events=4",
                        "data.train.points_per_event=(300, 400)", "num_worker=0", "batch_size=2", "epoch=1",
                        "evaluate=False", "scheduler.warmup_steps=1", "+custom_imports=['tests.support.stop_after']",
                        "+hooks=[dict(type='StopAfter', steps=2)]"])
    assert code == 0, capsys.readouterr().err[-2000:]
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in steps if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    resolved = (save / "config.py").read_text()
    assert "DINOEnhancedSegmentor" in resolved and "traceable=True" in resolved
