"""Issue #45 (hardening 6), the models' part: relations that used to surface at
the first batch (or never) are refused while the config is resolved or the
model is built, one line naming the culprit; Sonata's mask token and
representation fusion mean what upstream's code makes them mean; PT-v3's
flash patch size costs what upstream's variable-length attention costs.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import pimm.cli

pimm.cli.register_all()

from pimm.datasets.collate import collate_fn  # noqa: E402
from pimm.engines.registries import HOOKS, MODELS  # noqa: E402
from pimm.engines.run.launch import load_config  # noqa: E402
from pimm.models.ptv3 import attention  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support.run import ROOT  # noqa: E402
from tests.test_ptv3 import TINY, lartpc_like_batch  # noqa: E402
from tests.test_sonata import events, tiny_sonata  # noqa: E402

CONFIGS = ROOT / "configs"


def resolve(config: str, tmp_path, *options: str, mode: str = "train"):
    """The config resolved as the command line resolves it (nothing built, nothing written)."""
    return load_config(str(CONFIGS / config), [f"save_path={tmp_path / 'run'}", *options], world_size=1, mode=mode)


# -- item 1: the model's classes and the evaluator's ------------------------------------------
def test_a_three_way_head_scored_as_two_classes_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"ClsEvaluator scores 2 classes \(its num_classes=2\) but the model "
                                          r"RingCNN predicts 3"):
        resolve("rings/cls-cnn.py", tmp_path, "model.num_classes=3")
    # the classes taken from the data section: its num_classes is named as the source
    with pytest.raises(ConfigError, match=r"scores 2 classes \(data.num_classes=2\) but the model "
                                          r"PMTGridClassifier predicts 3"):
        resolve("lucid/cls-pmt-grid.py", tmp_path, "model.num_classes=3", "hooks.0.num_classes=None",
                "hooks.0.class_names=None")
    resolve("rings/cls-cnn.py", tmp_path)  # agreeing counts pass
    # PretrainEvaluator fits a probe of its own on the data's classes: no relation to the model's head
    cfg, hooks = resolve("lartpc/pretrain-sonata.py", tmp_path)
    assert any(type(h).__name__ == "PretrainEvaluator" for h in hooks)


def test_upstreams_classifier_and_a_wrapped_segmentor_are_checked_too(tmp_path):
    """The count is read through the model's class: upstream's DefaultClassifier (default 40 classes), a
    LoRA adapter (the adapted model's), a segmentor scored by SemSegEvaluator from data.names."""
    with pytest.raises(ConfigError, match="predicts 40"):
        resolve("rings/cls-cnn.py", tmp_path, "model=dict(type='DefaultClassifier', backbone=dict(type='RingCNN'))")
    with pytest.raises(ConfigError, match=r"SemSegEvaluator scores 5 classes .* model LoRAAdapter predicts 3"):
        resolve("lartpc/finetune-lora.py", tmp_path, "model.model.num_classes=3")
    with pytest.raises(ConfigError, match=r"SemSegEvaluator scores 5 classes .* DefaultSegmentor predicts 4"):
        resolve("lartpc/semseg-sparseunet.py", tmp_path, "model.num_classes=4")


def test_instance_evaluator_classes_against_the_model(tmp_path):
    """InsSegEvaluator reads the model's seg_logits for its per-class counts: its num_classes must be the
    model's (before: a ValueError at the first validation batch)."""
    with pytest.raises(ConfigError, match=r"InsSegEvaluator scores 4 classes .* PointGroupLite predicts 5"):
        resolve("lartpc/inseg-pointgroup.py", tmp_path, "hooks=[dict(type='InsSegEvaluator', num_classes=4)]")
    resolve("lartpc/inseg-pointgroup.py", tmp_path,
            "hooks=[dict(type='InsSegEvaluator', num_classes=4, logits_key=None)]")  # no logits read: no relation


def test_panoptic_class_names_and_labels_against_the_detector(tmp_path):
    names = ["photon", "electron", "muon", "pion", "proton", "led", "extra"]
    with pytest.raises(ConfigError, match=r"class_names for 'particle' has 7 names but the model's label "
                                          r"'particle' has num_classes=6"):
        resolve("lartpc/panseg-detector.py", tmp_path, f"hooks.0.class_names={{'particle': {names!r}}}")
    with pytest.raises(ConfigError, match=r"labels=\['particle', 'vertex'\] is invalid: \['vertex'\] are not "
                                          r"labels of the model"):
        resolve("lartpc/panseg-detector.py", tmp_path, "hooks.0.labels=['particle', 'vertex']")
    # fewer names than classes is upstream's way to leave the stuff class unscored
    resolve("lartpc/panseg-detector.py", tmp_path, f"hooks.0.class_names={{'particle': {names[:5]!r}}}")


# -- item 3: Lovász binary on multiclass logits, a detector head on a missing key ------------
def test_lovasz_binary_on_multiclass_logits_is_refused_before_the_first_batch(tmp_path):
    with pytest.raises(ConfigError, match=r"model.criteria.1=.*'mode': 'binary'.* it scores 1 logit column\(s\) per "
                                          r"target and the model's logits have 5"):
        resolve("lartpc/semseg-sparseunet.py", tmp_path,
                "model.criteria=[dict(type='CrossEntropyLoss'), dict(type='LovaszLoss', mode='binary')]")
    backbone = dict(TINY, enable_flash=True, upcast_attention=False, upcast_softmax=False)
    with pytest.raises(ConfigError, match=r"criteria.0=.*binary"):  # built from Python: at build
        MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8, backbone=backbone,
                          criteria=[dict(type="LovaszLoss", mode="binary")]))
    one = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=1, backbone_out_channels=8, backbone=backbone,
                            criteria=[dict(type="LovaszLoss", mode="binary")]))
    batch = lartpc_like_batch()
    batch["segment"] = (batch["segment"] > 2).long()
    assert math.isfinite(float(one(batch)["loss"].detach()))  # one score per target: what the hinge takes
    resolve("lartpc/semseg-sparseunet.py", tmp_path, "model.criteria=[dict(type='LovaszLoss', mode='multiclass')]")


