"""Upstream's task wrappers (DefaultClassifier, DefaultSegmentorV3,
DefaultInsSegmentor) and the LoRA adapter: outputs under upstream's keys,
which parameters train, and that merging the adapters gives the plain model."""

from __future__ import annotations

import copy

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models.lora import LoRALinear
from pimm.utils.errors import ConfigError

TINY = dict(type="PT-v3m2", in_channels=4, order=("z",), stride=(2,), enc_depths=(1, 1), enc_channels=(8, 16),
            enc_num_head=(1, 2), enc_patch_size=(32, 32), dec_depths=(1,), dec_channels=(8,), dec_num_head=(1,),
            dec_patch_size=(32,), mlp_ratio=2, drop_path=0.0, shuffle_orders=False, enable_rpe=False,
            enable_flash=False, enable_cpe=True, upcast_attention=True, upcast_softmax=True, enc_mode=False)
SEGMENTOR = dict(type="DefaultSegmentorV2", num_classes=3, backbone_out_channels=8, backbone=TINY,
                 criteria=[dict(type="CrossEntropyLoss", ignore_index=-1)])


def batch(counts=(40, 30), seed=0, **extra):
    g = torch.Generator().manual_seed(seed)
    grids = [torch.randperm(16**3, generator=g)[:n] for n in counts]
    grid = torch.cat([torch.stack([c // 256, (c // 16) % 16, c % 16], 1) for c in grids])
    n = grid.shape[0]
    out = dict(grid_coord=grid, coord=grid.float() * 0.1, feat=torch.randn(n, 4, generator=g),
               offset=torch.cumsum(torch.tensor(counts), 0), segment=torch.randint(0, 3, (n,), generator=g))
    out.update(extra)
    return out


def test_classifier_pools_points_per_event_and_trains_on_category():
    torch.manual_seed(0)
    model = MODELS.build(dict(type="DefaultClassifier", backbone=TINY, num_classes=4, backbone_embed_dim=8,
                              criteria=[dict(type="CrossEntropyLoss")]))
    data = batch(category=torch.tensor([1, 3]))
    out = model(data)
    assert out["cls_logits"].shape == (2, 4) and out["loss"].ndim == 0
    out["loss"].backward()
    assert model.cls_head[0].weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        # The head sees the per-event mean of the backbone's point features.
        feat = model.backbone(batch(category=torch.tensor([1, 3])))["feat"]
        pooled = torch.stack([feat[:40].mean(0), feat[40:].mean(0)])
        expect = model.cls_head(pooled)
        test = model({k: v for k, v in batch().items() if k != "category"})
    assert set(test) == {"cls_logits"}
    torch.testing.assert_close(test["cls_logits"], expect)


def test_classifier_checks_the_embedding_width():
    with pytest.raises(ConfigError, match="backbone_embed_dim=32"):
        MODELS.build(dict(type="DefaultClassifier", backbone=TINY, num_classes=4, backbone_embed_dim=32))


class _LogitBackbone(torch.nn.Module):
    """Predicts the logits itself, as upstream's DefaultSegmentorV3 expects."""

    def __init__(self, in_channels=4, num_classes=3):
        super().__init__()
        self.head = torch.nn.Linear(in_channels, num_classes)

    def forward(self, data):
        return dict(data, pred_logits=self.head(data["feat"]))


MODELS.register_module("TestLogitBackbone", module=_LogitBackbone, force=True)


def test_segmentor_v3_reads_the_backbones_logits_and_freezes():
    model = MODELS.build(dict(type="DefaultSegmentorV3", backbone=dict(type="TestLogitBackbone"),
                              freeze_backbone=True))
    data = batch()
    out = model(data, return_point=True)
    torch.testing.assert_close(out["seg_logits"], model.backbone.head(data["feat"]))
    assert "point" in out and out["loss"].ndim == 0
    assert not any(p.requires_grad for p in model.backbone.parameters())
    model.train()
    assert not model.backbone.training
    plain = MODELS.build(dict(type="DefaultSegmentorV3", backbone=TINY))
    with pytest.raises(TypeError, match="use DefaultSegmentorV2"):
        plain(batch())


def test_ins_segmentor_trains_against_query_truth():
    torch.manual_seed(0)
    model = MODELS.build(dict(SEGMENTOR, type="DefaultInsSegmentor", imprint_weights=True))
    data = batch()
    data["query_truth"] = (data.pop("segment") + 1) % 3
    out = model(data)
    expect = torch.nn.functional.cross_entropy(out["seg_logits"], data["query_truth"])
    torch.testing.assert_close(out["loss"], expect)
    with pytest.raises(KeyError, match="query_truth"):
        model({k: v for k, v in data.items() if k != "query_truth"})


def lora_cfg(**kw):
    return dict(type="LoRAAdapter", model=SEGMENTOR, rank=2, alpha=4.0, trainable_keywords=("seg_head",), **kw)


def test_lora_starts_as_the_base_model_and_only_adapters_and_head_train():
    torch.manual_seed(0)
    base = MODELS.build(SEGMENTOR)
    adapter = MODELS.build(lora_cfg())
    adapter.model.load_state_dict(base.state_dict(), strict=False)  # same names: the base weights load as they are
    base.eval(), adapter.eval()
    data = batch()
    torch.testing.assert_close(adapter(data)["seg_logits"], base(batch())["seg_logits"])  # B = 0 at the start
    assert adapter.adapted and all(n.endswith(("attn.qkv", "attn.proj")) for n in adapter.adapted)
    adapter.train()
    adapter(batch())["loss"].backward()
    trainable = {n for n, p in adapter.named_parameters() if p.requires_grad}
    with_grad = {n for n, p in adapter.named_parameters() if p.grad is not None}
    assert trainable == with_grad
    assert all(("lora_A" in n or "lora_B" in n or "seg_head" in n) for n in trainable)
    assert any("lora_B" in n for n in trainable) and any("seg_head" in n for n in trainable)
    assert sum(adapter.get_parameter(n).numel() for n in trainable) < 0.3 * sum(
        p.numel() for p in adapter.parameters())


def test_lora_merge_equals_the_adapted_model_and_loads_into_the_plain_one():
    torch.manual_seed(1)
    adapter = MODELS.build(lora_cfg())
    opt = torch.optim.SGD([p for p in adapter.parameters() if p.requires_grad], lr=0.5)
    frozen_before = {n: p.detach().clone() for n, p in adapter.named_parameters() if not p.requires_grad}
    for _ in range(3):
        opt.zero_grad()
        adapter(batch())["loss"].backward()
        opt.step()
    for n, p in adapter.named_parameters():
        if n in frozen_before:
            assert torch.equal(p, frozen_before[n]), n  # frozen weights never move
    assert any(m.lora_B.abs().sum() > 0 for m in adapter.modules() if isinstance(m, LoRALinear))
    merged = adapter.merged_state_dict()
    assert not any("lora_" in k for k in merged)
    plain = MODELS.build(SEGMENTOR)
    plain.load_state_dict(merged, strict=True)
    adapter.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(batch(seed=3))["seg_logits"], adapter(batch(seed=3))["seg_logits"],
                                   rtol=1e-4, atol=1e-5)
    # The wrapper's own state round-trips into a fresh wrapper of the same config.
    again = MODELS.build(lora_cfg())
    again.load_state_dict(copy.deepcopy(adapter.state_dict()), strict=True)
    again.eval()
    with torch.no_grad():
        torch.testing.assert_close(again(batch(seed=3))["seg_logits"], adapter(batch(seed=3))["seg_logits"])


@pytest.mark.parametrize("kw, words", [
    (dict(target_modules=("attn.nothing",)), "no nn.Linear matches"),
    (dict(rank=0), "rank"),
    (dict(trainable_keywords=("no_such_head",)), "trainable_keywords"),
])
def test_lora_bad_arguments_are_one_line(kw, words):
    cfg = lora_cfg()
    cfg.update(kw)
    with pytest.raises(ConfigError, match=words):
        MODELS.build(cfg)


def test_lora_passes_attributes_through():
    adapter = MODELS.build(lora_cfg())
    assert adapter.num_classes == 3 and adapter.criteria is adapter.model.criteria


def test_the_shipped_lora_config_adapts_attention_and_trains_only_adapters_and_head(tmp_path):
    from pathlib import Path

    import pimm.cli
    from pimm.engines.run.launch import load_config

    pimm.cli.register_all()

    root = Path(__file__).resolve().parents[1]
    cfg, _ = load_config(str(root / "configs" / "lartpc" / "finetune-lora.py"), [f"save_path={tmp_path / 'run'}"],
                         world_size=1)
    assert cfg.model["type"] == "LoRAAdapter" and cfg.scheduler["type"] == "CosineAnnealingLR"
    model = MODELS.build(cfg.model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all("lora_" in n or "seg_head" in n for n in trainable)
    assert len(model.adapted) == 14 and all(n.endswith(("attn.qkv", "attn.proj")) for n in model.adapted)
    # The base semseg weights map onto the wrapped model's names (weight_key_map).
    plain = {k for k in MODELS.build(cfg.model["model"]).state_dict()}
    mapped = set()
    for key in plain:
        for old, new in cfg.weight_key_map:
            if key.startswith(old):
                mapped.add(new + key[len(old):])
    assert mapped == {k for k in model.state_dict() if "lora_" not in k}


def test_lora_exports_round_trip_wrapped_and_merged(tmp_path):
    """``pimm.save_pretrained`` of the adapted model reloads as the adapted model,
    and an export of ``merged_state_dict()`` reloads as the plain model; all
    three compute the same logits."""
    import pimm

    torch.manual_seed(2)
    adapter = MODELS.build(lora_cfg())
    opt = torch.optim.SGD([p for p in adapter.parameters() if p.requires_grad], lr=0.5)
    for _ in range(2):
        opt.zero_grad()
        adapter(batch())["loss"].backward()
        opt.step()
    adapter.eval()
    pimm.save_pretrained(adapter, tmp_path / "wrapped", training_config=dict(model=lora_cfg()))
    pimm.save_pretrained(adapter.merged_state_dict(), tmp_path / "merged", training_config=dict(model=SEGMENTOR))
    wrapped = pimm.from_pretrained(tmp_path / "wrapped")
    merged = pimm.from_pretrained(tmp_path / "merged")
    assert type(wrapped).__name__ == "LoRAAdapter" and type(merged).__name__ == "DefaultSegmentorV2"
    with torch.no_grad():
        expect = adapter(batch(seed=5))["seg_logits"]
        torch.testing.assert_close(wrapped(batch(seed=5))["seg_logits"], expect)
        torch.testing.assert_close(merged(batch(seed=5))["seg_logits"], expect, rtol=1e-4, atol=1e-5)
