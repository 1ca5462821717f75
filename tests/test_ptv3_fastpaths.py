"""PT-v3's faster paths compute what the plain ones do: the coarse levels'
serialization read off the fine level's, the CPE convolution with its linear
layer folded in, and row moves with hand-written backward passes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pimm.models.point_ops import voxelize
from pimm.models.ptv3 import serialization as serialization_module
from pimm.models.ptv3.attention import patch_layout
from pimm.models.ptv3.blocks import SubMConv3d
from pimm.models.ptv3.rows import Groups, PatchRows
from pimm.models.ptv3.structure import Point

ALL = ("z", "z-trans", "hilbert", "hilbert-trans")


def _level(n: int, span: int, events: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    grid = torch.randint(0, span, (n, 3), generator=g)
    batch = torch.sort(torch.randint(0, events, (n,), generator=g)).values
    grid, batch, _ = voxelize(grid, batch)
    return grid, batch


def _serialized_fields(point: Point) -> tuple:
    return (point["serialized_code"], point["serialized_order"], point["serialized_inverse"],
            point["serialized_depth"], point["order"], point["_cache"]["serialized_rows"])


@pytest.mark.parametrize("orders,shuffle", [(ALL, True), (ALL, False), (("hilbert",), True), (("z-trans", "hilbert"), False)])
@pytest.mark.parametrize("stride", [2, 4, 3])
@pytest.mark.parametrize("span", [768, 1023, 1500, 37])
def test_coarse_serialization_equals_serializing_the_coarse_level(orders, shuffle, stride, span, monkeypatch):
    grid, batch = _level(3000, span, 4, seed=span + stride)
    fine = Point(grid_coord=grid, batch=batch)
    fine.serialization(orders, shuffle_orders=shuffle)
    cgrid, cbatch, cluster = voxelize(torch.div(grid, stride, rounding_mode="floor"), batch)
    read_off = []
    monkeypatch.setattr("pimm.models.ptv3.structure.coarsen",
                        lambda *a, **k: read_off.append(1) or serialization_module.coarsen(*a, **k))
    fast, plain = Point(grid_coord=cgrid, batch=cbatch), Point(grid_coord=cgrid, batch=cbatch)
    state = torch.get_rng_state()
    fast.coarsen_serialization(fine, cluster, stride, shuffle_orders=shuffle)
    after_fast = torch.rand(1)
    torch.set_rng_state(state)
    plain.serialization(list(orders), shuffle_orders=shuffle)
    assert torch.equal(torch.rand(1), after_fast)  # the same random numbers were drawn
    for a, b in zip(_serialized_fields(fast), _serialized_fields(plain)):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    # read off the fine codes exactly when the stride is a power of 2 and the depth comes out as serialize's
    # (1023 -> 511: 10 bits either way, so it is computed afresh)
    expected = stride in (2, 4) and span != 1023
    assert bool(read_off) == expected


def test_coarse_serialization_of_a_level_serialized_elsewhere_is_computed_afresh():
    grid, batch = _level(500, 64, 2, seed=1)
    fine = Point(grid_coord=grid, batch=batch)
    fine.serialization(ALL)
    fine["_cache"] = {}  # e.g. codes set by hand: no record of the rows
    cgrid, cbatch, cluster = voxelize(torch.div(grid, 2, rounding_mode="floor"), batch)
    a, b = Point(grid_coord=cgrid, batch=cbatch), Point(grid_coord=cgrid, batch=cbatch)
    a.coarsen_serialization(fine, cluster, 2)
    b.serialization(list(ALL))
    assert torch.equal(a["serialized_order"], b["serialized_order"])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [60, 800])  # 60: below the folding threshold (2 * 27 * 8), 800 above
def test_cpe_conv_with_its_linear_folded_in_is_the_same_function(bias, n):
    torch.manual_seed(0)
    grid, batch = _level(n, 12, 2, seed=n)
    point = Point(grid_coord=grid, batch=batch)
    conv, linear = SubMConv3d(8, 8, 3, bias=bias), nn.Linear(8, 8)
    feat = torch.randn(grid.shape[0], 8, requires_grad=True)
    folded = point.sparse_conv(conv, feat, then=linear)
    grads = torch.autograd.grad(folded.square().sum(), [feat, conv.weight, linear.weight, linear.bias])
    plain = linear(point.sparse_conv(conv, feat))
    ref = torch.autograd.grad(plain.square().sum(), [feat, conv.weight, linear.weight, linear.bias])
    torch.testing.assert_close(folded, plain, atol=1e-5, rtol=1e-5)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("counts,k", [([5, 40, 64, 65, 1], 16), ([100, 130], 64)])
def test_patch_rows_move_values_and_gradients_as_index_select(counts, k):
    counts_t = torch.tensor(counts)
    pad, unpad, _ = patch_layout(counts_t, k)
    n = int(counts_t.sum())
    order = torch.randperm(n)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n))
    gather, scatter = order[pad], unpad[inverse]
    rows = PatchRows(gather, scatter)
    x = torch.randn(n, 3, requires_grad=True)
    y = torch.randn(gather.numel(), 3, requires_grad=True)
    w_slots, w_points = torch.randn(gather.numel(), 3), torch.randn(n, 3)
    ours = (rows.to_slots(x) * w_slots).sum() + (rows.from_slots(y) * w_points).sum()
    gx, gy = torch.autograd.grad(ours, [x, y])
    ref = (x.index_select(0, gather) * w_slots).sum() + (y.index_select(0, scatter) * w_points).sum()
    rx, ry = torch.autograd.grad(ref, [x, y])
    torch.testing.assert_close(gx, rx)
    assert torch.equal(gy, ry)
    assert torch.equal(rows.from_slots(rows.to_slots(x)), x)


@pytest.mark.parametrize("reduce", ["max", "min", "mean", "sum"])
def test_groups_reduce_and_spread_match_segment_reduce_and_index_select(reduce):
    torch.manual_seed(0)
    index = torch.randint(0, 40, (300,))
    index = torch.unique(index, return_inverse=True)[1]
    size = int(index.max()) + 1
    src = torch.randint(0, 4, (300, 5)).float().requires_grad_()  # many ties within a group
    groups = Groups(index, size)
    out = groups.reduce(src, reduce)
    order = torch.argsort(index, stable=True)
    ref = torch.segment_reduce(src[order], reduce, lengths=torch.bincount(index, minlength=size), unsafe=True)
    w = torch.randn_like(ref)
    assert torch.equal(out, ref)
    torch.testing.assert_close(torch.autograd.grad((out * w).sum(), src)[0],
                               torch.autograd.grad((ref * w).sum(), src)[0])
    parent = torch.randn(size, 5, requires_grad=True)
    v = torch.randn(300, 5)
    torch.testing.assert_close(torch.autograd.grad((groups.spread(parent) * v).sum(), parent)[0],
                               torch.autograd.grad((parent.index_select(0, index) * v).sum(), parent)[0])


def test_ptv3_linear_is_nn_linear_on_the_cpu_to_a_float32_ulp():
    """PT-v3's Linear (mm, then the bias added, on the CPU) has nn.Linear's
    state dict, output and gradients (the sum rounded in the other order)."""
    from pimm.models.ptv3.linear import Linear

    torch.manual_seed(0)
    fast, plain = Linear(16, 64), torch.nn.Linear(16, 64)
    plain.load_state_dict(fast.state_dict())
    assert list(fast.state_dict()) == ["weight", "bias"]
    x = torch.randn(300, 16, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = fast(x), plain(x2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    (out * torch.arange(64.0)).sum().backward()
    (ref * torch.arange(64.0)).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(fast.weight.grad, plain.weight.grad)
    torch.testing.assert_close(fast.bias.grad, plain.bias.grad)
    no_bias = Linear(16, 8, bias=False)
    torch.testing.assert_close(no_bias(x.detach()), x.detach() @ no_bias.weight.t())