def test_a_detector_head_on_a_key_the_data_does_not_collect_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"model.label_configs.particle.query_heads.2.target_key='vertex_xyz' is "
                                          r"not a key of the training batch \(data.train.transform.6 keeps"):
        resolve("lartpc/panseg-detector.py", tmp_path,
                "+model.label_configs.particle.query_heads.2.target_key='vertex_xyz'")
    with pytest.raises(ConfigError, match=r"label_configs.interaction.instance_key='instance_vertex' is not a key"):
        resolve("lartpc/panseg-detector.py", tmp_path, "model.label_configs.interaction.instance_key='instance_vertex'")
    # a head that may be missing trains without it, as before
    resolve("lartpc/panseg-detector.py", tmp_path, "+model.label_configs.particle.query_heads.2.target_key='vtx'",
            "+model.label_configs.particle.query_heads.2.required=False")


# -- item 2: Sonata's mask token and representation fusion -----------------------------------
def test_sonata_mask_losses_need_a_mask_token(tmp_path):
    """Upstream's PT-v3 crashes on a masked batch without a mask token; pimm's trained the mask losses on
    unmasked views. Both the config and a model built from Python are refused."""
    with pytest.raises(ConfigError, match=r"model.backbone=.* is invalid: it takes a backbone that masks the "
                                          r"student's masked points .*set mask_token=True"):
        resolve("lartpc/pretrain-sonata.py", tmp_path, "model.backbone.mask_token=False")
    with pytest.raises(ConfigError, match="set mask_token=True"):
        tiny_sonata(backbone=_tiny_backbone(mask_token=False))
    with pytest.raises(ConfigError, match="PT-v3m1"):  # a backbone without any mask token
        tiny_sonata(backbone=dict(type="PT-v3m1", in_channels=4, order=("z",), stride=(2, 2), enc_depths=(1, 1, 1),
                                  enc_channels=(8, 16, 24), enc_num_head=(1, 2, 2), enc_patch_size=(32, 32, 32),
                                  cls_mode=True, enable_flash=False), head_in_channels=40)
    # only the unmask loss: no masked view, no mask token needed
    resolve("lartpc/pretrain-sonata.py", tmp_path, "model.backbone.mask_token=False", "model.mask_loss_weight=0",
            "model.roll_mask_loss_weight=0")
    tiny_sonata(backbone=_tiny_backbone(mask_token=False), mask_loss_weight=0.0, roll_mask_loss_weight=0.0)


