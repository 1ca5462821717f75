"""Point Transformer V3 (pimm.models.ptv3): serialization, patch attention,
pooling, the CPE convolution, determinism, option errors and the
segmentor, each against a slow or dense reference."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models.ptv3 import attention as attention_module
from pimm.models.ptv3.attention import SerializedAttention, patch_layout
from pimm.models.ptv3.blocks import SubMConv3d
from pimm.models.ptv3.pooling import GridPooling, GridUnpooling, SerializedPooling
from pimm.models.ptv3.serialization import encode, hilbert_encode, serialize, z_order_encode
from pimm.models.ptv3.structure import Point
from pimm.utils.errors import ConfigError

TINY = dict(type="PT-v3m2", in_channels=4, order=("z",), stride=(2,), enc_depths=(1, 1), enc_channels=(8, 16),
            enc_num_head=(1, 2), enc_patch_size=(32, 32), dec_depths=(1,), dec_channels=(8,), dec_num_head=(1,),
            dec_patch_size=(32,), mlp_ratio=2, drop_path=0.0, shuffle_orders=False, enable_rpe=False,
            enable_flash=False, enable_cpe=True, upcast_attention=True, upcast_softmax=True, enc_mode=False)


def distinct_points(counts, span=24, seed=0):
    """Events of distinct random voxels: (grid, batch, offset)."""
    g = torch.Generator().manual_seed(seed)
    grids, batches = [], []
    for b, n in enumerate(counts):
        cells = torch.randperm(span**3, generator=g)[:n]
        grids.append(torch.stack([cells // span**2, (cells // span) % span, cells % span], 1))
        batches.append(torch.full((n,), b))
    return torch.cat(grids), torch.cat(batches), torch.cumsum(torch.tensor(counts), 0)


def make_point(counts, channels=8, span=24, seed=0, order=("z", "hilbert")):
    grid, batch, offset = distinct_points(counts, span, seed)
    feat = torch.randn(grid.shape[0], channels, generator=torch.Generator().manual_seed(seed + 1))
    point = Point(feat=feat, grid_coord=grid, coord=grid.float() + 0.5, offset=offset)
    point.serialization(order=order)
    return point


# ----------------------------------------------------------------- serialization

def test_z_order_interleaves_bits_x_highest():
    grid = torch.randint(0, 64, (500, 3))
    expect = torch.zeros(500, dtype=torch.long)
    for i in range(6):
        for axis, shift in ((0, 2), (1, 1), (2, 0)):
            expect |= ((grid[:, axis] >> i) & 1) << (3 * i + shift)
    assert torch.equal(z_order_encode(grid, 6), expect)


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
def test_hilbert_walks_the_cube_one_face_step_at_a_time(depth):
    side = 2**depth
    grid = torch.cartesian_prod(*[torch.arange(side)] * 3)
    code = hilbert_encode(grid, depth)
    assert torch.equal(torch.sort(code)[0], torch.arange(side**3))  # a bijection onto 0..side^3-1
    walk = grid[torch.argsort(code)]
    assert bool(((walk[1:] - walk[:-1]).abs().sum(1) == 1).all())  # consecutive codes are face neighbours
    assert torch.equal(walk[0], torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("order", ["z", "hilbert"])
def test_codes_are_hierarchical_and_trans_swaps_x_and_y(order):
    grid = torch.randint(0, 256, (400, 3))
    code = encode(grid, None, 8, order)
    assert torch.equal(code >> 3, encode(grid // 2, None, 7, order))  # parent voxel = code >> 3
    assert torch.equal(encode(grid, None, 8, order + "-trans"), encode(grid[:, [1, 0, 2]], None, 8, order))


def test_serialize_orders_inverts_and_ignores_input_permutation():
    grid, batch, _ = distinct_points([50, 80, 30])
    orders = ("z", "z-trans", "hilbert", "hilbert-trans")
    code, order, inverse, depth = serialize(grid, batch, orders)
    assert depth == 5  # coordinates up to 23
    n = grid.shape[0]
    for i in range(len(orders)):
        assert torch.equal(order[i][inverse[i]], torch.arange(n))
        assert torch.equal(inverse[i][order[i]], torch.arange(n))
        assert bool((code[i][order[i]].diff() > 0).all())  # sorted, distinct
        assert torch.equal(batch[order[i]], torch.sort(batch)[0])  # events never interleave
    perm = torch.randperm(n)
    code_p, order_p, _, _ = serialize(grid[perm], batch[perm], orders)
    assert torch.equal(code_p, code[:, perm])
    for i in range(len(orders)):
        assert torch.equal(grid[perm][order_p[i]], grid[order[i]])  # the same curve walk


def test_unknown_order_is_a_config_error():
    with pytest.raises(ConfigError, match="order='x'"):
        encode(torch.zeros(1, 3, dtype=torch.long), None, 1, "x")


# ----------------------------------------------------------------- patches and attention

@pytest.mark.parametrize("counts,k", [([5, 40, 64, 65, 1], 16), ([32, 33, 100], 32), ([7], 8), ([48, 96], 48)])
def test_patch_padding_round_trip(counts, k):
    counts_t = torch.tensor(counts)
    pad, unpad, key_mask = patch_layout(counts_t, k)
    assert pad.numel() % k == 0
    x = torch.randn(sum(counts), 3)
    assert torch.equal(x[pad][unpad], x)  # every point comes back from its own slot
    start = torch.cumsum(counts_t, 0) - counts_t
    event_of = torch.repeat_interleave(torch.arange(len(counts)), counts_t)
    patches = event_of[pad].view(-1, k)
    assert bool((patches == patches[:, :1]).all())  # a patch never mixes events
    assert (key_mask is None) == all(c >= k for c in counts)
    for p in range(patches.shape[0]):
        b = int(patches[p, 0])
        real = pad.view(-1, k)[p] - start[b]
        if counts[b] < k:  # one masked patch
            assert key_mask[p].sum() == counts[b]
            assert torch.equal(real[key_mask[p]], torch.arange(counts[b]))
        elif key_mask is not None:
            assert bool(key_mask[p].all())
    # events >= k: full patches, the last one topped up from the patch before it
    for b, n in enumerate(counts):
        if n >= k:
            slots = pad[(event_of[pad] == b)] - start[b]
            assert slots.numel() == -(-n // k) * k
            assert torch.equal(slots[:n], torch.arange(n))
            assert torch.equal(slots[n:], torch.arange(n, slots.numel()) - k)


def reference_attention(attn: SerializedAttention, point: Point, k: int) -> torch.Tensor:
    """Upstream's arithmetic, one patch at a time with an explicit softmax."""
    h, c = attn.num_heads, attn.channels
    order = point["serialized_order"][attn.order_index]
    qkv = attn.qkv(point["feat"])
    out = torch.zeros_like(point["feat"])
    offsets = [0] + point["offset"].tolist()
    for b in range(len(offsets) - 1):
        seq = order[offsets[b]:offsets[b + 1]]  # this event, in curve order
        n = seq.numel()
        if n <= k:
            patches = [list(range(n))]
        else:
            m = -(-n // k) * k
            idx = [i if i < n else i - k for i in range(m)]
            patches = [idx[j:j + k] for j in range(0, m, k)]
        done = set()
        for patch in patches:
            rows = seq[torch.tensor(patch)]
            q, key, v = qkv[rows].view(len(patch), 3, h, c // h).permute(1, 2, 0, 3)
            w = torch.softmax(q @ key.transpose(-1, -2) * attn.scale, -1)
            o = (w @ v).transpose(0, 1).reshape(len(patch), c)
            for slot, row in zip(patch, rows.tolist()):
                if slot not in done:  # a point's output comes from its first slot
                    out[row] = o[patch.index(slot)]
                    done.add(slot)
    return attn.proj(out)


@pytest.mark.parametrize("flash", [True, False])
def test_patch_attention_matches_per_patch_reference_without_n_by_n(flash, monkeypatch):
    torch.manual_seed(0)
    counts = [40, 7, 100] if flash else [40, 23, 100]
    point = make_point(counts)
    attn = SerializedAttention(8, 2, 16, order_index=1, enable_flash=flash, upcast_attention=not flash,
                               upcast_softmax=not flash)
    shapes = []
    real_sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        shapes.append(tuple(q.shape))
        return real_sdpa(q, k, v, **kw)

    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", recording)
    with torch.no_grad():
        got = attn(point)
    k = 16
    assert all(s[2] == k for s in shapes)  # (patches, heads, K, dim): never N x N
    expect = reference_attention(attn, point, k)
    torch.testing.assert_close(got, expect.detach(), atol=1e-5, rtol=1e-5)


def test_non_flash_patch_shrinks_to_the_shortest_event():
    point = make_point([9, 50])
    attn = SerializedAttention(8, 2, 16, enable_flash=False)
    counts = torch.diff(point["offset"], prepend=torch.zeros(1, dtype=torch.long))
    assert attn._patch_size(counts) == 9
    with torch.no_grad():
        torch.testing.assert_close(attn(point), reference_attention(attn, point, 9), atol=1e-5, rtol=1e-5)


def test_rpe_bias_matches_its_table():
    point = make_point([20, 20])
    attn = SerializedAttention(8, 2, 8, enable_rpe=True, enable_flash=False)
    rel = torch.tensor([[[[0, 0, 0], [1, -2, 30]]]])
    bias = attn.rpe(rel)  # (1, H, 1, 2)
    table, bnd, num = attn.rpe.rpe_table, attn.rpe.pos_bnd, attn.rpe.rpe_num
    expect = table[1 + bnd] + table[num - 2 + bnd] + table[2 * num + bnd + bnd]  # 30 clamps to bnd
    torch.testing.assert_close(bias[0, :, 0, 1], expect)
    assert attn(point).shape == (40, 8)


# ----------------------------------------------------------------- convolution

def test_cpe_conv_equals_dense_conv3d_on_the_occupied_voxels():
    torch.manual_seed(0)
    grid, batch, offset = distinct_points([60], span=6)
    conv = SubMConv3d(3, 5, kernel_size=3, bias=True)
    torch.nn.init.normal_(conv.bias)
    feat = torch.randn(grid.shape[0], 3)
    point = Point(feat=feat, grid_coord=grid, offset=offset)
    got = point.sparse_conv(conv, feat)
    dense = torch.zeros(1, 3, 6, 6, 6)
    dense[0, :, grid[:, 0], grid[:, 1], grid[:, 2]] = feat.t()
    # spconv's (C_out, kx, ky, kz, C_in) is conv3d's (C_out, C_in, kx, ky, kz) permuted
    out = F.conv3d(dense, conv.weight.permute(0, 4, 1, 2, 3), conv.bias, padding=1)
    torch.testing.assert_close(got, out[0, :, grid[:, 0], grid[:, 1], grid[:, 2]].t(), atol=1e-5, rtol=1e-5)


def test_shared_voxels_are_averaged_into_the_convolution():
    grid = torch.tensor([[0, 0, 0], [0, 0, 0], [0, 0, 1]])
    feat = torch.tensor([[1.0], [3.0], [10.0]])
    conv = SubMConv3d(1, 1, 3, bias=False)
    torch.nn.init.ones_(conv.weight)
    out = Point(feat=feat, grid_coord=grid, offset=torch.tensor([3])).sparse_conv(conv, feat)
    assert out.view(-1).tolist() == [12.0, 12.0, 12.0]  # mean(1, 3) + 10 at both voxels


# ----------------------------------------------------------------- pooling

def slow_pool(feat, keys):
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    return {key: feat[idx].max(0).values for key, idx in groups.items()}


@pytest.mark.parametrize("cls,stride", [(GridPooling, 2), (GridPooling, 3), (SerializedPooling, 2),
                                        (SerializedPooling, 4)])
def test_pooling_and_unpooling_match_a_slow_reference(cls, stride):
    torch.manual_seed(0)
    point = make_point([70, 130], order=("hilbert", "z"))
    grid, batch = point["grid_coord"].clone(), point["batch"].clone()
    feat = point["feat"].clone()
    pool = cls(8, 6, stride=stride, norm_layer=torch.nn.LayerNorm, act_layer=torch.nn.GELU, shuffle_orders=False)
    coarse = pool(point)
    proj = pool.proj(feat).detach()
    keys = [(int(b), *(g // stride).tolist()) for b, g in zip(batch, grid)]
    expect = slow_pool(proj, keys)
    got_keys = [(int(b), *g.tolist()) for b, g in zip(coarse["batch"], coarse["grid_coord"])]
    assert sorted(got_keys) == sorted(expect) and len(set(got_keys)) == len(got_keys)
    raw = torch.zeros(len(got_keys), 6)
    for i, key in enumerate(got_keys):
        raw[i] = expect[key]
    # pooled = GELU(LayerNorm(max of the projected children))
    torch.testing.assert_close(coarse["feat"], F.gelu(pool.norm[0](raw)), atol=1e-5, rtol=1e-5)
    inverse = coarse["pooling_inverse"]
    assert [got_keys[i] for i in inverse.tolist()] == keys  # every child knows its parent
    # The coarse level is serialized: each order sorts its points along the curve.
    depth = coarse["serialized_depth"]
    for i, name in enumerate(coarse["order"]):
        code = encode(coarse["grid_coord"], coarse["batch"], depth, name)
        if cls is GridPooling:
            assert torch.equal(coarse["serialized_code"][i], code)
        assert bool((coarse["serialized_code"][i][coarse["serialized_order"][i]].diff() > 0).all())
    # un-pooling: proj_skip(child) + proj(parent)[its parent]
    unpool = GridUnpooling(6, 8, 5, norm_layer=torch.nn.LayerNorm, act_layer=torch.nn.GELU)
    coarse_feat = coarse["feat"].detach()
    fine = unpool(coarse)
    skip = unpool.proj_skip.features(fine, feat)
    up = unpool.proj.features(fine, coarse_feat)
    torch.testing.assert_close(fine["feat"], skip + up[inverse])


# ----------------------------------------------------------------- whole model

def lartpc_like_batch(counts=(300, 180), seed=0):
    grid, batch, offset = distinct_points(list(counts), span=40, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    return dict(coord=grid.float(), grid_coord=grid, feat=torch.randn(grid.shape[0], 4, generator=g),
                offset=offset, segment=torch.randint(0, 5, (grid.shape[0],), generator=g))


def run_once(cfg, batch, seed=0):
    torch.manual_seed(seed)
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8, backbone=cfg))
    model.train()
    out = model({k: v.clone() for k, v in batch.items()})
    out["loss"].backward()
    return out["seg_logits"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("variant", ["PT-v3m1", "PT-v3m2"])
def test_forward_backward_is_deterministic_and_reaches_every_parameter(variant):
    cfg = dict(TINY, type=variant, order=("z", "hilbert-trans"), shuffle_orders=True, drop_path=0.2,
               enable_flash=True, upcast_attention=False, upcast_softmax=False, enc_depths=(2, 2))
    if variant == "PT-v3m1":
        cfg = {k: v for k, v in cfg.items() if k not in ("enable_cpe", "enc_mode")}
    batch = lartpc_like_batch()
    logits_a, grads_a = run_once(cfg, batch)
    logits_b, grads_b = run_once(cfg, batch)
    assert logits_a.shape == (480, 5)
    assert torch.equal(logits_a, logits_b)
    assert grads_a.keys() == grads_b.keys()
    assert all(torch.equal(grads_a[n], grads_b[n]) for n in grads_a)
    assert all(bool(g.abs().sum() > 0) for g in grads_a.values())  # every parameter trains
    _, grads_c = run_once(cfg, batch, seed=1)  # another seed: other orders / drop paths
    assert any(not torch.equal(grads_a[n], grads_c[n]) for n in grads_a)


def test_eval_output_of_an_event_does_not_depend_on_its_batch_mates():
    torch.manual_seed(0)
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8,
                              backbone=dict(TINY, enable_flash=True, upcast_attention=False,
                                            upcast_softmax=False, shuffle_orders=True))).eval()
    both = lartpc_like_batch()
    alone = {k: v[:300] for k, v in both.items() if k != "offset"} | {"offset": torch.tensor([300])}
    with torch.no_grad():
        torch.testing.assert_close(model(both)["seg_logits"][:300], model(alone)["seg_logits"], atol=1e-5,
                                   rtol=1e-5)


def test_enc_mode_segmentor_concatenates_every_level():
    cfg = dict(TINY, enc_mode=True, enc_channels=(8, 16), enc_depths=(1, 1))
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=24, backbone=cfg))
    out = model(lartpc_like_batch())
    assert out["seg_logits"].shape == (480, 5) and "dec" not in dict(model.backbone.named_children())
    with pytest.raises(ConfigError, match="backbone_out_channels=8"):
        MODELS.build(dict(type="DefaultSegmentorV2", num_classes=3, backbone_out_channels=8, backbone=cfg))


def test_freeze_backbone_keeps_it_fixed_and_in_eval_mode():
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8,
                              backbone=dict(TINY, drop_path=0.5), freeze_backbone=True))
    model.train()
    assert not model.backbone.training and model.seg_head.training
    assert not any(p.requires_grad for p in model.backbone.parameters())
    out = model(lartpc_like_batch())
    out["loss"].backward()
    assert model.seg_head.weight.grad is not None


