"""Sonata-v1m1 pieces on tiny inputs: the schedules (against upstream's
precomputed cosine table, rebuilt here with numpy), the EMA teacher, the
Sinkhorn targets, the matching, the distillation loss by hand, and the
multi-view transforms and collate."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pimm.datasets  # noqa: F401  (registers the transforms)
import pimm.models  # noqa: F401  (registers the models)
from pimm.datasets.collate import collate_fn
from pimm.engines.registries import MODELS, TRANSFORMS
from pimm.models.ptv3.structure import Point
from pimm.models.sonata.matching import match_nearest, mean_per_segment, patch_mask, sinkhorn_knopp
from pimm.models.sonata.schedules import cosine_value
from pimm.utils.errors import ConfigError, UserError

GRID = 0.001


def upstream_table(base, final, total, start=0.0, warmup=0):
    """Upstream's CosineScheduler table: linspace warm-up, then a half cosine."""
    ramp = np.linspace(start, base, warmup)
    iters = np.arange(total - warmup)
    return np.concatenate([ramp, final + 0.5 * (base - final) * (1 + np.cos(np.pi * iters / len(iters)))])


@pytest.mark.parametrize("start,base,final,total,warmup", [(0.01, 0.075, 0.075, 100, 5), (0.5, 0.9, 0.9, 37, 1),
                                                           (0.994, 0.994, 1.0, 50, 0), (0.0, 0.0, 0.01, 40, 2)])
def test_cosine_value_matches_upstream_table(start, base, final, total, warmup):
    table = upstream_table(base, final, total, start, warmup)
    ours = [cosine_value(i, total, base, final, start, warmup) for i in range(total)]
    np.testing.assert_allclose(ours, table, rtol=0, atol=1e-12)
    assert cosine_value(total, total, base, final, start, warmup) == final  # past the end: final
    assert cosine_value(total + 7, total, base, final, start, warmup) == final


def tiny_sonata(**overrides):
    cfg = dict(type="Sonata-v1m1",
               backbone=dict(type="PT-v3m2", in_channels=4, order=("z", "hilbert"), stride=(2, 2),
                             enc_depths=(1, 1, 1), enc_channels=(8, 16, 32), enc_num_head=(1, 2, 4),
                             enc_patch_size=(32, 32, 32), mlp_ratio=2, enc_mode=True, mask_token=True,
                             enable_flash=False, layer_scale=1e-5, traceable=True, drop_path=0.1),
               teacher_custom=dict(drop_path=0.0), head_in_channels=48, head_hidden_channels=32,
               head_embed_channels=16, head_num_prototypes=24, num_global_view=2, num_local_view=2,
               mask_size_start=0.01, mask_size_base=0.075, mask_size_warmup_ratio=0.1, mask_ratio_start=0.5,
               mask_ratio_base=0.9, mask_ratio_warmup_ratio=0.1, mask_jitter=GRID / 2, teacher_temp_start=0.04,
               teacher_temp_base=0.07, teacher_temp_warmup_ratio=0.1, student_temp=0.1, momentum_base=0.994,
               momentum_final=1.0, match_max_r=2 * GRID, up_cast_level=1)
    cfg.update(overrides)
    return MODELS.build(cfg)


def test_schedules_follow_the_step():
    torch.manual_seed(0)
    model = tiny_sonata()
    assert (model.mask_size, model.mask_ratio, model.teacher_temp, model.momentum) == (0.01, 0.5, 0.04, 0.994)
    total = 100  # warm-up ratio 0.1: 10 steps
    values = model.set_step(9, total)
    assert values["mask_size"] == pytest.approx(0.075) and values["mask_ratio"] == pytest.approx(0.9)
    assert values["teacher_temp"] == pytest.approx(0.07)
    assert model.set_step(4, total)["mask_ratio"] == pytest.approx(0.5 + 0.4 * 4 / 9)
    assert model.set_step(50, total)["momentum"] == pytest.approx(1.0 - 0.5 * 0.006 * (1 + math.cos(math.pi * 0.5)))
    assert model.set_step(100, total)["momentum"] == 1.0
    assert model.mask_jitter == GRID / 2  # a fixed jitter is not scheduled
    scheduled = tiny_sonata(mask_jitter=None, mask_jitter_start=0.0, mask_jitter_base=0.01,
                            mask_jitter_warmup_ratio=0.1)
    assert scheduled.set_step(5, total)["mask_jitter"] == 0.0  # held at start through the warm-up
    assert scheduled.set_step(55, total)["mask_jitter"] == pytest.approx(0.005)