def _tiny_backbone(**overrides):
    return dict(dict(type="PT-v3m2", in_channels=4, order=("z", "hilbert"), stride=(2, 2), enc_depths=(1, 1, 1),
                     enc_channels=(8, 16, 32), enc_num_head=(1, 2, 4), enc_patch_size=(32, 32, 32), mlp_ratio=2,
                     enc_mode=True, mask_token=True, enable_flash=False, layer_scale=1e-5, traceable=True,
                     drop_path=0.1), **overrides)


def test_representation_fusion_is_upstreams(tmp_path):
    """``representation_fusion_channels=C``: a residual MLP from the up-cast features (48 wide here) to C
    features in student and teacher, the heads on C, the probe output the fused features on the input
    points; the other four options shape it as upstream's RepresentationFusion."""
    torch.manual_seed(0)
    model = tiny_sonata(num_local_view=3, representation_fusion_channels=12)
    fusion = model.student["representation_fusion"]
    assert list(model.student) == ["backbone", "representation_fusion", "mask_head", "unmask_head"]
    assert (fusion.mlp[0].in_features, fusion.mlp[0].out_features, fusion.mlp[3].out_features) == (48, 48, 12)
    assert fusion.skip.in_features == 48 and isinstance(fusion.output_norm, torch.nn.LayerNorm)
    assert model.student["mask_head"].mlp[0].in_features == 12
    for (name, p), q in zip(fusion.named_parameters(), model.teacher["representation_fusion"].parameters()):
        assert torch.equal(p, q), name  # the teacher starts as the student
    batch = collate_fn(events(2))
    out = model(batch)
    assert all(math.isfinite(float(out[k].detach())) for k in ("mask_loss", "roll_mask_loss", "unmask_loss"))
    out["loss"].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in fusion.parameters())
    teacher = model.teacher["representation_fusion"]
    before = teacher.mlp[0].weight.detach().clone()
    with torch.no_grad():
        fusion.mlp[0].weight.add_(1.0)
    model.update_teacher(momentum=0.5)  # the EMA covers the fusion
    torch.testing.assert_close(teacher.mlp[0].weight, before + 0.5)
    probe_in = dict(feat=batch["global_feat"], coord=batch["global_coord"], offset=batch["global_offset"],
                    grid_size=batch["grid_size"])
    model.eval()
    point = model(probe_in, return_point=True)["point"]
    assert point["feat"].shape == (len(batch["global_feat"]), 12)  # every input point, fused width
    plain = tiny_sonata(num_local_view=3).eval()(probe_in, return_point=True)["point"]
    assert plain["feat"].shape[1] == 48  # without fusion: the up-cast features, as before
    # the online probe reads the fused features too (upstream's PretrainEvaluator does)
    probe = HOOKS.build(dict(type="PretrainEvaluator"))
    probe.trainer = SimpleNamespace(model_without_ddp=model)
    module, encode = probe.encoder()
    assert module is model.teacher
    torch.testing.assert_close(encode(probe_in), point["feat"])

    narrow = tiny_sonata(num_local_view=3, representation_fusion_channels=12,
                         representation_fusion_hidden_channels=20, representation_fusion_dropout=0.5,
                         representation_fusion_residual=False, representation_fusion_output_norm=False)
    fusion = narrow.student["representation_fusion"]
    assert fusion.mlp[0].out_features == 20 and fusion.mlp[2].p == 0.5 and fusion.skip is None
    assert isinstance(fusion.output_norm, torch.nn.Identity)
    zero = tiny_sonata(num_local_view=3, representation_fusion_channels=12, representation_fusion_hidden_channels=0)
    assert zero.student["representation_fusion"].mlp[0].out_features == 48  # upstream: 0 is falsy, the default
    # the config path: upstream's keys are arguments with domains
    resolve("lartpc/pretrain-sonata.py", tmp_path, "model.representation_fusion_channels=64",
            "model.representation_fusion_residual=False", "model.representation_fusion_hidden_channels=0")
    with pytest.raises(ConfigError, match=r"model.representation_fusion_dropout=1.5 is invalid"):
        resolve("lartpc/pretrain-sonata.py", tmp_path, "model.representation_fusion_channels=64",
                "model.representation_fusion_dropout=1.5")


