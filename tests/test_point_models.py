"""Tests of the point-cloud models: sparse U-Net backbone, segmentor, losses,
PointGroupLite and its clustering, and the point_ops primitives."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from pimm.engines.registries import MODELS
from pimm.models import instance as instance_mod  # noqa: F401  (registers the models)
from pimm.models import segmentors  # noqa: F401
from pimm.models.instance import cluster_instances, instance_centroid_offsets
from pimm.models.losses import LOSSES
from pimm.models.point_ops import connected_components, voxelize
from pimm.models.sparse_maps import downsample_kernel_map, submanifold_kernel_map
from pimm.utils.errors import ConfigError
from tests.support.threads import single_thread  # noqa: F401  (autouse: one thread)


SMALL_BACKBONE = dict(type="SparseUNet", in_channels=2, channels=(8, 16, 24), enc_blocks=(1, 1, 1),
                      dec_blocks=(1, 1))


def make_event(n, seed, extent=40.0):
    g = torch.Generator().manual_seed(seed)
    coord = torch.floor(torch.rand(n, 3, generator=g) * extent)
    feat = torch.rand(n, 2, generator=g)
    return coord, feat


def make_batch(sizes, seed=0):
    coords, feats = zip(*(make_event(n, seed + i) for i, n in enumerate(sizes)))
    coord, feat = torch.cat(coords), torch.cat(feats)
    n = coord.shape[0]
    g = torch.Generator().manual_seed(seed)
    return dict(coord=coord, feat=feat, segment=torch.randint(0, 3, (n,), generator=g),
                instance=torch.randint(0, 4, (n,), generator=g), offset=torch.tensor(sizes).cumsum(0))


def randomise_bn(model):
    """Give BatchNorm non-trivial running statistics so eval mode is a real test."""
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm1d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


def test_segmentor_shapes_and_loss():
    model = MODELS.build(dict(type="DefaultSegmentor", backbone=SMALL_BACKBONE, num_classes=3))
    batch = make_batch([50, 70])
    out = model(batch)
    assert out["seg_logits"].shape == (120, 3)
    assert out["loss"].dim() == 0 and torch.isfinite(out["loss"])
    del batch["segment"]
    assert "loss" not in model(batch)


def test_events_are_independent_and_permutable():
    torch.manual_seed(0)
    model = MODELS.build(SMALL_BACKBONE)
    randomise_bn(model)
    model.eval()
    sizes = [60, 45, 80]
    events = [make_event(n, seed) for seed, n in enumerate(sizes)]

    def run(order):
        coord = torch.cat([events[i][0] for i in order])
        feat = torch.cat([events[i][1] for i in order])
        offset = torch.tensor([sizes[i] for i in order]).cumsum(0)
        with torch.no_grad():
            out = model(dict(coord=coord, feat=feat, offset=offset))
        return list(out.split([sizes[i] for i in order]))

    full = run([0, 1, 2])
    for i in range(3):
        torch.testing.assert_close(run([i])[0], full[i], atol=1e-5, rtol=1e-4)
    permuted = run([2, 0, 1])
    for pos, i in enumerate([2, 0, 1]):
        torch.testing.assert_close(permuted[pos], full[i], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["DefaultSegmentor", "PointGroupLite"])
def test_loss_decreases(model_type):
    torch.manual_seed(0)
    # Two line-shaped classes (along x, along y): learnable from local shape alone.
    t = torch.arange(20.0)
    lines, labels, ids = [], [], []
    for k in range(6):
        start = torch.tensor([3.0 * k, 2.0 * k, 5.0 * k])
        axis = torch.zeros(3)
        axis[k % 2] = 1.0
        lines.append(start + t[:, None] * axis)
        labels.append(torch.full((20,), k % 2))
        ids.append(torch.full((20,), k))
    coord = torch.cat(lines)
    batch = dict(coord=coord, feat=torch.ones(len(coord), 2), segment=torch.cat(labels),
                 instance=torch.cat(ids), offset=torch.tensor([60, 120]))
    cfg = dict(type=model_type, backbone=SMALL_BACKBONE, num_classes=2,
               criteria=[dict(type="CrossEntropyLoss"), dict(type="LovaszLoss")])
    if model_type == "PointGroupLite":
        cfg["offset_scale"] = 10.0  # offsets here are up to 10 units
    model = MODELS.build(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(12):
        loss = model(batch)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_bad_backbone_config_is_a_config_error():
    with pytest.raises(ConfigError, match="enc_blocks"):
        MODELS.build(dict(SMALL_BACKBONE, enc_blocks=(1, 1)))


# ----------------------------------------------------------------------- losses
PROBS = torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8]])
TARGET = torch.tensor([0, 0, 1])


def test_lovasz_hand_computed():
    # Class 0: errors sorted (0.6, 0.2, 0.1) with fg (1, 0, 1): Lovász gradient
    # (1/2, 1/6, 1/3) -> 0.36667. Class 1: errors (0.6, 0.2, 0.1), fg (0, 1, 0):
    # gradient (1/2, 1/2, 0) -> 0.4. Mean 0.383333.
    loss = LOSSES.build(dict(type="LovaszLoss"))(PROBS.log(), TARGET)
    assert loss.item() == pytest.approx((0.3 + 0.2 / 6 + 0.1 / 3 + 0.4) / 2, abs=1e-6)


def test_lovasz_equals_one_minus_iou_for_hard_predictions():
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, 4, (200,), generator=g)
    pred = torch.where(torch.rand(200, generator=g) < 0.7, target, torch.randint(0, 4, (200,), generator=g))
    logits = F.one_hot(pred, 4).float() * 100.0
    ious = [((pred == c) & (target == c)).sum() / ((pred == c) | (target == c)).sum() for c in range(4)]
    expected = 1.0 - torch.stack(ious).mean()
    assert LOSSES.build(dict(type="LovaszLoss"))(logits, target).item() == pytest.approx(expected.item(), abs=1e-5)


def test_dice_hand_computed():
    # Class 0: 2*(0.9+0.4)/(1.5+2); class 1: 2*0.8/(1.5+1).
    loss = LOSSES.build(dict(type="DiceLoss", smooth=0.0, exponent=1, classes="present"))(PROBS.log(), TARGET)
    assert loss.item() == pytest.approx(1.0 - (2.6 / 3.5 + 1.6 / 2.5) / 2, abs=1e-6)


@pytest.mark.parametrize("loss_type", ["CrossEntropyLoss", "LovaszLoss", "DiceLoss"])
def test_ignore_index_is_honoured(loss_type):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(30, 4, generator=g)
    target = torch.randint(0, 4, (30,), generator=g)
    target[::3] = -1
    loss = LOSSES.build(dict(type=loss_type, ignore_index=-1))
    keep = target >= 0
    reference = loss(logits[keep], target[keep])
    torch.testing.assert_close(loss(logits, target), reference)
    scrambled = logits.clone()
    scrambled[~keep] = torch.randn(int((~keep).sum()), 4, generator=g) * 10
    torch.testing.assert_close(loss(scrambled, target), reference)
    assert loss(logits, torch.full_like(target, -1)).item() == 0.0


# ----------------------------------------------------------------- clustering
def blob_batch():
    g = torch.Generator().manual_seed(0)
    centres = torch.tensor([[10.0, 10, 10], [60, 10, 10], [10, 60, 10], [40, 40, 60]])
    coords = [torch.floor(c + torch.randn(60, 3, generator=g) * 2.5) for c in centres]
    # Two events with two blobs each; the blob ids repeat across events on purpose.
    coord = torch.cat(coords)
    inst = torch.tensor([0, 1, 0, 1]).repeat_interleave(60)
    batch = torch.arange(2).repeat_interleave(120)
    return coord, inst, batch


def test_clustering_recovers_separated_blobs_exactly():
    coord, inst, batch = blob_batch()
    target, valid = instance_centroid_offsets(coord, inst, batch)
    assert valid.all()
    pred = cluster_instances(coord, coord + target, torch.zeros_like(inst), batch, grid_size=1.0,
                             agree_radius=3.0, merge_radius=4.0)
    truth = batch * 2 + inst
    # Same partition: a bijection between predicted and true ids.
    pairs = torch.unique(torch.stack([pred, truth], 1), dim=0)
    assert len(pairs) == 4 and len(pred.unique()) == 4 and pred.min() == 0


def test_clustering_cuts_touching_tracks_and_merges_shower_pieces():
    t = torch.arange(1.0, 31.0)[:, None]
    track_a = t * torch.tensor([1.0, 0, 0])  # two tracks meeting at the origin
    track_b = torch.cat([torch.zeros(1, 3), t * torch.tensor([0.0, 1, 0])])
    piece_1 = torch.tensor([[50.0, 50, 50]]) + torch.arange(5.0)[:, None]  # a shower in two pieces
    piece_2 = piece_1 + 20.0
    coord = torch.cat([track_a, track_b, piece_1, piece_2])
    inst = torch.tensor([0] * 30 + [1] * 31 + [2] * 10)
    batch = torch.zeros_like(inst)
    target, _ = instance_centroid_offsets(coord, inst, batch)
    pred = cluster_instances(coord, coord + target, torch.zeros_like(inst), batch, 1.0, 4.0, 4.0)
    assert len(torch.unique(torch.stack([pred, inst], 1), dim=0)) == 3 == len(pred.unique())


def test_clustering_per_class_merge_radius():
    # One object in two pieces whose votes land 6 units apart: merged under
    # class 0's radius (10), kept apart under class 1's (1).
    piece = torch.arange(4.0)[:, None].repeat(1, 3)
    coord = torch.cat([piece, piece + 30.0])
    votes = torch.cat([torch.full((4, 3), 15.0) + torch.tensor([3.0, 0, 0]),
                       torch.full((4, 3), 15.0) - torch.tensor([3.0, 0, 0])])
    batch = torch.zeros(8, dtype=torch.long)
    for cls, expected in ((0, 1), (1, 2)):
        semantic = torch.full((8,), cls)
        pred = cluster_instances(coord, votes, semantic, batch, 1.0, agree_radius=2.0, merge_radius=(10.0, 1.0))
        assert len(pred.unique()) == expected and (pred >= 0).all()


def test_clustering_respects_classes_stuff_and_min_points():
    coord, inst, batch = blob_batch()
    target, _ = instance_centroid_offsets(coord, inst, batch)
    semantic = torch.zeros_like(inst)
    semantic[:30] = 1  # half of the first blob is another class -> its own instance
    semantic[60:120] = 2  # a stuff class -> unassigned
    pred = cluster_instances(coord, coord + target, semantic, batch, 1.0, 3.0, 4.0,
                             min_points=31, stuff_classes=(2,))
    assert (pred[60:120] == -1).all()
    assert (pred[:60] == -1).all()  # two halves of 30 points, both below min_points
    assert len(pred[120:].unique()) == 2 and (pred[120:] >= 0).all()


def test_pointgroup_outputs():
    model = MODELS.build(dict(type="PointGroupLite", backbone=SMALL_BACKBONE, num_classes=3,
                              stuff_classes=(2,), agree_radius=3.0, merge_radius=5.0))
    batch = make_batch([40, 50])
    out = model(batch)
    assert out["seg_logits"].shape == (90, 3) and out["offset_pred"].shape == (90, 3)
    assert out["loss"].dim() == 0 and "instance_pred" not in out
    model.eval()
    out = model(batch)
    ipred = out["instance_pred"]
    assert ipred.shape == (90,) and ipred.dtype == torch.long
    assert (ipred[out["seg_logits"].argmax(1) == 2] == -1).all()


def test_pointgroup_cleanup_options():
    # Per-class min_points and absorb_points reach the clustering: with every
    # cluster below its class minimum, nothing is assigned.
    model = MODELS.build(dict(type="PointGroupLite", backbone=SMALL_BACKBONE, num_classes=3, stuff_classes=(2,),
                              agree_radius=3.0, merge_radius=5.0, min_points=(1000, 1000, 1), absorb_points=2))
    model.eval()
    assert (model(make_batch([40, 50]))["instance_pred"] == -1).all()
    with pytest.raises(ConfigError, match="absorb_points"):
        MODELS.build(dict(type="PointGroupLite", backbone=SMALL_BACKBONE, num_classes=3, absorb_points=-1))


def test_centroid_offsets():
    coord = torch.tensor([[0.0, 0, 0], [2, 0, 0], [5, 5, 5], [9, 9, 9]])
    target, valid = instance_centroid_offsets(coord, torch.tensor([3, 3, -1, 3]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(target, torch.tensor([[1.0, 0, 0], [-1, 0, 0], [0, 0, 0], [0, 0, 0]]))
    assert valid.tolist() == [True, True, False, True]


# ------------------------------------------------------------------ point_ops
def test_connected_components_long_chain():
    n = 2000
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    # A chain visiting the nodes in random order, plus 10 isolated nodes.
    labels = connected_components(n + 10, perm[:-1], perm[1:])
    assert (labels[:n] == 0).all()
    assert labels[n:].tolist() == list(range(n, n + 10))


def test_submanifold_kernel_map_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    grid = torch.randint(0, 6, (80, 3), generator=g)
    batch = torch.randint(0, 2, (80,), generator=g)
    vgrid, vbatch, _ = voxelize(grid, batch)
    kmap = submanifold_kernel_map(vgrid, vbatch, 3)
    in_idx, out_idx = kmap.pairs
    found = set()
    start = 0
    offsets = list(itertools.product((-1, 0, 1), repeat=3))
    for k, count in enumerate(kmap.counts):
        for i, o in zip(in_idx[start:start + count].tolist(), out_idx[start:start + count].tolist()):
            assert (vgrid[i] - vgrid[o]).tolist() == list(offsets[k])
            found.add((i, o))
        start += count
    diff = (vgrid[:, None] - vgrid[None]).abs().max(-1).values
    same = vbatch[:, None] == vbatch[None]
    expected = {(i, o) for i, o in torch.nonzero((diff <= 1) & same & (diff > 0)).tolist()}
    assert found == expected


def test_downsample_kernel_map_pools_each_voxel_once():
    grid = torch.tensor([[0, 0, 0], [1, 1, 1], [2, 0, 0], [3, 1, 0], [0, 0, 0]])
    batch = torch.tensor([0, 0, 0, 0, 1])
    kmap, coarse, cbatch = downsample_kernel_map(grid, batch, 2)
    assert coarse.tolist() == [[0, 0, 0], [1, 0, 0], [0, 0, 0]] and cbatch.tolist() == [0, 0, 1]
    parent = torch.empty(5, dtype=torch.long)
    in_idx, out_idx = kmap.pairs
    parent[in_idx] = out_idx
    assert parent.tolist() == [0, 0, 1, 1, 2]
    assert sum(kmap.counts) == 5 and kmap.counts[0] == 3  # child offset (0,0,0) thrice
