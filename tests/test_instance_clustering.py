"""Instance clustering (pimm.models.clustering) and PointGroupAffinity's
embedding, affinity loss and grouping, against hand-made point sets."""

import itertools
import math

import pytest
import torch

from pimm.engines.registries import MODELS
from pimm.models import instance_affinity  # noqa: F401  (registers the model)
from pimm.models.clustering import absorb_small_clusters, average_linkage, cluster_instances, vote_fragments
from pimm.models.instance_affinity import affinity_pair_loss, sample_partner_pairs
from pimm.utils.errors import ConfigError
from tests.support.threads import single_thread  # noqa: F401  (autouse: one thread)


def same_partition(a, b) -> bool:
    """Two labelings describe the same grouping (ids may differ)."""
    a, b = list(map(int, a)), list(map(int, b))
    return all((a[i] == a[j]) == (b[i] == b[j]) for i, j in itertools.combinations(range(len(a)), 2))


def line(start, direction, n):
    return torch.tensor(start, dtype=torch.float32) + torch.arange(n, dtype=torch.float32)[:, None] * torch.tensor(
        direction, dtype=torch.float32)


# ------------------------------------------------------------ average linkage
def test_average_linkage_joins_close_pairs_and_stops_at_threshold():
    sizes = torch.tensor([2.0, 3.0, 1.0, 4.0])
    mean = torch.tensor([[1.0, 0.9, 0.1, 0.1],
                         [0.9, 1.0, 0.1, 0.1],
                         [0.1, 0.1, 1.0, 0.8],
                         [0.1, 0.1, 0.8, 1.0]])
    sums = mean * sizes[:, None] * sizes[None, :]
    allowed = torch.ones(4, 4, dtype=torch.bool)
    assert same_partition(average_linkage(sums, sizes, allowed, 0.5), [0, 0, 1, 1])
    assert same_partition(average_linkage(sums, sizes, allowed, 0.85), [0, 0, 1, 2])
    assert same_partition(average_linkage(sums, sizes, allowed, 0.95), [0, 1, 2, 3])
    # The merged (0,1) vs (2,3) mean is 0.1: a threshold below it joins everything.
    assert same_partition(average_linkage(sums, sizes, allowed, 0.05), [0, 0, 0, 0])


def test_average_linkage_respects_can_merge_through_merges():
    sizes = torch.ones(3)
    sums = torch.tensor([[1.0, 0.9, 0.8], [0.9, 1.0, 0.8], [0.8, 0.8, 1.0]])
    allowed = torch.ones(3, 3, dtype=torch.bool)
    allowed[0, 2] = allowed[2, 0] = False  # 0 and 2 may never share a cluster
    labels = average_linkage(sums, sizes, allowed, 0.5)
    assert same_partition(labels, [0, 0, 1])  # 0+1 first; then 2 may not join them


def reference_average_linkage(mean, sizes, threshold):
    """Textbook sequential average linkage: join the best pair, update by size-weighted averages."""
    clusters = [[i] for i in range(len(sizes))]
    while len(clusters) > 1:
        def link(a, b):
            total = sum(mean[i][j] * sizes[i] * sizes[j] for i in a for j in b)
            return total / (sum(sizes[i] for i in a) * sum(sizes[j] for j in b))
        best = max(((link(a, b), x, y) for (x, a), (y, b) in itertools.combinations(enumerate(clusters), 2)))
        if best[0] <= threshold:
            break
        _, x, y = best
        clusters[x] = clusters[x] + clusters[y]
        del clusters[y]
    labels = [0] * len(sizes)
    for c, members in enumerate(clusters):
        for i in members:
            labels[i] = c
    return labels