# -- item 4: a flash patch size beyond every event --------------------------------------------
def test_a_flash_patch_longer_than_every_event_costs_only_the_events(monkeypatch):
    """enable_flash=True, enc_patch_size=100000 on events of 300 and 180 points: every attention call is
    over at most the longest event (before: 100000 slots per event, 376 s a step at real sizes), and the
    output is that of a patch size equal to the longest event (the same keys, the same softmax)."""
    seen = []
    sdpa = attention.F.scaled_dot_product_attention

    def record(q, k, v, **kw):
        seen.append(q.shape[-2])
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", record)
    batch = lartpc_like_batch()
    outputs = []
    for patch in (100000, 300):
        cfg = dict(TINY, enable_flash=True, upcast_attention=False, upcast_softmax=False,
                   enc_patch_size=(patch, patch), dec_patch_size=(patch,))
        torch.manual_seed(0)
        model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8,
                                  backbone=cfg)).eval()
        with torch.no_grad():
            outputs.append(model({k: v.clone() for k, v in batch.items()})["seg_logits"])
    assert seen and max(seen) <= 300
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)


# -- item 5: edge values upstream's code gives a meaning to -----------------------------------
def test_edge_values_upstream_gives_a_meaning(tmp_path):
    """PT-v3 patch size -1 (upstream's whole-event flash path; refused with enable_flash=False, as
    upstream's non-flash path cannot take it) and DefaultSegmentorV2's num_classes=0 (upstream's
    identity head: the backbone's features are the logits; an MLP head needs classes)."""
    resolve("lartpc/semseg-ptv3.py", tmp_path, "model.backbone.enable_flash=True",
            "model.backbone.enc_patch_size=[-1, -1, -1, -1]")
    with pytest.raises(ConfigError, match=r"model.backbone.enable_flash=False is invalid: it takes True when a "
                                          r"patch size is -1"):
        resolve("lartpc/semseg-ptv3.py", tmp_path, "model.backbone.enable_flash=False",
                "model.backbone.enc_patch_size=[-1, 64, 64, 64]")
    with pytest.raises(ConfigError, match=r"enc_patch_size=.* is invalid"):
        resolve("lartpc/semseg-ptv3.py", tmp_path, "model.backbone.enc_patch_size=[0, 64, 64, 64]")
    with pytest.raises(ConfigError, match=r"model.num_classes=0 is invalid: it takes a positive number of classes "
                                          r"with mlp_head=True"):
        resolve("lartpc/semseg-ptv3.py", tmp_path, "model.num_classes=0", "model.mlp_head=True", "hooks=[]")
    backbone = dict(TINY, enable_flash=True, upcast_attention=False, upcast_softmax=False)
    identity = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=0, backbone_out_channels=8,
                                 backbone=backbone))
    assert isinstance(identity.seg_head, torch.nn.Identity)
    # its logits are the 8 features: an evaluator of 5 classes is refused, one of 8 passes
    with pytest.raises(ConfigError, match="predicts 16"):
        resolve("lartpc/semseg-ptv3.py", tmp_path, "model.num_classes=0")
    resolve("lartpc/semseg-ptv3.py", tmp_path, "model.num_classes=0", "hooks=[]")