@pytest.mark.parametrize("option,value,match", [
    ("order", ("z", "peano"), "order='peano'"),
    ("enc_depths", (1, 1, 1), "stride has 1 entries, enc_depths \\(len 3\\) needs 2"),
    ("enc_channels", (8, 16, 32), "enc_channels has 3 entries"),
    ("dec_channels", (8, 8), "dec_channels has 2 entries"),
    ("enable_rpe", True, "enable_rpe=True needs enable_flash=False"),
    ("add_iso_features", True, "add_iso_features"),
    ("full_attention", True, "full_attention"),
    ("enc_num_head", (3, 2), "channels=8 is not divisible by num_head=3"),
])
def test_unsupported_options_are_one_line_config_errors(option, value, match):
    cfg = dict(TINY, enable_flash=True, upcast_attention=False, upcast_softmax=False)
    cfg[option] = value
    with pytest.raises(ConfigError, match=match) as err:
        MODELS.build(cfg)
    assert "\n" not in str(err.value)


def test_ptv3m1_refuses_pdnorm_and_odd_strides():
    base = {k: v for k, v in TINY.items() if k not in ("enable_cpe", "enc_mode")} | {"type": "PT-v3m1"}
    with pytest.raises(ConfigError, match="pdnorm_bn"):
        MODELS.build(dict(base, pdnorm_bn=True))
    with pytest.raises(ConfigError, match="stride=3"):
        MODELS.build(dict(base, stride=(3,)))


def test_whole_event_attention_with_patch_size_minus_one():
    cfg = dict(TINY, enable_flash=True, upcast_attention=False, upcast_softmax=False, enc_patch_size=(-1, -1),
               dec_patch_size=(-1,))
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=8, backbone=cfg))
    assert model(lartpc_like_batch())["seg_logits"].shape == (480, 5)


def test_missing_grid_coord_says_what_to_add():
    model = MODELS.build(TINY)
    batch = lartpc_like_batch()
    del batch["grid_coord"]
    with pytest.raises(ConfigError, match="GridSample"):
        model(batch)
    batch["grid_size"] = 1.0
    assert model(batch)["feat"].shape == (480, 8)


def test_all_orders_build_and_run():
    for orders in itertools.combinations(("z", "z-trans", "hilbert", "hilbert-trans"), 2):
        model = MODELS.build(dict(TINY, order=orders, enc_depths=(2, 2)))
        assert model(lartpc_like_batch())["feat"].shape == (480, 8)
