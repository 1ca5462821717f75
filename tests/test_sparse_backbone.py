"""The sparse-convolution kernels against plain reference implementations.

The references below are written for clarity, not speed: a convolution is a
sum over kernel offsets of (dense 0/1 adjacency matrix) @ x @ W[offset], with
the adjacency built by comparing every pair of voxels. Autograd through them
gives the reference gradients.
"""

import itertools

import pytest
import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models import sparse_unet
from pimm.models.point_ops import neighbor_pairs, neighbor_table, voxelize
from pimm.models import sparse_maps
from pimm.models.sparse_maps import KernelMap, downsample_kernel_map, kernel_map_pyramid, submanifold_kernel_map
from pimm.models import sparse_conv as sparse_conv_module
from pimm.models.sparse_conv import sparse_conv
from tests.support.threads import single_thread  # noqa: F401  (autouse: one thread)


def random_voxels(n, extent, events, seed, shuffle=False):
    """Distinct voxels of ``events`` events, sorted (as voxelize gives them) or shuffled."""
    g = torch.Generator().manual_seed(seed)
    grid, batch, _ = voxelize(torch.randint(0, extent, (n, 3), generator=g), torch.randint(0, events, (n,), generator=g))
    if shuffle:
        perm = torch.randperm(grid.shape[0], generator=g)
        grid, batch = grid[perm], batch[perm]
    return grid, batch


def reference_submanifold(x, weight, grid, batch, kernel_size):
    r = (kernel_size - 1) // 2
    d = grid[None, :, :] - grid[:, None, :]  # [o, i] = grid[i] - grid[o]
    near = (d.abs() <= r).all(-1) & (batch[:, None] == batch[None, :])
    offset = ((d[..., 0] + r) * kernel_size + d[..., 1] + r) * kernel_size + d[..., 2] + r
    out = x.new_zeros(grid.shape[0], weight.shape[2])
    for k in range(kernel_size**3):
        out = out + (near & (offset == k)).to(x.dtype) @ x @ weight[k]
    return out


def reference_parents(grid, batch, stride):
    """Coarse voxel of every fine voxel, coarse voxels numbered like voxelize."""
    coarse = torch.div(grid, stride, rounding_mode="floor")
    keys = [(int(b), *c.tolist()) for b, c in zip(batch, coarse)]
    ordered = sorted(set(keys))
    return torch.tensor([ordered.index(k) for k in keys]), len(ordered)


def reference_downsample(x, weight, grid, batch, stride):
    parent, num_coarse = reference_parents(grid, batch, stride)
    local = grid - torch.div(grid, stride, rounding_mode="floor") * stride
    child = (local[:, 0] * stride + local[:, 1]) * stride + local[:, 2]
    out = x.new_zeros(num_coarse, weight.shape[2])
    for k in range(stride**3):
        assign = ((parent[None, :] == torch.arange(num_coarse)[:, None]) & (child[None, :] == k)).to(x.dtype)
        out = out + assign @ x @ weight[k]
    return out


def reference_upsample(x, weight, grid, batch, stride):
    parent, _ = reference_parents(grid, batch, stride)
    local = grid - torch.div(grid, stride, rounding_mode="floor") * stride
    child = (local[:, 0] * stride + local[:, 1]) * stride + local[:, 2]
    return torch.einsum("nc,ncd->nd", x[parent], weight[child])


def grads(fn, x, weight, seed=5):
    x = x.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    out = fn(x, weight)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype))
    return out.detach(), x.grad, weight.grad


