"""``detector-v3m2`` computes upstream pimm's function and takes its checkpoints
(issue 47, item 5).

``tests/fixtures/detector_v3m2/reference.pt.xz`` is upstream's own v3m2
(``MultiLabelDetectorV3M2`` of ``detector_v3m2.py``) run on CPU with a tiny
PT-v3m2 encoder (its ``make_reference.py`` says how): upstream's state dict
and, per run (eval with and without truth, post-norm with annealed masks,
unsupervised masks, one stuff head fewer, train), every tensor of the
forward output under its key path, and ``postprocess`` of both labels. Each
test writes the weights as upstream saves a checkpoint, loads them strictly
into pimm's model built from the same kwargs and compares every output.
"""

from __future__ import annotations

import math
from copy import deepcopy
from pathlib import Path

import pytest
import torch

import pimm
import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError
from tests.support.detector_reference import (compare, expected, flatten, load_reference, load_upstream_checkpoint,
                                              run_input, upstream_state)

FIXTURE = Path(__file__).parent / "fixtures" / "detector_v3m2" / "reference.pt.xz"
RUNS = ["eval", "eval-no-truth", "eval-post-norm-annealed", "eval-unsupervised-masks", "eval-one-stuff-head", "train",
        "train-one-stuff-head"]


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


def _run(ref: dict, name: str) -> dict:
    return next(r for r in ref["runs"] if r["name"] == name)


def _model(ref: dict, run: dict, tmp_path: Path):
    model = MODELS.build(deepcopy(dict(ref["kwargs"], **run["overrides"])))
    return load_upstream_checkpoint(model, ref, run, tmp_path)


@pytest.mark.parametrize("name", RUNS)
def test_every_output_matches_upstream(reference, name, tmp_path):
    run = _run(reference, name)
    model = _model(reference, run, tmp_path)
    model.train(run["mode"] == "train")
    if run["step"] is not None:
        model.update_anneal_step(run["step"])
    torch.manual_seed(run["seed"])
    with torch.no_grad():
        out = model(run_input(reference, run))
    diffs = compare(flatten(out), expected(reference, run["output"]), name)
    for i, post in enumerate(run["postprocess"]):
        fused = model.postprocess(out, **post["options"])
        diffs.update({f"postprocess[{i}].{k}": v
                      for k, v in compare(flatten(fused), expected(reference, post["output"]), f"{name} {i}").items()})
    assert len(diffs) > 20 and max(diffs.values()) <= 1e-4
    if name.startswith("train"):
        assert {"loss", "particle_loss", "interaction_loss", "particle_stuff_loss"} <= set(diffs)
        assert any(k.startswith("particle_aux_") for k in diffs)
    if name == "eval":
        assert {"postprocess[0].instance_labels", "postprocess[1].instance_labels", "outputs_by_label.particle."
                "stuff_logits", "interaction_stuff_probs", "point_counts"} <= set(diffs)


def test_the_reference_is_not_trivial(reference):
    """Painted instances in both labels; the one-stuff-head run drops the
    interaction head's weights and its loss."""
    for post in _run(reference, "eval")["postprocess"]:
        labels = expected(reference, post["output"])["instance_labels"]
        assert (labels >= 0).sum() > 10 and len(labels.unique()) >= 3
    one = _run(reference, "eval-one-stuff-head")
    assert one["unused_params"] and all(k.startswith("decoder.stuff_head_by_label.interaction.")
                                        for k in one["unused_params"])
    assert "interaction_stuff_loss" not in {leaf[0] for leaf in one["output"]}


def test_an_upstream_checkpoint_loads_strictly_through_from_pretrained(reference, tmp_path):
    state = upstream_state(reference)
    torch.save({"epoch": 2, "state_dict": {"module." + k: v for k, v in state.items()}}, tmp_path / "model_last.pth")
    model = pimm.from_pretrained(str(tmp_path / "model_last.pth"), model_config=reference["kwargs"])
    assert not model.training and set(model.state_dict()) == set(state)
    assert all(torch.equal(model.state_dict()[k].float(), v.float()) for k, v in state.items())
    assert not any(k.startswith("criteria") for k in model.state_dict())
    # the instance loss upstream names InstanceSegmentationLoss trains as FastInstanceSegmentationLoss
    assert type(model.criteria_by_label["particle"].losses[0]).__name__ == "FastInstanceSegmentationLoss"


