"""``detector-v4`` computes upstream pimm's function and takes its checkpoints.

``tests/fixtures/detector_v4/reference.pt.xz`` is upstream's own v4
(``UnifiedDetector`` of ``detector_v4.py``) run on CPU with a tiny PT-v3m2
encoder (``make_reference.py`` there says how and at which upstream commit):
upstream's state dict and, per run (eval / train, learned or energy point
filter, post-norm with annealed masks, unsupervised masks), every tensor of
the forward output under its key path, and in eval runs ``postprocess`` of
both labels. Each test writes the weights as upstream saves a checkpoint,
loads them strictly through pimm's documented path into pimm's model built
from the same kwargs and compares every output.
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError
from tests.support.detector_reference import compare
from tests.support.detector_reference import expected as _expected
from tests.support.detector_reference import flatten as _flatten
from tests.support.detector_reference import load_reference, load_upstream_checkpoint
from tests.support.detector_reference import run_input as _input

FIXTURE = Path(__file__).parent / "fixtures" / "detector_v4" / "reference.pt.xz"


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_reference(FIXTURE)


def _run_names() -> list[str]:
    return ["eval", "eval-no-truth", "eval-learned-filter", "eval-energy-filter", "eval-post-norm-annealed",
            "eval-unsupervised-masks", "train", "train-learned-filter"]


def _model(ref: dict, run: dict, tmp_path: Path):
    model = MODELS.build(deepcopy(dict(ref["kwargs"], **run["overrides"])))
    return load_upstream_checkpoint(model, ref, run, tmp_path)


def run_reference(ref: dict, name: str, tmp_path: Path) -> dict:
    """{output path or 'postprocess[i].path': max abs diff} of one run, checked."""
    run = next(r for r in ref["runs"] if r["name"] == name)
    model = _model(ref, run, tmp_path)
    model.train(run["mode"] == "train")
    if run["step"] is not None:
        model.update_anneal_step(run["step"])
    torch.manual_seed(run["seed"])
    with torch.no_grad():
        out = model(_input(ref, run))
    diffs = compare(_flatten(out), _expected(ref, run["output"]), name)
    for i, post in enumerate(run["postprocess"]):
        fused = model.postprocess(out, **post["options"])
        diffs.update({f"postprocess[{i}].{k}": v
                      for k, v in compare(_flatten(fused), _expected(ref, post["output"]), f"{name} {i}").items()})
    return diffs


@pytest.mark.parametrize("name", _run_names())
def test_every_output_matches_upstream(reference, name, tmp_path):
    diffs = run_reference(reference, name, tmp_path)
    assert len(diffs) > 50
    if name.startswith("train"):
        assert "loss" in diffs and any(k.endswith("_aux_focal_L1") for k in diffs)
    if name == "eval":
        assert any(k.startswith("postprocess[2].instance_labels") for k in diffs)


def test_the_reference_is_not_trivial(reference):
    """The fixture exercises what it claims: painted instances, both labels'
    heads, the losses of every term, a learned filter that drops points."""
    run = next(r for r in reference["runs"] if r["name"] == "eval")
    for post in run["postprocess"]:
        labels = _expected(reference, post["output"])["instance_labels"]
        assert (labels >= 0).sum() > 10 and len(labels.unique()) >= 3
    paths = {leaf[0] for leaf in run["output"]}
    assert {"particle_pred_is_primary.1", "interaction_pred_vertex.0", "interaction_stuff_loss",
            "particle_vertex", "pred_regression.momentum.0", "point_counts"} <= paths
    filtered = next(r for r in reference["runs"] if r["name"] == "eval-learned-filter")
    masks = _expected(reference, filtered["output"])["particle_pred_masks.0"]
    assert 0 < int((masks == -1e4).all(dim=0).sum()) < masks.shape[1]


def test_released_panda_configs_build_with_upstreams_keywords():
    """The keyword set of upstream's released v4 configs (Panda-Particle:
    mlp_point_proj, decoder-and-encoder backbone; Panda-Interaction: encoder
    only) builds, with upstream's decoder parameter names."""
    backbone = dict(type="PT-v3m2", in_channels=4, order=("hilbert", "hilbert-trans", "z", "z-trans"),
                    stride=(2,), enc_depths=(1, 1), enc_channels=(8, 8), enc_num_head=(1, 2),
                    enc_patch_size=(16, 16), dec_depths=(1,), dec_channels=(8,), dec_num_head=(1,),
                    dec_patch_size=(16,), mlp_ratio=4, qkv_bias=True, qk_scale=None, layer_scale=1e-5,
                    attn_drop=0.0, proj_drop=0.0, drop_path=0.3, shuffle_orders=True, pre_norm=True,
                    enable_rpe=False, enable_flash=True, upcast_attention=False, upcast_softmax=False,
                    traceable=False, mask_token=False, enc_mode=True, freeze_encoder=False)
    loss = dict(type="FastUnifiedInstanceLoss", cost_mask=1.0, cost_dice=1.0, cost_class=1.0,
                loss_weight_focal=2.0, loss_weight_dice=5.0, cls_weight_matched=2.0, cls_weight_noobj=0.5,
                focal_alpha=0.25, focal_gamma=2.0, aux_loss_weight=1.0, num_points=100_000, truth_label="instance")
    common = dict(type="detector-v4", query_type="learned", use_stuff_head=True, supervise_attn_mask=True,
                  backbone=backbone, full_in_channels=16, hidden_channels=16, num_heads=4, depth=3, mlp_ratio=4.0,
                  qkv_bias=True, qk_scale=None, attn_drop=0.0, proj_drop=0.0, drop_path=0.0, layer_scale=None,
                  pre_norm=True, enable_flash=True, upcast_attention=False, upcast_softmax=False, pos_emb=True,
                  attn_mask_anneal=False, attn_mask_anneal_steps=10000, attn_mask_warmup_steps=0,
                  attn_mask_progressive=False, attn_mask_progressive_delay=0, criteria=[loss])
    particle = MODELS.build(dict(common, labels=("particle",), num_classes=6, stuff_classes=[5], num_queries=32,
                                 mlp_point_proj=True, label_configs=dict(
                                     particle=dict(instance_key="instance_particle", segment_key="segment_pid"))))
    interaction = MODELS.build(dict(common, labels=("interaction",), num_classes=2, stuff_classes=[0],
                                    num_queries=12, label_configs=dict(interaction=dict(
                                        instance_key="instance_interaction", segment_key="segment_interaction"))))
    keys = {k for k in particle.state_dict() if k.startswith("decoder.")}
    assert {"decoder.query_feat.weight", "decoder.blocks.2.self_attn.kv.weight",
            "decoder.blocks.0.cross_attn.q_proj.weight", "decoder.blocks.1.anneal_progress",
            "decoder.full_point_proj.fc2.weight", "decoder.cls_pred_by_label.particle.fc1.weight",
            "decoder.stuff_head_by_label.particle.2.bias"} <= keys
    assert particle.decoder.query_feat.weight.shape == (32, 16)
    assert tuple(interaction.decoder.cls_pred_by_label["interaction"].weight.shape) == (3, 16)
    assert particle.label_specs["particle"].segment_fallback_key == "segment_pid"
    assert not any(k.startswith("criteria") for k in particle.state_dict())