def test_teacher_is_an_ema_of_the_student():
    torch.manual_seed(0)
    model = tiny_sonata()
    for (name, t), (_, s) in zip(model.teacher.named_parameters(), model.student.named_parameters()):
        assert torch.equal(t, s), name  # starts as a copy
        assert not t.requires_grad
    before = {k: v.clone() for k, v in model.teacher.state_dict().items()}
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(1.0)
    model.momentum = 0.9
    model.update_teacher()
    after, student = model.teacher.state_dict(), model.student.state_dict()
    for key in before:
        torch.testing.assert_close(after[key], 0.9 * before[key] + 0.1 * student[key])


def test_sinkhorn_balances_prototypes():
    torch.manual_seed(0)
    logits = F.normalize(torch.randn(200, 3), dim=1) @ F.normalize(torch.randn(8, 3), dim=1).t()  # cosines
    q = sinkhorn_knopp(logits, 0.07)
    torch.testing.assert_close(q.sum(1), torch.ones(200))  # each point: a distribution over prototypes
    plain = torch.softmax(logits / 0.07, dim=1).sum(0)
    assert q.sum(0).std() < 0.5 * plain.std()  # prototypes used more evenly than a plain softmax
    ref = np.exp(logits.double().numpy() / 0.07)  # the textbook iteration, in float64
    ref /= ref.sum()
    for _ in range(3):
        ref /= ref.sum(0, keepdims=True) * 8  # each prototype: mass 1/K
        ref /= ref.sum(1, keepdims=True) * 200  # each point: mass 1/N
    np.testing.assert_allclose(q.numpy(), ref * 200, rtol=1e-4, atol=1e-6)
    extreme = torch.where(torch.rand(50, 8) < 0.5, 1.0, -1.0)  # cosine bounds at the coldest temperature
    assert torch.isfinite(sinkhorn_knopp(extreme * 40, 0.04)).all()  # exp(1000) without the shift


def test_match_nearest_within_radius_and_segment():
    gen = torch.Generator().manual_seed(1)
    query, target = torch.rand(30, 3, generator=gen), torch.rand(40, 3, generator=gen)
    q_off, t_off = torch.tensor([12, 30]), torch.tensor([25, 40])
    pairs = match_nearest(query, q_off, target, t_off, 0.2)
    expect = []
    for (qs, qe), (ts, te) in (((0, 12), (0, 25)), ((12, 30), (25, 40))):
        for i in range(qs, qe):
            d = (target[ts:te] - query[i]).norm(dim=1)
            if d.min() < 0.2:
                expect.append([i, int(d.argmin()) + ts])
    assert pairs.tolist() == expect and 0 < len(expect) < 30


def test_patch_mask_masks_whole_patches_at_the_ratio():
    coord = torch.rand(400, 3)
    batch = torch.cat([torch.zeros(200), torch.ones(200)]).long()
    mask, patch = patch_mask(coord, batch, 0.25, 0.5)
    patches = int(patch.max()) + 1
    masked = torch.unique(patch[mask])
    assert len(masked) == int(patches * 0.5)
    for p in range(patches):  # all or nothing within a patch, never across events
        assert mask[patch == p].all() or not mask[patch == p].any()
        assert len(torch.unique(batch[patch == p])) == 1