@pytest.mark.parametrize("kernel_size,shuffle", [(3, False), (3, True), (5, False)])
def test_submanifold_conv_matches_dense_reference(kernel_size, shuffle):
    grid, batch = random_voxels(150, 7, 2, seed=kernel_size + shuffle, shuffle=shuffle)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(grid.shape[0], 3, generator=g, dtype=torch.float64)
    weight = torch.randn(kernel_size**3, 3, 4, generator=g, dtype=torch.float64)
    kmap = submanifold_kernel_map(grid, batch, kernel_size)
    assert kmap.layout.pads.numel() > 0, "the data should exercise padded matmul blocks"
    ours = grads(lambda a, w: sparse_conv(a, w, kmap), x, weight)
    ref = grads(lambda a, w: reference_submanifold(a, w, grid, batch, kernel_size), x, weight)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_strided_and_transposed_conv_match_reference():
    grid, batch = random_voxels(200, 9, 3, seed=11)
    g = torch.Generator().manual_seed(1)
    kmap, coarse, _ = downsample_kernel_map(grid, batch, 2)
    x = torch.randn(grid.shape[0], 3, generator=g, dtype=torch.float64)
    weight = torch.randn(8, 3, 2, generator=g, dtype=torch.float64)
    ours = grads(lambda a, w: sparse_conv(a, w, kmap), x, weight)
    ref = grads(lambda a, w: reference_downsample(a, w, grid, batch, 2), x, weight)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)

    xc = torch.randn(coarse.shape[0], 2, generator=g, dtype=torch.float64)
    weight_up = torch.randn(8, 2, 3, generator=g, dtype=torch.float64)
    up = kmap.transposed()
    ours = grads(lambda a, w: sparse_conv(a, w, up), xc, weight_up)
    ref = grads(lambda a, w: reference_upsample(a, w, grid, batch, 2), xc, weight_up)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_gradcheck():
    grid, batch = random_voxels(40, 4, 2, seed=3)
    kmap = submanifold_kernel_map(grid, batch, 3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(grid.shape[0], 2, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(27, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: sparse_conv(a, w, kmap), (x, weight))


def test_isolated_voxels_reduce_to_the_centre_weight():
    grid = torch.tensor([[0, 0, 0], [5, 5, 5], [0, 0, 0]])
    batch = torch.tensor([0, 0, 1])  # the two (0,0,0) voxels are in different events
    kmap = submanifold_kernel_map(grid, batch, 3)
    assert sum(kmap.counts) == 0 and kmap.pairs[0].numel() == 0
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(27, 2, 4, dtype=torch.float64, requires_grad=True)
    out = sparse_conv(x, weight, kmap)
    torch.testing.assert_close(out, x @ weight[13])
    out.sum().backward()
    assert weight.grad[torch.arange(27) != 13].abs().sum() == 0


def test_layout_sums_equal_index_add():
    grid, batch = random_voxels(300, 10, 2, seed=4)
    kmap = submanifold_kernel_map(grid, batch, 3)
    down, _, _ = downsample_kernel_map(grid, batch, 2)
    in_idx, out_idx = kmap.pairs
    offset = torch.repeat_interleave(torch.arange(27), torch.tensor(kmap.counts))
    perm = torch.randperm(in_idx.numel(), generator=torch.Generator().manual_seed(0))
    generic = KernelMap.from_pairs(in_idx[perm], out_idx[perm], offset[perm], 27, kmap.num_in, kmap.num_out, 13)
    for m in (kmap, down, down.transposed(), generic):
        layout = m.layout
        slots = layout.gather_in.numel()
        src = torch.randn(slots, 3, dtype=torch.float64)
        real = torch.ones(slots, dtype=torch.bool)
        real[layout.pads] = False
        expect_out = torch.zeros(m.num_out, 3, dtype=torch.float64).index_add_(0, layout.gather_out[real], src[real])
        expect_in = torch.zeros(m.num_in, 3, dtype=torch.float64).index_add_(0, layout.gather_in[real], src[real])
        torch.testing.assert_close(layout.to_out(src), expect_out)
        torch.testing.assert_close(layout.to_in(src), expect_in)
        # The real slots hold exactly the map's pairs.
        pairs = sorted(zip(layout.gather_in[real].tolist(), layout.gather_out[real].tolist()))
        assert pairs == sorted(zip(*(t.tolist() for t in m.pairs)))


@pytest.mark.parametrize("shuffle", [False, True])
def test_neighbor_table_matches_brute_force(shuffle):
    grid, batch = random_voxels(120, 6, 2, seed=7, shuffle=shuffle)
    offsets = torch.tensor([[0, 0, 1], [1, -1, 0], [2, 0, -1], [0, 0, -2], [-1, 1, 1], [0, 0, 0]])
    found, nbr = neighbor_table(grid, batch, offsets)
    for k, d in enumerate(offsets):
        target = grid + d
        match = (target[:, None, :] == grid[None, :, :]).all(-1) & (batch[:, None] == batch[None, :])
        assert torch.equal(found[k], match.any(1))
        assert torch.equal(nbr[k][found[k]], match.float().argmax(1)[found[k]])
    i, j, oid = neighbor_pairs(grid, batch, offsets)
    assert torch.equal(grid[j], grid[i] + offsets[oid])
    assert len(i) == int(found.sum())


def test_kernel_maps_built_once_per_resolution(monkeypatch):
    """One pyramid build per forward; every convolution of a resolution runs
    on that resolution's map, and the transposed convolutions on the layouts
    of the strided ones."""
    built, used = [], []

    def counting_pyramid(*args, **kwargs):
        maps = kernel_map_pyramid(*args, **kwargs)
        built.append(maps)
        return maps

    def recording_conv(x, weight, kmap):
        used.append(kmap)
        return sparse_conv(x, weight, kmap)

    monkeypatch.setattr(sparse_unet, "kernel_map_pyramid", counting_pyramid)
    monkeypatch.setattr(sparse_conv_module, "sparse_conv", recording_conv)
    tables = []
    monkeypatch.setattr(sparse_maps, "_maps_from_table", counting(tables, sparse_maps._maps_from_table))
    model = MODELS.build(dict(type="SparseUNet", in_channels=1, channels=(4, 8, 8), enc_blocks=(2, 1, 1), dec_blocks=(1, 1)))
    grid, batch = random_voxels(300, 12, 2, seed=8)
    offset = torch.bincount(batch).cumsum(0)
    out = model(dict(coord=grid.float(), feat=torch.ones(grid.shape[0], 1), offset=offset))
    out.sum().backward()
    assert len(built) == 1 and len(tables) == 2  # one table for all submanifold maps, one for the strided
    subm, strided = built[0]
    assert len(subm) == 3 and len(strided) == 2
    # level 0: stem, 2 encoder blocks, 1 decoder block; level 1: 1 + 1 blocks; level 2: 1 block
    assert [sum(m is s for m in used) for s in subm] == [1 + 4 + 2, 2 + 2, 2]
    assert [sum(m is s for m in used) for s in strided] == [1, 1]
    ups = [m for m in used if not any(m is s for s in subm + strided)]
    assert len(ups) == 2 and {id(m.layout.gather_in) for m in ups} == {id(s.layout.gather_out) for s in strided}


def counting(calls, fn):
    def wrapped(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)
    return wrapped


def test_pyramid_equals_level_by_level_maps():
    grid, batch = random_voxels(500, 40, 3, seed=12)
    subm, strided = kernel_map_pyramid(grid, batch, 3)
    g, b = grid, batch
    for level in range(3):
        single = submanifold_kernel_map(g, b, 3)
        assert subm[level].counts == single.counts and subm[level].num_in == g.shape[0]
        assert all(torch.equal(x, y) for x, y in zip(subm[level].pairs, single.pairs))
        if level < 2:
            down, g, b = downsample_kernel_map(g, b, 2)
            assert strided[level].counts == down.counts and strided[level].num_out == g.shape[0]
            assert all(torch.equal(x, y) for x, y in zip(strided[level].pairs, down.pairs))


def test_forward_and_backward_are_deterministic():
    grid, batch = random_voxels(400, 12, 3, seed=9)
    offset = torch.bincount(batch).cumsum(0)
    feat = torch.randn(grid.shape[0], 2, generator=torch.Generator().manual_seed(0))
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model = MODELS.build(dict(type="SparseUNet", in_channels=2, channels=(4, 8, 8), enc_blocks=(1, 1, 1), dec_blocks=(1, 1)))
        out = model(dict(coord=grid.float(), feat=feat, offset=offset))
        (out**2).sum().backward()
        results.append([out.detach()] + [p.grad for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_kernel_map_shapes_and_offsets():
    grid, batch = random_voxels(200, 8, 2, seed=10)
    kmap = submanifold_kernel_map(grid, batch, 3)
    offsets = list(itertools.product((-1, 0, 1), repeat=3))
    in_idx, out_idx = kmap.pairs
    start = 0
    for k, count in enumerate(kmap.counts):
        seg = slice(start, start + count)
        diff = grid[in_idx[seg]] - grid[out_idx[seg]]
        assert (diff == torch.tensor(offsets[k])).all()
        start += count
    assert kmap.counts[13] == 0 and kmap.identity == 13 and kmap.num_in == kmap.num_out == grid.shape[0]
    # Mirrored offsets hold the same pairs reversed.
    assert kmap.counts == kmap.counts[::-1]
    layout = kmap.layout
    slots = layout.gather_in.numel()
    assert slots == sum(blocks * length for blocks, length in layout.buckets)
    assert layout.slot_offsets.numel() == sum(blocks for blocks, _ in layout.buckets) == sum(c > 0 for c in kmap.counts)
    assert slots - layout.pads.numel() == sum(kmap.counts)
    with pytest.raises(ValueError, match="kernel offsets"):
        sparse_conv(torch.randn(grid.shape[0], 2), torch.randn(8, 2, 2), kmap)
    with pytest.raises(ValueError, match="rows"):
        sparse_conv(torch.randn(grid.shape[0] + 1, 2), torch.randn(27, 2, 2), kmap)


def test_runs_under_cpu_autocast():
    """Under AMP the convolutions keep full precision (BatchNorm hands them
    float32 anyway) and training works end to end."""
    torch.manual_seed(0)
    model = MODELS.build(dict(type="SparseUNet", in_channels=2, channels=(4, 8, 8), enc_blocks=(1, 1, 1), dec_blocks=(1, 1)))
    grid, batch = random_voxels(300, 12, 2, seed=13)
    data = dict(coord=grid.float(), feat=torch.rand(grid.shape[0], 2), offset=torch.bincount(batch).cumsum(0))
    reference = model(data)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(data)
    out.float().pow(2).mean().backward()
    assert out.shape == reference.shape
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.stem.conv.weight.grad.abs().sum() > 0