@pytest.mark.parametrize("seed", range(6))
def test_parallel_mutual_merges_equal_sequential_average_linkage(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    points = torch.randn(n, 2, generator=g) * 2
    mean = torch.exp(-torch.cdist(points, points).pow(2) / 4).double()  # a point-pair affinity table
    sizes = torch.randint(1, 5, (n,), generator=g).double()
    sums = mean * sizes[:, None] * sizes[None, :]
    got = average_linkage(sums, sizes, torch.ones(n, n, dtype=torch.bool), 0.3)
    want = reference_average_linkage(mean.tolist(), sizes.tolist(), 0.3)
    assert same_partition(got, want)


# ------------------------------------------------------------ fragments
def test_vote_fragments_cut_where_votes_disagree_and_where_the_edge_test_vetoes():
    # An L: a 10-voxel line along x, then 10 voxels along y from its end.
    coord = torch.cat([line([0, 0, 0], [1, 0, 0], 10), line([9, 1, 0], [0, 1, 0], 10)])
    group = torch.zeros(20, dtype=torch.long)
    radius = torch.full((20,), 3.0)
    two_centroids = torch.cat([torch.tensor([[4.5, 0, 0]]).repeat(10, 1), torch.tensor([[9.0, 5.5, 0]]).repeat(10, 1)])
    frag = vote_fragments(coord, two_centroids, group, 1.0, radius)
    assert same_partition(frag, [0] * 10 + [1] * 10)
    one_centroid = torch.zeros(20, 3)
    assert same_partition(vote_fragments(coord, one_centroid, group, 1.0, radius), [0] * 20)
    # Different groups (classes) never share a fragment, even when adjacent.
    assert same_partition(vote_fragments(coord, one_centroid, (torch.arange(20) >= 10).long(), 1.0, radius),
                          [0] * 10 + [1] * 10)

    def veto_beyond_x5(inverse, a, b):  # voxels are the points here (one per voxel)
        point_of_voxel = torch.empty_like(inverse).scatter_(0, inverse, torch.arange(20))
        return ~((coord[point_of_voxel[a], 0] == 5) & (coord[point_of_voxel[b], 0] == 6)
                 | (coord[point_of_voxel[a], 0] == 6) & (coord[point_of_voxel[b], 0] == 5))
    frag = vote_fragments(coord, one_centroid, group, 1.0, radius, veto_beyond_x5)
    assert same_partition(frag, [0] * 6 + [1] * 14)


def test_cluster_instances_joins_shower_pieces_by_votes():
    # Two separated blobs voting for one centroid, and a far line with its own.
    blob1 = line([0, 0, 0], [1, 0, 0], 4)
    blob2 = line([10, 0, 0], [1, 0, 0], 4)
    track = line([50, 0, 0], [0, 1, 0], 8)
    coord = torch.cat([blob1, blob2, track])
    votes = torch.cat([torch.tensor([[7.0, 0, 0]]).repeat(8, 1), torch.tensor([[50.0, 3.5, 0]]).repeat(8, 1)])
    semantic = torch.tensor([0] * 8 + [1] * 8)
    out = cluster_instances(coord, votes, semantic, torch.zeros(16, dtype=torch.long), 1.0, 2.0, 6.0)
    assert same_partition(out, [0] * 8 + [1] * 8)


def test_absorb_small_clusters_joins_specks_to_the_particle_they_sit_on():
    # A 12-voxel track (0) with a 2-voxel speck (1) in its middle, a 3-voxel
    # branch (2) touching the track at one voxel and a second track (3) at
    # the branch's far end with more contacts; an isolated 2-voxel cluster (4)
    # and an unassigned point (-1) next to the speck.
    # (track2 is longer than the branch, so the branch may join it.)
    track = line([0, 0, 0], [1, 0, 0], 12)
    branch = line([12, 1, 0], [0, 1, 0], 3)       # touches track voxel x=11
    track2 = line([11, 4, 0], [1, 0, 0], 5)  # touches the branch's end voxel three times
    far = line([40, 40, 40], [1, 0, 0], 2)
    unassigned = torch.tensor([[5.0, 1, 0]])
    coord = torch.cat([track, branch, track2, far, unassigned])
    labels = torch.tensor([0] * 12 + [2] * 3 + [3] * 5 + [4] * 2 + [-1])
    labels[5:7] = 1
    batch = torch.zeros(len(coord), dtype=torch.long)
    out = absorb_small_clusters(coord, labels, batch, 1.0, max_points=3)
    assert int(out[-1]) == -1
    # The speck rejoins the track; the branch joins the neighbour it touches most
    # (track2: 3 contacts vs 1); the isolated pair stays apart.
    assert same_partition(out[:-1], [0] * 12 + [3] * 3 + [3] * 5 + [4] * 2)
    # max_points=1 absorbs nothing here; 0 is off.
    assert torch.equal(absorb_small_clusters(coord, labels, batch, 1.0, max_points=1), labels)
    assert torch.equal(absorb_small_clusters(coord, labels, batch, 1.0, max_points=0), labels)
    # Another event's clusters are never touched, even at the same coordinates.
    two = absorb_small_clusters(torch.cat([track, track[5:7]]), torch.tensor([0] * 12 + [1] * 2),
                                torch.tensor([0] * 12 + [1] * 2), 1.0, max_points=3)
    assert same_partition(two, [0] * 12 + [1] * 2)


def test_cluster_instances_absorbs_a_misclassified_speck():
    # A 20-voxel track voting for one centroid with voxels 8-10 predicted as
    # class 3 (delta), and a real 5-voxel delta leaving the track at voxel 15.
    track = line([0, 0, 0], [1, 0, 0], 20)
    delta = line([15, 1, 0], [0, 1, 0], 5)
    coord = torch.cat([track, delta])
    votes = torch.cat([torch.tensor([[9.5, 0, 0]]).repeat(20, 1), torch.tensor([[15.0, 3.0, 0]]).repeat(5, 1)])
    semantic = torch.tensor([1] * 20 + [3] * 5)
    semantic[8:11] = 3
    batch = torch.zeros(25, dtype=torch.long)
    truth = [0] * 20 + [1] * 5
    assert not same_partition(cluster_instances(coord, votes, semantic, batch, 1.0, 2.0, 1.0), truth)
    assert same_partition(cluster_instances(coord, votes, semantic, batch, 1.0, 2.0, 1.0, absorb_points=3), truth)
    # A threshold below the real delta's size keeps it; above, it is swallowed too.
    assert same_partition(cluster_instances(coord, votes, semantic, batch, 1.0, 2.0, 1.0, absorb_points=5),
                          [0] * 25)


def test_min_points_per_class_applies_after_absorption():
    # Class 1: a 6-voxel track and an isolated 3-voxel piece; class 3: a
    # 3-voxel delta on the track's end and a 1-voxel speck inside the track.
    track = line([0, 0, 0], [1, 0, 0], 7)
    piece = line([30, 30, 30], [1, 0, 0], 3)
    delta = line([7, 1, 0], [0, 1, 0], 3)
    coord = torch.cat([track, piece, delta])
    votes = torch.cat([torch.tensor([[3.0, 0, 0]]).repeat(7, 1), torch.tensor([[31.0, 30, 30]]).repeat(3, 1),
                       torch.tensor([[7.0, 2, 0]]).repeat(3, 1)])
    semantic = torch.tensor([1] * 7 + [1] * 3 + [3] * 3)
    semantic[3] = 3  # the speck
    batch = torch.zeros(13, dtype=torch.long)
    out = cluster_instances(coord, votes, semantic, batch, 1.0, 2.0, 1.0, min_points=(1, 5, 1, 2, 1),
                            absorb_points=1)
    # The speck joins the track (absorbed before the track's threshold of 5 is
    # checked), the isolated 3-voxel track piece is dropped, the delta kept.
    assert (out[7:10] == -1).all()
    assert same_partition(out[[0, 1, 2, 3, 4, 5, 6, 10, 11, 12]], [0] * 7 + [1] * 3)
    # A single number still works as before.
    out = cluster_instances(coord, votes, semantic, batch, 1.0, 2.0, 1.0, min_points=4)
    assert (out[3] == -1) and (out[7:] == -1).all() and (out[[0, 1, 2, 4, 5, 6]] >= 0).all()


# ------------------------------------------------------------ affinity model pieces
def test_sample_partner_pairs_stay_in_their_group():
    group = torch.tensor([3, 3, 1, 1, 1, 7, 3, 1])
    i, j = sample_partner_pairs(group, 5, torch.Generator().manual_seed(0))
    assert i.numel() == j.numel() == 40
    assert torch.equal(group[i], group[j])
    assert torch.equal(torch.bincount(i, minlength=8), torch.full((8,), 5))
    assert (j[group[i] == 7] == 5).all()  # a group of one pairs with itself


def test_affinity_pair_loss_by_hand():
    dist2 = torch.tensor([0.5, 2.0, 1.0, 3.0])
    same = torch.tensor([True, True, False, False])
    want = (0.5 + 2.0) / 2 + (-math.log(1 - math.exp(-1.0)) - math.log(1 - math.exp(-3.0))) / 2
    assert float(affinity_pair_loss(dist2, same)) == pytest.approx(want, rel=1e-6)
    # Only one kind of pair: only its term.
    assert float(affinity_pair_loss(dist2[:2], same[:2])) == pytest.approx(1.25)


SMALL_BACKBONE = dict(type="SparseUNet", in_channels=1, channels=(8, 16), enc_blocks=(1, 1), dec_blocks=(1,))


def affinity_model(**kwargs):
    cfg = dict(type="PointGroupAffinity", backbone=SMALL_BACKBONE, num_classes=3, stuff_classes=(2,),
               vote_bandwidth=5.0, agree_radius=3.0)
    cfg.update(kwargs)
    return MODELS.build(cfg)


def test_affinity_clustering_merges_by_learned_affinity():
    """Hand-set votes and embeddings: two touching tracks with different
    embeddings stay apart; two shower pieces with one gap between them, same
    votes and embeddings, become one instance; stuff points get -1; two events
    never mix."""
    model = affinity_model().eval()
    track_a = line([0, 0, 0], [1, 0, 0], 8)
    track_b = line([8, 0, 0], [1, 0, 0], 8)  # continues track a: adjacent voxels at x=7/8
    piece1 = line([40, 0, 0], [0, 0, 1], 3)
    piece2 = line([40, 0, 6], [0, 0, 1], 3)  # 4 voxels away: not adjacent
    stuff = line([60, 0, 0], [1, 0, 0], 2)
    coord = torch.cat([track_a, track_b, piece1, piece2, stuff])
    coord = torch.cat([coord, coord])  # the same picture as a second event
    n = coord.shape[0] // 2
    batch = torch.tensor([0] * n + [1] * n)
    one_event_sem = torch.tensor([1] * 16 + [0] * 6 + [2] * 2)
    semantic = torch.cat([one_event_sem, one_event_sem])
    # Both tracks vote for the junction (votes agree there), their embeddings differ.
    votes = torch.cat([torch.tensor([[7.5, 0, 0]]).repeat(16, 1), torch.tensor([[40.0, 0, 4]]).repeat(6, 1),
                       torch.tensor([[60.5, 0, 0]]).repeat(2, 1)])
    votes = torch.cat([votes, votes])
    embed = torch.zeros(2 * n, 4)
    embed[:8, 0] = embed[n:n + 8, 0] = 3.0
    out = model.cluster(coord, votes - coord, embed, semantic, batch)
    event0 = [0] * 8 + [1] * 8 + [2] * 6 + [-1] * 2
    assert same_partition(out, event0 + [x + 3 if x >= 0 else -1 for x in event0])
    assert (out[semantic == 2] == -1).all() and out.max() == 5
    # With equal embeddings the two tracks are one instance.
    out = model.cluster(coord, votes - coord, torch.zeros(2 * n, 4), semantic, batch)
    assert len(out[:16].unique()) == 1
    # A merge threshold nothing reaches leaves the gapped shower in two pieces.
    strict = affinity_model(merge_affinity=0.999, fragment_affinity=0.0).eval()
    votes_spread = votes.clone()
    votes_spread[16:19, 2] -= 0.5  # the pieces' votes now differ a little
    out = strict.cluster(coord, votes_spread - coord, torch.zeros(2 * n, 4), semantic, batch)
    assert out[16] != out[19]


def test_affinity_model_forward_loss_and_eval():
    g = torch.Generator().manual_seed(0)
    sizes = [60, 40]
    coord = torch.floor(torch.rand(100, 3, generator=g) * 12)
    batch = dict(coord=coord, feat=torch.rand(100, 1, generator=g), offset=torch.tensor(sizes).cumsum(0),
                 segment=torch.randint(0, 3, (100,), generator=g), instance=torch.randint(-1, 4, (100,), generator=g))
    model = affinity_model()
    out = model(batch)
    assert out["loss"].dim() == 0 and torch.isfinite(out["loss"])
    out["loss"].backward()
    assert model.embed_head[-1].weight.grad.abs().sum() > 0 and model.log_bandwidth.grad.abs().sum() > 0
    assert model.offset_head[-1].weight.grad.abs().sum() > 0
    model.eval()
    out = model(batch)
    pred = out["instance_pred"]
    assert pred.shape == (100,) and pred.dtype == torch.long
    assert (pred[out["seg_logits"].argmax(1) == 2] == -1).all()
    # Instances never span two events.
    for ident in pred[pred >= 0].unique():
        assert len(torch.unique(torch.tensor([0] * 60 + [1] * 40)[pred == ident])) == 1


@pytest.mark.parametrize("bad", [dict(merge_affinity=1.5), dict(vote_bandwidth=0.0), dict(num_classes=0),
                                 dict(pairs_per_point=0)])
def test_affinity_model_rejects_bad_config(bad):
    with pytest.raises(ConfigError):
        affinity_model(**bad)
