"""``detector-v5`` takes upstream's v5 checkpoints strictly and computes its function.

``tests/fixtures/detector_v5/reference.pt.xz`` is upstream's own v5
(``UnifiedDetector`` of ``detector_v5.py``) run on CPU with a tiny PT-v3m2
encoder (its ``make_reference.py`` says how and at which upstream commit):
upstream's state dict and, per run (eval / train, with and without truth,
learned or energy point filter, post-norm, unsupervised masks), every tensor
of the forward output under its key path, and ``postprocess`` of both labels.
Each test writes the weights as upstream saves a checkpoint, loads them
strictly (every tensor used, none missing) into pimm's model built from the
same kwargs and compares every output within 1e-4.
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError
from tests.support.detector_reference import (compare, expected, flatten, load_reference, load_upstream_checkpoint,
                                              run_input)

FIXTURE = Path(__file__).parent / "fixtures" / "detector_v5" / "reference.pt.xz"
RUNS = ["eval", "eval-no-truth", "eval-learned-filter", "eval-energy-filter", "eval-post-norm",
        "eval-unsupervised-masks", "train", "train-learned-filter"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


def _run(ref: dict, name: str) -> dict:
    return next(r for r in ref["runs"] if r["name"] == name)


def _model(ref: dict, run: dict, tmp_path: Path):
    model = MODELS.build(deepcopy(dict(ref["kwargs"], **run["overrides"])))
    return load_upstream_checkpoint(model, ref, run, tmp_path)


def run_reference(ref: dict, name: str, tmp_path: Path) -> dict:
    """{output path or 'postprocess[i].path': max abs diff} of one run, checked."""
    run = _run(ref, name)
    model = _model(ref, run, tmp_path)
    model.train(run["mode"] == "train")
    torch.manual_seed(run["seed"])
    with torch.no_grad():
        out = model(run_input(ref, run))
    diffs = compare(flatten(out), expected(ref, run["output"]), name)
    for i, post in enumerate(run["postprocess"]):
        fused = model.postprocess(out, **post["options"])
        diffs.update({f"postprocess[{i}].{k}": v
                      for k, v in compare(flatten(fused), expected(ref, post["output"]), f"{name} {i}").items()})
    return diffs


def test_upstreams_state_dict_names_and_shapes_are_pimms(reference):
    """Every name and shape of upstream's v5 state dict, and nothing else:
    the decoder blocks' ``self_attn.kv``, ``cross_attn.q_proj``,
    ``anneal_progress``, the layer scales, the point filter's head."""
    model = MODELS.build(deepcopy(reference["kwargs"]))
    ours = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert ours == dict(zip(reference["param_names"], reference["param_shapes"]))
    assert {"decoder.blocks.0.self_attn.kv.weight", "decoder.blocks.2.cross_attn.v_proj.bias",
            "decoder.blocks.1.anneal_progress", "decoder.blocks.0.ls3.gamma",
            "decoder.point_filter.head.2.weight"} <= set(ours)


@pytest.mark.parametrize("name", RUNS)
def test_every_output_matches_upstream(reference, name, tmp_path):
    diffs = run_reference(reference, name, tmp_path)
    assert len(diffs) > 50
    if name.startswith("train"):
        assert "loss" in diffs and any(k.endswith("_aux_focal_L1") for k in diffs)
    if name == "train-learned-filter":
        assert "filter_loss" in diffs
    if name == "eval":
        assert any(k.startswith("postprocess[2].instance_labels") for k in diffs)


def test_the_reference_is_not_trivial(reference):
    """The fixture exercises what it claims: instances painted in both events
    (numbered on across the batch, as upstream), both labels' heads, a unit
    direction head, a learned filter that drops points."""
    run = _run(reference, "eval")
    offset = int(reference["input"]["offset"][0])
    for post in run["postprocess"]:
        labels = expected(reference, post["output"])["instance_labels"]
        first, second = labels[:offset], labels[offset:]
        assert (first >= 0).sum() > 10 and (second >= 0).sum() > 10
        assert second[second >= 0].min() > first.max()  # the second event's ids run on from the first's
    outputs = expected(reference, run["output"])
    assert {"particle_pred_is_primary.1", "interaction_pred_vertex.0", "interaction_stuff_loss",
            "particle_vertex", "particle_direction", "pred_regression.momentum.0", "point_counts"} <= set(outputs)
    assert torch.allclose(outputs["particle_pred_direction.0"].norm(dim=-1), torch.ones(6), atol=1e-5)
    filtered = expected(reference, _run(reference, "eval-learned-filter")["output"])["particle_pred_masks.0"]
    assert 0 < int((filtered == -1e4).all(dim=0).sum()) < filtered.shape[1]


def test_postprocess_numbers_instances_across_the_batch(reference, tmp_path):
    """An event fused alone numbers its instances from 1; in a batch the
    second event's ids are shifted by the first event's largest id plus one
    (upstream's numbering: ids unique in the batch, one left unused between
    events), the painting otherwise the same."""
    run = _run(reference, "eval")
    model = _model(reference, run, tmp_path).eval()
    batch = run_input(reference, run)
    with torch.no_grad():
        both = model.postprocess(model(batch))["instance_labels"]
        n = int(batch["offset"][0])
        second = {k: v[n:] if k != "offset" else v[1:] - n for k, v in batch.items()}
        alone = model.postprocess(model(second))["instance_labels"]
    shift = int(both[:n].max()) + 1
    assert shift >= 2 and alone.min() == -1 and int(alone.max()) >= 1
    assert torch.equal(both[n:], torch.where(alone >= 0, alone + shift, alone))


def test_a_bad_point_filter_is_one_line():
    kwargs = deepcopy(load_reference(FIXTURE)["kwargs"])
    for bad, words in ((dict(type="random"), "point_filter: type"), (dict(treshold=0.5), "treshold")):
        with pytest.raises(ConfigError, match=words) as err:
            MODELS.build(dict(kwargs, point_filter=bad))
        assert "\n" not in str(err.value)
