"""PT-v3's training step does less work for the same function: pooling's
max passes gradients exactly as ``segment_reduce``'s own backward (with its
rules for ties, NaN and infinite gradients) without counting ties when there
are none, the Hilbert codes come from a table walk over the octants (one
lookup per level), the attention's q/k/v gradients come back in one copy,
and the neighbour search gives torch's answer."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pimm.models.ptv3.attention import SerializedAttention
from pimm.models.ptv3.rows import Groups
from pimm.models.ptv3.serialization import encode, hilbert_encode
from pimm.models.ptv3.structure import Point
from pimm.models import voxel_hash


class _Ops(TorchDispatchMode):
    """Records every aten op run inside it, with the sizes of the outputs it
    materialises (views are not counted)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        owned = {a.untyped_storage().data_ptr() for a in inputs}
        self.calls.append((func.overloadpacket.__name__, [o.numel() for o in outs if isinstance(o, torch.Tensor)
                                                          and o.untyped_storage().data_ptr() not in owned]))
        return out


def _segment_reduce_grads(src, index, size, reduce, weight):
    order = torch.argsort(index, stable=True)
    x = src.detach().clone().requires_grad_()
    out = torch.segment_reduce(x[order], reduce, lengths=torch.bincount(index, minlength=size), unsafe=True)
    out.backward(weight)
    return out.detach(), x.grad


@pytest.mark.parametrize("reduce", ["max", "min"])
@pytest.mark.parametrize("case", ["distinct", "ties", "nan_rows", "infinite_gradient"])
def test_pooling_extremum_gradient_is_segment_reduces_own(reduce, case):
    g = torch.Generator().manual_seed(hash((reduce, case)) % 2**31)
    for _ in range(20):
        n = int(torch.randint(2, 300, (), generator=g))
        index = torch.unique(torch.randint(0, max(1, n // 3), (n,), generator=g), return_inverse=True)[1]
        size = int(index.max()) + 1
        src = torch.randn(n, 4, generator=g) if case != "ties" else torch.randint(0, 3, (n, 4), generator=g).float()
        if case == "nan_rows":
            src[torch.rand(n, 4, generator=g) < 0.05] = float("nan")
        weight = torch.randn(size, 4, generator=g)
        if case == "infinite_gradient":
            weight[torch.rand(size, 4, generator=g) < 0.2] = float("inf")
            weight[torch.rand(size, 4, generator=g) < 0.2] = float("-inf")
        x = src.clone().requires_grad_()
        out = Groups(index, size).reduce(x, reduce)
        out.backward(weight)
        ref_out, ref_grad = _segment_reduce_grads(src, index, size, reduce, weight)
        assert torch.equal(out.detach().nan_to_num(7.0), ref_out.nan_to_num(7.0))
        # bit for bit, NaN where segment_reduce gives NaN (a row that is not the result gets 0, also
        # under an infinite gradient)
        assert torch.equal(x.grad.nan_to_num(7.0), ref_grad.nan_to_num(7.0))


def test_pooling_max_backward_counts_no_ties_when_every_result_is_hit_once():
    torch.manual_seed(0)
    index = torch.unique(torch.randint(0, 500, (2000,)), return_inverse=True)[1]
    size = int(index.max()) + 1
    x = torch.randn(2000, 16, requires_grad=True)  # continuous values: no two rows of a group tie
    out = Groups(index, size).reduce(x, "max")
    with _Ops() as ops:
        out.backward(torch.randn_like(out))
    names = [name for name, _ in ops.calls]
    assert not {"segment_reduce", "_segment_reduce_backward", "embedding_bag", "_embedding_bag"} & set(names), names
    # no reordering of the (2000, 16) rows: one gather of the results and one of the gradient
    assert sum(1 for name, sizes in ops.calls if name == "index_select" and sizes == [2000 * 16]) == 2


def _skilling_hilbert(grid: torch.Tensor, depth: int) -> torch.Tensor:
    """The transform bit by bit (Skilling 2004), as serialization did before the table walk."""
    x = [grid[:, d].long().clone() for d in range(3)]
    for bit in range(depth - 1, 0, -1):
        q, low = 1 << bit, (1 << bit) - 1
        for d in range(3):
            on = (x[d] & q) != 0
            swap = torch.where(on, torch.zeros_like(x[0]), (x[0] ^ x[d]) & low)
            x[0] = torch.where(on, x[0] ^ low, x[0]) ^ swap
            if d:
                x[d] = x[d] ^ swap
    word = torch.zeros_like(x[0])
    for bit in range(depth - 1, -1, -1):
        for d in range(3):
            word = (word << 1) | ((x[d] >> bit) & 1)
    shift = 1
    while shift < 3 * depth:
        word = word ^ (word >> shift)
        shift <<= 1
    return word


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 10, 16])
def test_hilbert_table_walk_gives_skillings_codes(depth):
    g = torch.Generator().manual_seed(depth)
    grid = torch.randint(0, 1 << depth, (3000, 3), generator=g)
    corners = torch.tensor([[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)]) * ((1 << depth) - 1)
    grid = torch.cat([grid, corners])
    assert torch.equal(hilbert_encode(grid, depth), _skilling_hilbert(grid, depth))
    assert torch.equal(hilbert_encode(grid.int(), depth), _skilling_hilbert(grid, depth))
    batch = torch.sort(torch.randint(0, 4, (grid.shape[0],), generator=g)).values
    trans = _skilling_hilbert(grid[:, [1, 0, 2]], depth)
    assert torch.equal(encode(grid, batch, depth, "hilbert-trans"), (batch << (3 * depth)) | trans)


def test_hilbert_encoding_is_a_lookup_per_level_not_ops_per_bit():
    grid = torch.randint(0, 768, (1000, 3))
    with _Ops() as ops:
        hilbert_encode(grid, 10)
    # bit by bit it was ~330 ops at depth 10; a table walk is 8 per level, plus the Morton code
    assert len(ops.calls) <= 10 * 10 + 60, len(ops.calls)


@pytest.mark.parametrize("heads", [1, 3])
def test_attention_qkv_gradient_comes_back_in_one_copy(heads):
    torch.manual_seed(0)
    counts = [150, 97]
    n, c, k = sum(counts), 12, 16
    grid = torch.cat([torch.randperm(4096)[:m, None] // torch.tensor([256, 16, 1]) % 16 for m in counts])
    batch = torch.repeat_interleave(torch.arange(2), torch.tensor(counts))
    point = Point(grid_coord=grid, batch=batch, feat=torch.randn(n, c))
    point.serialization(("z",))
    attn = SerializedAttention(c, heads, k, upcast_attention=False, upcast_softmax=False)
    slots = []
    attn.qkv.register_forward_hook(lambda m, i, out: slots.append(out.shape[0]))
    out = attn(point, point["feat"].clone().requires_grad_())
    with _Ops() as ops:
        out.backward(torch.randn_like(out))
    qkv_sized = [name for name, sizes in ops.calls if sizes == [slots[0] * 3 * c]]
    assert len(qkv_sized) == 1, qkv_sized


def test_neighbour_search_on_the_cpu_answers_as_torch_searchsorted():
    g = torch.Generator().manual_seed(3)
    keys = torch.sort(torch.randint(0, 1 << 40, (5000,), generator=g)).values
    queries = keys[None] + torch.tensor([[-3], [0], [1], [1 << 20], [1 << 41]])
    queries[2, 7] = keys[0] - 1  # not sorted along the row: still answered
    assert torch.equal(voxel_hash._search_sorted(keys, queries), torch.searchsorted(keys, queries))
    assert voxel_hash._search_sorted(keys, queries).dtype == torch.long
