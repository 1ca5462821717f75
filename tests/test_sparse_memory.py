"""What the sparse convolution keeps for backward: its input and its weight,
never a per-pair copy of the input (3-4x the input's size on LArTPC data).

Gradients are checked against dense references in test_sparse_backbone.py;
these tests pin the memory side of the bargain, i.e. that the gathered rows
are gathered again in backward rather than saved.
"""

import torch

import pimm.models  # noqa: F401  (registers the models)
from pimm.engines.registries import MODELS
from pimm.models.point_ops import voxelize
from pimm.models.sparse_conv import sparse_conv
from pimm.models.sparse_maps import kernel_map_pyramid
from tests.support.threads import single_thread  # noqa: F401  (autouse: one thread)


def saved_tensors(fn):
    """The tensors autograd keeps while ``fn()`` builds its graph, and its result."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return saved, out


def dense_voxels(n=600, extent=12, events=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    grid, batch, _ = voxelize(torch.randint(0, extent, (n, 3), generator=g), torch.randint(0, events, (n,), generator=g))
    return grid, batch


def test_conv_saves_only_its_input_and_weight():
    grid, batch = dense_voxels()
    subm, down = kernel_map_pyramid(grid, batch, 2)
    assert subm[0].layout.gather_in.numel() > 2 * subm[0].num_in  # many pairs per voxel
    for kmap in (subm[0], down[0], down[0].transposed()):
        x = torch.randn(kmap.num_in, 8, requires_grad=True)
        w = torch.randn(kmap.kernel_volume, 8, 4, requires_grad=True)
        saved, out = saved_tensors(lambda: sparse_conv(x, w, kmap))
        assert len(saved) == 2
        assert saved[0].data_ptr() == x.data_ptr() and saved[1].data_ptr() == w.data_ptr()
        out.sum().backward()  # and backward works from those alone
        assert x.grad.shape == x.shape and w.grad.shape == w.shape


def test_sparse_unet_saves_nothing_pair_sized():
    """Whole network: no float tensor kept for backward has more rows than
    there are points, while the kernel maps have ~3x as many slots."""
    grid, batch = dense_voxels(n=1500, extent=14)
    n = grid.shape[0]
    model = MODELS.build(dict(type="SparseUNet", in_channels=1, channels=(8, 16, 24), enc_blocks=(1, 1, 1),
                              dec_blocks=(1, 1)))
    data = dict(coord=grid.float(), grid_coord=grid, feat=torch.randn(n, 1),
                offset=torch.cumsum(torch.bincount(batch), 0))
    subm, _ = kernel_map_pyramid(grid, batch, 3)
    assert subm[0].layout.gather_in.numel() > 3 * n
    saved, out = saved_tensors(lambda: model(data))
    rows = [t.shape[0] for t in saved if t.is_floating_point() and t.dim() == 2 and not isinstance(t, torch.nn.Parameter)]
    assert rows and max(rows) <= n
    out.square().mean().backward()
    assert all(p.grad is not None for p in model.parameters())