def test_distillation_loss_by_hand():
    """Two query views, one point each matched; the loss is the per-view
    cross-entropy to the Sinkhorn target of the matched teacher point."""
    model = tiny_sonata()
    model.teacher_temp, model.student_temp = 0.05, 0.1
    pred = torch.randn(3, 24, requires_grad=True)
    query = Point(origin_coord=torch.tensor([[0.0, 0, 0], [5, 5, 5], [9, 9, 9]]), offset=torch.tensor([2, 3]))
    target_origin = torch.tensor([[0.0, 0, 0.0005], [9, 9, 9.001]])
    target_logits = torch.randn(2, 24)
    loss = model._distill(pred, query, target_logits, target_origin, torch.tensor([1, 2]))
    # query 0 <-> target 0 (view 0), query 2 <-> target 1 (view 1); query 1 is far from everything
    q = sinkhorn_knopp(target_logits, 0.05)
    ce = [-(q[i] * F.log_softmax(pred[j] / 0.1, dim=-1)).sum() for i, j in ((0, 0), (1, 2))]
    torch.testing.assert_close(loss, (ce[0] + ce[1]) / 2)
    loss.backward()
    assert pred.grad[1].abs().sum() == 0 and pred.grad[0].abs().sum() > 0
    assert float(mean_per_segment(torch.tensor([1.0, 3.0]), torch.tensor([0, 2]))) == pytest.approx(4 / 3)


UPSTREAM_VIEWS = [
    dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3**0.5 / 2),
    dict(type="GridSample", grid_size=GRID, hash_type="fnv", mode="train", sum_keys=("energy",)),
    dict(type="LogTransform", min_val=0.01, max_val=20.0, log=True, keys=("energy",)),
    dict(type="Copy", keys_dict={"coord": "origin_coord"}),
    dict(type="MultiViewGenerator", view_keys=("coord", "origin_coord", "energy"), global_view_num=2,
         global_view_scale=(0.4, 1.0), local_view_num=3, local_view_scale=(0.1, 0.4),
         global_shared_transform=[dict(type="MultiplicativeRandomJitter", sigma=0.05, clip=0.05, keys=("energy"),
                                       p=0.8)],
         global_transform=[dict(type="CenterShift", apply_z=False, axes=("x", "y", "z")),
                           dict(type="RandomRotate", angle=[-1, 1], axis="z", center=[0, 0, 0], p=0.8),
                           dict(type="RandomFlip", p=0.5, axes=("x", "y", "z")),
                           dict(type="RandomJitter", sigma=GRID / 4, clip=GRID, keys=("coord",))],
         local_transform=[dict(type="CenterShift", apply_z=False, axes=("x", "y", "z"))],
         max_size=30000),
    dict(type="ToTensor"),
    dict(type="Update", keys_dict={"grid_size": GRID}),
    dict(type="Collect", keys=("global_origin_coord", "global_coord", "global_energy", "global_offset",
                               "local_origin_coord", "local_coord", "local_energy", "local_offset", "grid_size",
                               "name"),
         offset_keys_dict=dict(), global_feat_keys=("global_coord", "global_energy"),
         local_feat_keys=("local_coord", "local_energy")),
]


def events(n=2, seed=0):
    from pimm.engines.registries import DATASETS

    ds = DATASETS.build(dict(type="LArTPCSynthDataset", num_events=n, seed=seed, split="train",
                             transform=UPSTREAM_VIEWS, points_per_event=(300, 500)))
    np.random.seed(seed)
    return [ds[i] for i in range(n)]


def test_multiview_generator_crops():
    rng = np.random.default_rng(0)
    coord = rng.random((500, 3)).astype(np.float32)
    data = dict(coord=coord, origin_coord=coord.copy(), energy=rng.random((500, 1)).astype(np.float32))
    gen = TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord", "origin_coord", "energy"),
                                global_view_num=2, global_view_scale=(0.4, 1.0), local_view_num=4,
                                local_view_scale=(0.1, 0.2), max_size=300))
    np.random.seed(3)
    out = gen(data)
    g_counts = np.diff(out["global_offset"], prepend=0)
    l_counts = np.diff(out["local_offset"], prepend=0)
    assert len(g_counts) == 2 and len(l_counts) == 4
    assert all(120 <= c <= 300 for c in g_counts) and all(30 <= c <= 60 for c in l_counts)  # of max_size=300
    assert out["global_coord"].shape == (g_counts.sum(), 3) and out["local_energy"].shape == (l_counts.sum(), 1)
    # a crop is the points nearest its centre
    center = coord[7]
    view, index = gen._crop(data, center, (0.5, 0.5))
    dist = np.square(coord - center).sum(-1)
    assert len(index) == 150 and dist[index].max() <= np.delete(dist, index).min()
    np.testing.assert_array_equal(view["energy"], data["energy"][index])
    # local crops are centred inside the first global crop: each shares points with it
    first = {tuple(p) for p in out["global_origin_coord"][: out["global_offset"][0]]}
    for start, end in zip(np.r_[0, out["local_offset"][:-1]], out["local_offset"]):
        assert first & {tuple(p) for p in out["local_origin_coord"][start:end]}
    with pytest.raises(UserError, match="view_keys"):
        TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("energy",)))
    with pytest.raises(UserError, match=r"no \['normal'\]"):
        TRANSFORMS.build(dict(type="MultiViewGenerator", view_keys=("coord", "normal")))(data)