def test_training_step_learns(reference, tmp_path):
    """The loss has gradients for the decoder and a step lowers it."""
    run = next(r for r in reference["runs"] if r["name"] == "train")
    model = _model(reference, run, tmp_path).train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(2):
        torch.manual_seed(0)
        loss = model(_input(reference, run))["loss"]
        opt.zero_grad()
        loss.backward()
        assert model.decoder.blocks[0].cross_attn.q_proj.weight.grad.abs().sum() > 0
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[1] < losses[0]


def _tiny(**overrides) -> dict:
    backbone = dict(type="PT-v3m2", in_channels=4, order=("z",), stride=(2,), enc_depths=(1, 1),
                    enc_channels=(8, 8), enc_num_head=(1, 1), enc_patch_size=(16, 16), dec_depths=(1,),
                    dec_channels=(8,), dec_num_head=(1,), dec_patch_size=(16,), enc_mode=True)
    return dict(dict(type="detector-v4", backbone=backbone, full_in_channels=16, hidden_channels=8, num_heads=2,
                     criteria=[dict(type="FastUnifiedInstanceLoss")]), **overrides)


@pytest.mark.parametrize("overrides, words", [
    (dict(overlap=True), "overlap=True"),
    (dict(query_type="fps"), "query_type"),
    (dict(eval_label="vertex"), "eval_label='vertex'"),
    (dict(labels=("particle",), query_heads=[dict(kind="continuous")]), "'name'"),
    (dict(query_heads=[dict(name="e", kind="categorical")]), "num_classes"),
    (dict(query_heads=[dict(name="pred", pred_key="pred_masks")]), "pred_masks"),
    (dict(labels=("particle", "interaction"), query_heads=[dict(name="e")]), "dict of label name"),
    (dict(labels=("ring",)), "num_classes"),
    (dict(num_heads=3), "divisible"),
    (dict(full_in_channels=20), "full_in_channels=20"),
    (dict(point_filter=dict(type="random")), "point_filter type"),
])
def test_bad_settings_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        MODELS.build(_tiny(**overrides))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_missing_truth_in_training_is_one_line(reference, tmp_path):
    run = next(r for r in reference["runs"] if r["name"] == "train")
    model = _model(reference, run, tmp_path).train()
    batch = _input(reference, run)
    batch.pop("instance_interaction")
    with pytest.raises(ConfigError, match="instance_interaction.*add them to Collect"):
        model(batch)