def test_a_training_step_learns(reference, tmp_path):
    run = _run(reference, "train")
    model = _model(reference, run, tmp_path).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        loss = model(run_input(reference, run))["loss"]
        opt.zero_grad()
        loss.backward()
        assert model.decoder.blocks[0].cross_attn.q_proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[1] < losses[0]


def _tiny(**overrides) -> dict:
    backbone = dict(type="PT-v3m2", in_channels=4, order=("z",), stride=(2,), enc_depths=(1, 1),
                    enc_channels=(8, 8), enc_num_head=(1, 1), enc_patch_size=(16, 16), dec_depths=(1,),
                    dec_channels=(8,), dec_num_head=(1,), dec_patch_size=(16,), enc_mode=True)
    return dict(dict(type="detector-v3m2", backbone=backbone, full_in_channels=16, hidden_channels=8, num_heads=2,
                     criteria=[dict(type="InstanceSegmentationLoss")]), **overrides)


@pytest.mark.parametrize("overrides, words", [
    (dict(train_filter_use_gt=True), "train_filter_use_gt=True is not supported"),
    (dict(num_queries=None), "num_queries must be an int >= 1, got None"),
    (dict(labels=("particle", "interaction"), num_queries=dict(particle=4)), "label 'interaction': num_queries"),
    (dict(query_type="superpoint"), "query_type"),
    (dict(eval_label="vertex"), "eval_label='vertex'"),
    (dict(labels=("ring",)), "num_classes"),
    (dict(stuff_classes=[7]), "stuff_classes [7] are not classes 0..5"),
    (dict(num_heads=3), "divisible"),
    (dict(full_in_channels=20), "full_in_channels=20"),
])
def test_bad_settings_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        MODELS.build(_tiny(**overrides))
    assert words in str(err.value) and "\n" not in str(err.value) and "detector-v3m2" in str(err.value)


def test_defaults_are_upstreams_and_label_configs_queries_are_ignored():
    """v3m2's own rules: 32 queries per label by default (a num_queries in
    label_configs is not read, as upstream), a stuff head per label."""
    model = MODELS.build(_tiny(labels=("particle", "interaction"),
                               label_configs=dict(interaction=dict(num_queries=3))))
    assert model.decoder.query_feat.weight.shape == (64, 8)
    assert set(model.decoder.stuff_head_by_label) == {"particle", "interaction"}
    assert model.postprocess_cfg["conf_threshold"] == 0.5 and model.eval_label == "interaction"
    assert type(model).label_classes(dict(labels=("particle", "interaction"))) == dict(particle=6, interaction=2)


def test_missing_truth_in_training_is_one_line(reference, tmp_path):
    run = _run(reference, "train")
    model = _model(reference, run, tmp_path).train()
    batch = run_input(reference, run)
    batch.pop("instance_interaction")
    with pytest.raises(ConfigError, match="instance_interaction.*add them to Collect"):
        model(batch)
    with pytest.raises(ConfigError, match="return_decoder"):
        model(run_input(reference, run), return_decoder=True)


def test_the_docs_options_line_trains_and_validates_on_the_lartpc_generator(tmp_path, capsys):
    """docs/models.md's command (the panoptic config with the model swapped
    for v3m2) through the trainer: two steps and a validation scored by
    upstream's panoptic evaluator through v3m2's fusion."""
    import json
    import shlex

    import pimm.cli
    from tests.support.doc_commands import commands

    pimm.cli.register_all()
    from pimm.engines.run.launch import main as launch_main

    docs = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    line = next(c for c in commands(docs) if "detector-v3m2" in c and "tools/train.py" in c)
    argv = shlex.split(line)[2:]  # after "python tools/train.py"
    argv[argv.index("--config-file") + 1] = str(Path(__file__).resolve().parents[1] / argv[argv.index(
        "--config-file") + 1])
    argv = [a if not a.startswith("save_path=") else f"save_path={tmp_path / 'run'}" for a in argv]
    code = launch_main(argv + ["data.train.num_events=4", "data.val.num_events=2", "num_worker=0", "batch_size=2",
                               "batch_size_val=2", "epoch=1", "scheduler.warmup_steps=1",
                               "+custom_imports=['tests.support.stop_after']",
                               "+hooks=[dict(type='StopAfter', steps=2)]"])
    assert code == 0, capsys.readouterr().err[-2000:]
    records = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in records if "train/loss" in r]
    assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    assert any(any(k.startswith("val/particle/") for k in r) for r in records)