def test_upstream_view_pipeline_collates_and_trains_a_step():
    batch = collate_fn(events(2))
    assert "offset" not in batch
    g, loc = batch["global_offset"], batch["local_offset"]
    assert len(g) == 4 and len(loc) == 6 and g[-1] == len(batch["global_feat"]) and loc[-1] == len(batch["local_feat"])
    assert batch["global_feat"].shape[1] == 4 and torch.equal(batch["global_feat"][:, :3], batch["global_coord"])
    torch.manual_seed(0)
    model = tiny_sonata(num_local_view=3)
    out = model(batch)
    assert {"mask_loss", "roll_mask_loss", "unmask_loss", "loss"} <= set(out)
    weights = dict(mask_loss=0.25, roll_mask_loss=0.25, unmask_loss=0.5)
    torch.testing.assert_close(out["loss"], sum(out[k] * w for k, w in weights.items()))
    assert all(math.isfinite(float(out[k].detach())) for k in weights)
    out["loss"].backward()
    assert all(p.grad is not None for p in model.student.parameters() if p.requires_grad)
    assert all(p.grad is None for p in model.teacher.parameters())
    with pytest.raises(ConfigError, match="local views"):
        tiny_sonata(num_local_view=2)(batch)


def test_loss_weights_drop_heads_and_bad_widths_are_one_line():
    model = tiny_sonata(unmask_loss_weight=0.0)
    assert set(model.student) == {"backbone", "mask_head"}
    with pytest.raises(ConfigError, match="set head_in_channels=48"):
        tiny_sonata(head_in_channels=1088)
    with pytest.raises(ConfigError, match="up_cast_level=3 must be in 0..2"):
        tiny_sonata(up_cast_level=3)
    with pytest.raises(ConfigError, match="needs num_global_view=2"):
        tiny_sonata(num_global_view=1)


def test_multiplicative_jitter_and_center_shift():
    energy = np.full((1000, 1), 2.0, dtype=np.float32)
    np.random.seed(0)
    out = TRANSFORMS.build(dict(type="MultiplicativeRandomJitter", sigma=0.05, clip=0.05, keys="energy", p=1.0))(
        dict(energy=energy))
    assert np.all(np.abs(out["energy"] / 2.0 - 1) <= 0.05 + 1e-6) and out["energy"].std() > 0.01
    coord = np.array([[0.0, 2, 4], [10, 6, 12]], dtype=np.float32)
    shifted = TRANSFORMS.build(dict(type="CenterShift", apply_z=False, axes=("x", "y", "z")))(dict(coord=coord))
    np.testing.assert_allclose(shifted["coord"], [[-5, -2, -4], [5, 2, 4]])
    assert coord[0, 0] == 0.0  # the input is not modified


def test_training_without_model_hook_is_refused():
    """Without ModelHook the teacher would silently stay at its initial weights."""
    batch = collate_fn(events(1))
    model = tiny_sonata(num_local_view=3)
    model._forwards_since_update = 64
    with pytest.raises(ConfigError, match="list dict\\(type='ModelHook'\\) in hooks"):
        model(batch)
    model.update_teacher()
    with torch.no_grad():
        model(batch)  # an evaluation pass does not count
    assert model._forwards_since_update == 0