def test_qkv_bias_false_runs_where_upstream_crashes():
    """Upstream's default qkv_bias=False fails in its self-attention (it slices
    a missing kv bias); pimm computes the attention without biases."""
    model = MODELS.build(_tiny(labels=("particle",), num_queries=3)).eval()
    assert model.decoder.blocks[0].self_attn.kv.bias is None
    g = torch.Generator().manual_seed(0)
    grid = torch.unique(torch.randint(0, 6, (40, 3), generator=g), dim=0)[:30]
    data = dict(coord=grid.float(), grid_coord=grid.int(), offset=torch.tensor([30]),
                feat=torch.randn(30, 4, generator=g))
    out = model(data)
    assert out["pred_masks"][0].shape == (3, 30) and torch.isfinite(out["seg_logits"]).all()
    fused = model.postprocess(out, conf_threshold=0.0, mask_threshold=0.0)
    assert fused["instance_labels"].shape == (30,)


def test_pimms_panoptic_evaluator_scores_a_v4_model(reference, tmp_path):
    """InstanceSegmentationEvaluator (upstream's config hook) reads v4's
    labels and fusion: per-label detection counts over the batch."""
    from types import SimpleNamespace

    from pimm.engines.registries import HOOKS

    run = next(r for r in reference["runs"] if r["name"] == "eval")
    model = _model(reference, run, tmp_path).eval()
    batch = _input(reference, run)
    with torch.no_grad():
        out = model(batch)
    hook = HOOKS.build(dict(type="InstanceSegmentationEvaluator", every_n_steps=1000,
                            labels=("particle", "interaction"), primary_label="particle"))
    hook.trainer = SimpleNamespace(device=torch.device("cpu"), cfg={}, model=model)
    hook.reset()
    for label in ("particle", "interaction"):
        out[f"__panoptic__{label}"] = model.postprocess(out, label=label, stuff_threshold=0.8, mask_threshold=0.3)
    hook.process(batch, out)
    metrics = hook.compute(hook.accumulators())
    truth = {"particle": 16, "interaction": 4}  # the fixture's events: 8 particles and 2 interactions each
    for label, n in truth.items():
        assert metrics[f"{label}/ins_det_fn"] + metrics[f"{label}/ins_det_recall"] * n == pytest.approx(n)
        assert metrics[f"{label}/ins_det_fp"] >= 1


V4_RUN = '''
_base_ = [{base!r}]
batch_size = 2
batch_size_val = 2
num_worker = 0
epoch = 1
data = dict(train=dict(num_events=4, points_per_event=(300, 500)), val=dict(num_events=2, points_per_event=(300, 500)))
scheduler = dict(type="CosineWarmupLR", warmup_steps=1)
_loss = dict(type="FastUnifiedInstanceLoss", cost_class=1.0, loss_weight_focal=2.0, loss_weight_dice=5.0,
             cls_weight_noobj=0.5, num_points=100_000, truth_label="instance")
model = dict(
    _delete_=True, type="detector-v4", labels=("particle", "interaction"), eval_label="particle",
    label_configs=dict(particle=dict(instance_key="instance_particle", segment_key="segment_pid")),
    num_queries=dict(particle=8, interaction=4), use_stuff_head=True,
    query_heads=dict(particle=[dict(name="momentum", use_class_logits=True, sentinel=-1.0)],
                     interaction=[dict(name="vertex", dim=3, sentinel=-1.0)]),
    backbone=dict(type="PT-v3m2", in_channels=4, order=("z", "hilbert"), stride=(2,), enc_depths=(1, 1),
                  enc_channels=(8, 8), enc_num_head=(1, 1), enc_patch_size=(64, 64), mlp_ratio=2, enc_mode=True),
    full_in_channels=16, mlp_point_proj=True, hidden_channels=16, num_heads=2, depth=2, mlp_ratio=2.0,
    qkv_bias=True, criteria=[_loss], attn_mask_anneal=True, attn_mask_anneal_steps=2, min_points=2)
default_hooks = dict(information_writer=dict(log_frequency=1))
hooks = [
    dict(type="InstanceSegmentationEvaluator", every_n_steps=2, iou_thresh=0.5, labels=("particle", "interaction"),
         primary_label="particle"),
    dict(type="AttentionMaskAnnealingHook", log_frequency=1),
]
'''


@pytest.mark.slow
def test_a_v4_config_trains_and_evaluates_through_the_engine(tmp_path):
    """Upstream's v4 keyword format in a pimm config: it trains, anneals its
    attention masks and is scored by InstanceSegmentationEvaluator."""
    import json

    from tests.support.run import ROOT, run_tool

    config = tmp_path / "panseg-detector-v4.py"
    config.write_text(V4_RUN.format(base=str(ROOT / "configs" / "lartpc" / "panseg-detector.py")))
    done = run_tool("train", config, f"save_path={tmp_path / 'run'}", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["step"] for r in records if "val/particle/ins_det_f1" in r] == [2]
    assert {"train/particle_loss", "train/interaction_vertex", "train/particle_stuff_loss"} <= set().union(*records)
    factors = [r["anneal/average"] for r in records if "anneal/average" in r]
    assert factors and factors[-1] < 1.0
