"""PoLAr-MAE: the token operations against brute force, the pre-training and
segmentation models' contracts, and pre-train -> fine-tune through tools/train.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

import pimm.models  # noqa: F401  (register)
from pimm.engines.registries import MODELS
from pimm.models.polarmae.tokens import (PointGrouping, ball_query, chamfer_distance, farthest_points,
                                         packed_to_padded, padded_to_packed, suppress_overlaps)
from pimm.utils.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TOKENS = dict(num_groups=24, context_length=16, group_max_points=8, group_radius=0.15, group_upscale_points=16,
              overlap_factor=0.72)
SMALL = dict(embed_dim=32, depth=2, num_heads=4, mlp_ratio=2.0, add_pos_at_every_layer=True)


def events(sizes=(150, 260), seed=0):
    g = torch.Generator().manual_seed(seed)
    feat = torch.cat([torch.cat([torch.rand(n, 3, generator=g) - 0.5, torch.rand(n, 1, generator=g)], 1)
                      for n in sizes])
    return dict(feat=feat, offset=torch.tensor(list(itertools.accumulate(sizes))))


def test_padding_round_trip():
    batch = events((3, 5, 1))
    padded, lengths = packed_to_padded(batch["feat"], batch["offset"])
    assert padded.shape == (3, 5, 4) and lengths.tolist() == [3, 5, 1]
    assert torch.equal(padded_to_packed(padded, lengths), batch["feat"])
    assert (padded[0, 3:] == 0).all() and (padded[2, 1:] == 0).all()


def test_farthest_points_is_the_greedy_farthest_sample():
    padded, lengths = packed_to_padded(events((40, 25))["feat"], torch.tensor([40, 65]))
    idx = farthest_points(padded, lengths, 30, random_start=False)
    assert (idx[1, 25:] == -1).all()  # beyond the second event's 25 points
    for b, n in enumerate(lengths.tolist()):
        xyz, chosen = padded[b, :n, :3], [0]
        for _ in range(min(30, n) - 1):  # the textbook loop
            dist = torch.cdist(xyz, xyz[chosen]).min(1).values
            chosen.append(int(dist.argmax()))
        assert idx[b, :min(30, n)].tolist() == chosen


def test_ball_query_takes_the_first_points_inside_the_radius():
    points = torch.rand(2, 50, 3)
    centers = points[:, :6].clone()
    idx = ball_query(centers, torch.tensor([6, 4]), points, torch.tensor([50, 30]), k=5, radius=0.3)
    for b, g in itertools.product(range(2), range(6)):
        if b == 1 and g >= 4:
            assert (idx[b, g] == -1).all()  # a padding centre
            continue
        limit = 50 if b == 0 else 30
        inside = [i for i in range(limit) if torch.dist(points[b, i], centers[b, g]) < 0.3][:5]
        assert idx[b, g].tolist() == inside + [-1] * (5 - len(inside))


def test_overlap_suppression_keeps_centres_apart_and_covers_the_dropped():
    centers = torch.rand(1, 40, 3)
    kept, count = suppress_overlaps(centers, torch.tensor([40]), radius=0.1, overlap_factor=0.72, k=40)
    kept = kept[0, :int(count)]
    assert kept[0].tolist() == centers[0, 0].tolist()  # the first seed always stays
    gaps = torch.cdist(kept, kept) + torch.eye(len(kept)) * 9
    assert gaps.min() >= 2 * 0.1 * 0.72
    assert (torch.cdist(centers[0], kept).min(1).values < 2 * 0.1 * 0.72 + 1e-6).all()


def test_chamfer_distance_matches_its_definition():
    x, y = torch.rand(3, 6, 4), torch.rand(3, 6, 4)
    lengths = torch.tensor([6, 2, 4])
    want = 0.0
    for b, n in enumerate(lengths.tolist()):
        d = torch.cdist(x[b, :n], y[b, :n]) ** 2
        want += (d.min(1).values.mean() + d.min(0).values.mean()) / 3
    assert chamfer_distance(x, y, lengths).item() == pytest.approx(float(want), rel=1e-5)


def test_groups_are_local_and_masked():
    padded, lengths = packed_to_padded(events()["feat"], events()["offset"])
    out = PointGrouping(**TOKENS)(padded, lengths)
    groups, mask = out["groups"], out["point_mask"]
    assert groups.shape[:3] == mask.shape == (2, out["centers"].shape[1], 8)
    assert (groups[..., :3][mask].norm(dim=-1) <= 1.0 + 1e-5).all()  # within the radius, divided by it
    assert (mask.sum(-1) > 0).eq(out["embedding_mask"]).all()


def pretrain_model(**kw):
    return MODELS.build(dict(type="PoLAr-MAE", arch="vit_tiny", tokenizer_kwargs=TOKENS, transformer_kwargs=SMALL,
                             decoder_kwargs=dict(transformer_kwargs=dict(SMALL, depth=1)), **kw))


def test_pretraining_trains_every_part_and_reports_its_losses():
    model = pretrain_model(masking_ratio=0.5)
    weighted = pretrain_model(masking_ratio=0.5, loss_weights=dict(chamfer=0.0, energy=1.0))
    weighted.load_state_dict(model.state_dict())
    torch.manual_seed(0)  # the seeds of the tokens and the hidden tokens
    out = model(events())
    assert set(out) == {"loss", "chamfer_loss", "energy_loss", "mask_ratio", "mean_points", "mean_groups"}
    assert 0.4 <= out["mask_ratio"].item() <= 0.5  # floor(0.5 * tokens) of each event
    assert torch.isfinite(out["loss"]) and out["loss"] > 0
    assert out["loss"].item() == pytest.approx(out["chamfer_loss"].item() + out["energy_loss"].item(), rel=1e-5)
    out["loss"].backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    # the decoder's own key/value norm weights of an unused path aside, everything learns
    assert [n for n in no_grad if "norm1_kv" not in n] == []
    torch.manual_seed(0)
    assert weighted(events())["loss"].item() == pytest.approx(out["energy_loss"].item(), rel=1e-5)


def segmenter(**kw):
    cfg = dict(type="PoLArMAE-SemSeg", arch="vit_tiny", num_classes=5, tokenizer_kwargs=TOKENS,
               transformer_kwargs=SMALL, seg_head_fetch_layers=[0, 1], seg_head_dim=16, center=[0.0, 0.0, 0.0],
               scale=1.0)
    return MODELS.build({**cfg, **kw})


def test_segmentation_scores_every_point_and_loads_the_pretrained_encoder():
    batch = events()
    batch["segment"] = torch.randint(0, 6, (len(batch["feat"]),))  # 5 = out of range: ignored, as upstream
    model = segmenter(condition_global_features=True)
    out = model(batch)
    assert out["seg_logits"].shape == (410, 5) and torch.isfinite(out["loss"])
    pretrained = pretrain_model().state_dict()
    result = model.load_state_dict(pretrained, strict=False)
    encoder = [k for k in pretrained if k.startswith(("encoder.", "embedding.", "pos_embed."))]
    assert encoder and not set(encoder) & set(result.missing_keys)
    assert torch.equal(model.state_dict()["encoder.blocks.1.attn.qkv.weight"],
                       pretrained["encoder.blocks.1.attn.qkv.weight"])


def test_a_frozen_encoder_gets_no_gradient_and_keeps_its_statistics():
    model = segmenter(freeze_encoder=True).train()
    before = model.embedding.first_conv[1].running_mean.clone()
    model(events())["seg_logits"].sum().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith(("encoder.", "embedding.")))
    assert model.seg_head.conv3.weight.grad is not None
    assert torch.equal(model.embedding.first_conv[1].running_mean, before) and not model.encoder.training
    with pytest.raises(ConfigError, match="seg_head_fetch_layers"):
        segmenter(seg_head_fetch_layers=[5])


@pytest.mark.slow
def test_pretrain_then_finetune_through_tools_train(tmp_path):
    from tests.support.run import run_tool

    tiny = ["data.train.num_events=4", "batch_size=2", "num_worker=0", "model.transformer_kwargs.depth=1",
            "model.transformer_kwargs.embed_dim=32", "model.tokenizer_kwargs.num_groups=32",
            "model.tokenizer_kwargs.context_length=24"]
    pre = run_tool("train", ROOT / "configs" / "lartpc" / "pretrain-polarmae.py", f"save_path={tmp_path / 'pre'}",
                   *tiny, "model.decoder_kwargs.transformer_kwargs.depth=1",
                   "model.decoder_kwargs.transformer_kwargs.embed_dim=32")
    assert pre.returncode == 0, pre.stderr[-3000:]
    weight = tmp_path / "pre" / "model" / "model_last.pth"
    fine = run_tool("train", ROOT / "configs" / "lartpc" / "finetune-polarmae.py", f"save_path={tmp_path / 'ft'}",
                    f"weight={weight}", *tiny, "epoch=1", "eval_epoch=1", "data.val.num_events=2",
                    "model.seg_head_fetch_layers=[0]", "param_dicts=[]", "scheduler.max_lr=0.002")
    assert fine.returncode == 0, fine.stderr[-3000:]
    log = (tmp_path / "ft" / "train.log").read_text()
    assert "val/mIoU" in (tmp_path / "ft" / "metrics.jsonl").read_text()
    pre_state = torch.load(weight, weights_only=True)["state_dict"]
    assert "encoder.blocks.0.attn.qkv.weight" in pre_state and "Loaded" in log


def test_mae_evaluator_averages_the_validation_losses(tmp_path):
    """In process: a 2-step pre-training with MAEEvaluator logs upstream's
    val/loss, val/coord_loss, val/feat_loss, val/mask_ratio and selects the
    best model by neg_val_loss."""
    import json

    import pimm.cli

    pimm.cli.register_all()
    from pimm.engines.run.launch import build_trainer, load_config

    cfg, hooks = load_config(str(ROOT / "configs" / "lartpc" / "pretrain-polarmae.py"), [
        f"save_path={tmp_path / 'run'}", "data.train.num_events=4", "data.val.num_events=4", "batch_size=2", "batch_size_val=2", "num_worker=0",
         "model.transformer_kwargs.depth=1", "model.transformer_kwargs.embed_dim=32",
         "model.decoder_kwargs.transformer_kwargs.depth=1", "model.decoder_kwargs.transformer_kwargs.embed_dim=32",
         "model.tokenizer_kwargs.num_groups=32", "model.tokenizer_kwargs.context_length=24",
         "hooks.MAEEvaluator.every_n_steps=1", "hooks.MAEEvaluator.max_batches=1"], world_size=1)
    build_trainer(cfg, hooks=hooks).train()
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    val = [r for r in records if "val/loss" in r]
    assert len(val) == 2
    for r in val:
        assert r["val/neg_val_loss"] == -r["val/loss"] > -1e3
        assert r["val/loss"] == pytest.approx(r["val/coord_loss"] + r["val/feat_loss"], rel=1e-5)
        assert 0.5 <= r["val/mask_ratio"] <= 0.6
