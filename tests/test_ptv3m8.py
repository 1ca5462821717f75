"""PT-v3m8 (pimm.models.ptv3.v3m8, .rope): what it changes from PT-v3m2 --
the 3D rotary positions, QK-norm and the bottleneck CPE -- against direct
references, and its option errors. (Its logits against upstream's own v3m8:
tests/test_ptv3_parity.py, fixtures ``m8_*``.)"""

from __future__ import annotations

import math

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models.ptv3.rope import AxisRoPE, RoPEAttention
from pimm.models.ptv3.v3m8 import BottleneckCPE, PointTransformerV3m8
from pimm.utils.errors import ConfigError, RegistryError

TINY = dict(type="PT-v3m8", in_channels=4, order=("z", "hilbert-trans"), stride=(2,), enc_depths=(2, 2),
            enc_channels=(12, 24), enc_num_head=(2, 2), enc_patch_size=(32, 32), dec_depths=(1,),
            dec_channels=(12,), dec_num_head=(1,), dec_patch_size=(32,), enc_cpe_channels=(6, 24),
            dec_cpe_channels=(12,), mlp_ratio=2, drop_path=0.2, qk_norm=True, layer_scale=1e-2,
            rope_jitter=1.1, rope_rescale=1.2)


def batch(counts=(200, 160), seed=0):
    g = torch.Generator().manual_seed(seed)
    grids, offsets = [], []
    for n in counts:
        cells = torch.randperm(20**3, generator=g)[:n]
        grids.append(torch.stack([cells // 400, (cells // 20) % 20, cells % 20], 1))
    grid = torch.cat(grids)
    coord = grid.float() * 0.05 + 0.04 * torch.rand(grid.shape, generator=g)
    return dict(coord=coord, grid_coord=grid, feat=torch.randn(grid.shape[0], 4, generator=g),
                offset=torch.cumsum(torch.tensor(counts), 0),
                segment=torch.randint(0, 5, (grid.shape[0],), generator=g))


def test_rotation_is_per_axis_rope_on_complex_pairs():
    """Reference: head = 3 chunks (x, y, z); in chunk a, channel j and j + D/6
    are the real and imaginary part of a number multiplied by
    ``exp(i * coord_a * base^(-2j / (D/3)))``."""
    head, base = 12, 7.0
    rope = AxisRoPE(head, base).eval()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 5, head, generator=g), torch.randn(2, 3, 5, head, generator=g)
    xyz = torch.randn(2, 5, 3, generator=g) * 4
    rq, rk = rope(q, k, xyz)
    third, half = head // 3, head // 6
    freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / third)
    for x, rx in ((q, rq), (k, rk)):
        for axis in range(3):
            chunk = x[..., axis * third:(axis + 1) * third].double()
            z = torch.complex(chunk[..., :half], chunk[..., half:])
            turn = torch.polar(torch.ones(()).double(), xyz[..., axis].double()[:, None, :, None] * freq)
            want = torch.cat([(z * turn).real, (z * turn).imag], -1)
            torch.testing.assert_close(rx[..., axis * third:(axis + 1) * third].double(), want, atol=1e-5,
                                       rtol=1e-5)


def test_scores_depend_only_on_coordinate_differences():
    rope = AxisRoPE(18, 10).eval()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 6, 18, generator=g), torch.randn(1, 2, 6, 18, generator=g)
    xyz = torch.rand(1, 6, 3, generator=g)
    scores = [(lambda a, b: a @ b.transpose(-1, -2))(*rope(q, k, xyz + shift))
              for shift in (torch.zeros(3), torch.tensor([3.0, -1.5, 0.25]))]
    torch.testing.assert_close(scores[0], scores[1], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(scores[0], q @ k.transpose(-1, -2), atol=1e-3)  # positions do change them


def test_position_augmentation_is_training_only_and_bounded():
    rope = AxisRoPE(6, 10, jitter=1.1, rescale=1.2)
    xyz = torch.ones(4, 3)
    rope.eval()
    state = torch.get_rng_state()
    assert torch.equal(rope._augment(xyz), xyz) and torch.equal(torch.get_rng_state(), state)
    rope.train()
    for _ in range(20):
        scale = rope._augment(xyz)[0]
        assert torch.all(scale >= 1 / (1.1 * 1.2) - 1e-6) and torch.all(scale <= 1.1 * 1.2 + 1e-6)
        out = rope._augment(xyz)
        assert torch.equal(out, out[:1].expand_as(out))  # one factor per axis for the whole call
    off = AxisRoPE(6, 10, jitter=1.0, rescale=None).train()  # upstream: only degrees > 1 act
    state = torch.get_rng_state()
    assert torch.equal(off._augment(xyz), xyz) and torch.equal(torch.get_rng_state(), state)


def test_qk_norm_normalizes_each_head_before_the_rotation():
    attn = RoPEAttention(12, 2, 8, enable_flash=True, upcast_attention=False, upcast_softmax=False, qk_norm=True)
    assert attn.q_norm.normalized_shape == (6,) and attn.q_norm.eps == 1e-6
    assert RoPEAttention(12, 2, 8, enable_flash=True, upcast_attention=False, upcast_softmax=False).q_norm is None


def test_bottleneck_cpe_names_and_identity_down():
    narrow, equal = BottleneckCPE(24, 6), BottleneckCPE(12, 12)
    assert [n for n, _ in narrow.named_parameters()] == ["down.weight", "down.bias", "conv.weight", "conv.bias",
                                                        "up.weight", "up.bias", "norm.weight", "norm.bias"]
    assert narrow.conv.weight.shape == (6, 3, 3, 3, 6)
    assert isinstance(equal.down, torch.nn.Identity) and "down.weight" not in dict(equal.named_parameters())


def test_bottleneck_cpe_is_down_conv_up_norm():
    """Against the dense reference: a 3^3 conv3d over the occupied voxels of the down-projected features."""
    torch.manual_seed(0)
    model = MODELS.build(dict(TINY, enc_mode=True, enc_depths=(1, 1), drop_path=0.0))
    data = batch((40,))
    point = model._point(dict(data))
    point.serialization(order=model.order)
    cpe = model.enc.enc0.block0.cpe
    feat = torch.randn(40, 12)
    got = cpe.features(point, feat)
    grid = point["grid_coord"].long()
    low = cpe.down(feat)
    dense = torch.zeros(1, 6, *(grid.max(0).values + 3).tolist())
    dense[0, :, grid[:, 0] + 1, grid[:, 1] + 1, grid[:, 2] + 1] = low.t()
    conv = torch.nn.functional.conv3d(dense, cpe.conv.weight.permute(0, 4, 1, 2, 3), cpe.conv.bias)
    want = cpe.norm(cpe.up(conv[0, :, grid[:, 0], grid[:, 1], grid[:, 2]].t()))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_forward_backward_is_deterministic_and_reaches_every_parameter():
    def run(seed):
        torch.manual_seed(seed)
        model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=12,
                                  backbone=TINY)).train()
        out = model(batch())
        out["loss"].backward()
        return out["seg_logits"].detach(), {n: p.grad for n, p in model.named_parameters()}

    (la, ga), (lb, gb), (_, gc) = run(0), run(0), run(1)
    assert torch.equal(la, lb) and all(torch.equal(ga[n], gb[n]) for n in ga)
    assert all(bool(g.abs().sum() > 0) for g in ga.values())  # q/k norms, bottlenecks, every CPE train
    assert any(not torch.equal(ga[n], gc[n]) for n in ga)


def test_pt_v3m4_is_upstreams_alias():
    assert MODELS.get("PT-v3m4") is MODELS.get("PT-v3m8") is PointTransformerV3m8


@pytest.mark.parametrize("option,value,match", [
    ("enc_num_head", (4, 2), "a head has 3 channels; 3D RoPE needs a multiple of 6"),
    ("enc_cpe_channels", (12,), "enc_cpe_channels has 1 entries, enc_depths \\(len 2\\) needs at least 2"),
    ("dec_cpe_channels", (), "dec_cpe_channels has 0 entries"),
    ("add_iso_features", True, "PT-v3m8: add_iso_features"),
])
def test_option_errors_are_one_line(option, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        MODELS.build(dict(TINY, **{option: value}))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("key", ["cpe_shared_weight", "full_attention"])
def test_m2_keys_upstreams_m8_lacks_are_refused(key):
    with pytest.raises(RegistryError, match=f"unknown parameter '{key}'"):
        MODELS.build(dict(TINY, **{key: False}))


def test_batch_without_coord_says_what_is_missing():
    model = MODELS.build(TINY)
    data = batch()
    del data["coord"]
    with pytest.raises(ConfigError, match="needs coord"):
        model(data)


def test_longer_cpe_width_tuples_are_fine_as_upstream():
    model = MODELS.build(dict(TINY, enc_cpe_channels=(6, 12, 96, 96, 96), dec_cpe_channels=(18, 96, 96)))
    assert model.enc.enc1.block0.cpe.conv.weight.shape[0] == 12
    assert model.dec.dec0.block0.cpe.conv.weight.shape[0] == 18
    assert math.isclose(model.enc.enc0.block0.attn.rope.inv_freq[0].item(), 1.0)


@pytest.mark.parametrize("flash", [True, False])
def test_bfloat16_autocast_with_qk_norm_trains(flash):
    """Upstream's pre-training runs under bfloat16 autocast: the normalized,
    rotated queries and keys meet the values in one dtype on both paths."""
    extra = {} if flash else dict(enable_flash=False, upcast_attention=True, upcast_softmax=True)
    torch.manual_seed(0)
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=12,
                              backbone=dict(TINY, **extra))).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(batch())
    out["loss"].backward()
    assert out["seg_logits"].dtype == torch.bfloat16 and math.isfinite(out["loss"].item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_rpe_beside_rope_post_norm_and_first_layer_only_cpe():
    """Options the parity fixtures do not cover for m8 (they stay within the
    suite's 1 MB): RPE next to RoPE (no flash), post-norm, the CPE on the first
    block of each stage only; every parameter trains."""
    options = dict(TINY, enable_rpe=True, enable_flash=False, pre_norm=False, cpe_first_layer_only=True)
    torch.manual_seed(0)
    model = MODELS.build(dict(type="DefaultSegmentorV2", num_classes=5, backbone_out_channels=12,
                              backbone=options)).train()
    names = [n for n, _ in model.named_parameters()]
    assert any(n.endswith("attn.rpe.rpe_table") for n in names) and any("rope" in n for n, _ in model.named_buffers())
    with_cpe = {n.split(".cpe.")[0] for n in names if ".cpe." in n}
    assert with_cpe and all(n.endswith("block0") for n in with_cpe), sorted(with_cpe)
    out = model(batch())
    out["loss"].backward()
    assert torch.isfinite(out["seg_logits"]).all()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())
