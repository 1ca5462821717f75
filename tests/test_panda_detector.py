"""Upstream's panoptic detector ``detector-v5``: the query matcher against
brute force, the instance loss, the panoptic fusion and matrix NMS, the
evaluator's metrics on hand-made events, the model end to end on generated
events, and the generator's detector truth (also through a PILArNet v3 file)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pimm.datasets.lartpc import LArTPCSynthDataset
from pimm.engines.registries import HOOKS, MODELS, TESTERS
from pimm.evaluation.instance_metrics import adjusted_rand_score, event_counts, scores
from pimm.models.losses import LOSSES
from pimm.models.losses.instance_query import event_instances, match_queries
from pimm.models.panda_detector import matrix_nms, postprocess_event
from pimm.utils.errors import ConfigError, UserError

CLASS_NAMES = ["photon", "electron", "muon", "pion", "proton"]


# -- matcher ------------------------------------------------------------------
def _cost(masks, logits, inst, num, alpha=0.25, gamma=2.0):
    """The matching cost written out per pair: focal + Dice + -log p(class)."""
    target = F.one_hot(inst, num).T.float()
    prob = masks.sigmoid()
    cost = torch.zeros(masks.shape[0], num, dtype=torch.float64)
    classes = logits[:, :-1].softmax(-1)
    for q in range(masks.shape[0]):
        for j in range(num):
            t = target[j]
            ce = F.binary_cross_entropy_with_logits(masks[q], t, reduction="none")
            p_t = prob[q] * t + (1 - prob[q]) * (1 - t)
            a_t = alpha * t + (1 - alpha) * (1 - t)
            focal = (a_t * (1 - p_t) ** gamma * ce).mean()
            dice = 1 - (2 * (prob[q] * t).sum() + 1) / (prob[q].sum() + t.sum() + 1)
            cost[q, j] = focal + dice - torch.log(classes[q, j % classes.shape[1]] + 1e-8)
    return cost


@pytest.mark.parametrize("queries, instances", [(3, 3), (5, 3), (4, 2), (6, 4)])
def test_matcher_is_the_cheapest_of_all_assignments(queries, instances):
    """The Hungarian matching of queries to instances costs the least of every
    injective assignment (brute force over permutations), on random events."""
    gen = torch.Generator().manual_seed(queries * 10 + instances)
    for trial in range(5):
        points = 30
        inst = torch.arange(points) % instances
        masks = torch.randn(queries, points, generator=gen) * 3
        logits = torch.randn(queries, 7, generator=gen)
        event = event_instances(inst, [points], segment=inst % 6)[0]
        rows, cols = match_queries(masks, event, logits, cost_class=1.0)
        cost = _cost(masks, logits, inst, instances)
        # event["inst_class"] of instance j is j % 6, the class column the reference cost reads
        best = min(sum(cost[q, j] for q, j in zip(perm, range(instances)))
                   for perm in itertools.permutations(range(queries), instances))
        assert len(set(rows.tolist())) == instances == len(set(cols.tolist()))
        got = sum(cost[q, j] for q, j in zip(rows.tolist(), cols.tolist()))
        assert float(got) == pytest.approx(float(best), rel=1e-5, abs=1e-6), trial


# -- loss ---------------------------------------------------------------------------
def _loss(**kw):
    return LOSSES.build(dict(type="FastUnifiedInstanceLoss", cost_class=1.0, truth_label="instance",
                             segment_key="segment", query_heads=kw.pop("heads", []), **kw))


def test_loss_prefers_the_right_masks_and_classes_and_trains_them():
    inst = torch.tensor([0] * 10 + [1] * 10 + [-1] * 5)
    seg = torch.tensor([2] * 10 + [4] * 10 + [5] * 5)
    good = torch.full((3, 25), -8.0)
    good[0, :10], good[2, 10:20] = 8.0, 8.0
    logits = torch.full((3, 7), -5.0)
    logits[0, 2], logits[2, 4], logits[1, 6] = 5.0, 5.0, 5.0  # query 1: "no object"
    batch = dict(instance=inst, segment=seg)
    loss = _loss()
    right, parts = loss(dict(pred_masks=[good], pred_logits=[logits]), batch)
    swapped = logits[[2, 1, 0]]  # the right masks with each other's class
    wrong_class, _ = loss(dict(pred_masks=[good], pred_logits=[swapped]), batch)
    wrong_mask, _ = loss(dict(pred_masks=[torch.zeros(3, 25)], pred_logits=[logits]), batch)
    assert float(right) < 0.1 < min(float(wrong_class), float(wrong_mask))
    assert parts["num_pairs"] == 2 and float(parts["cls_matched"]) < 0.01
    masks = torch.zeros(3, 25, requires_grad=True)
    value, _ = loss(dict(pred_masks=[masks], pred_logits=[logits]), batch)
    value.backward()
    assert masks.grad.abs().sum() > 0


def test_loss_heads_skip_sentinel_instances():
    """A continuous head's instances whose target is the sentinel do not count;
    when every matched one is, the head adds exactly 0 (and keeps the graph)."""
    inst = torch.tensor([0] * 5 + [1] * 5)
    masks = torch.full((2, 10), -8.0)
    masks[0, :5], masks[1, 5:] = 8.0, 8.0
    pred = dict(pred_masks=[masks], pred_logits=[torch.zeros(2, 3)], pred_vertex=[torch.zeros(2, 3)])
    vertex = torch.cat([torch.full((5, 3), -1.0), torch.full((5, 3), 2.0)])
    batch = dict(instance=inst, segment=torch.zeros(10, dtype=torch.long), vertex=vertex)
    heads = [dict(name="vertex", sentinel=-1.0)]
    _, parts = _loss(heads=heads)(pred, batch)
    # only instance 1 (target 2.0, predicted 0.0) counts: smooth-L1 of 2 is 1.5
    assert float(parts["vertex"]) == pytest.approx(1.5)
    batch["vertex"] = torch.full((10, 3), -1.0)
    _, parts = _loss(heads=heads)(pred, batch)
    assert float(parts["vertex"]) == 0.0


# -- postprocess --------------------------------------------------------------------
def test_matrix_nms_decays_same_class_overlaps_only():
    masks = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    labels = torch.tensor([0, 0, 1])
    decayed, order = matrix_nms(masks, labels, torch.tensor([0.9, 0.8, 0.7]), sigma=2.0)
    assert order.tolist() == [0, 1, 2]
    iou = 2 / 6  # masks 0 and 1 share 2 of 6 points
    assert decayed.tolist() == pytest.approx([0.9, 0.8 * math.exp(-2.0 * iou ** 2), 0.7])  # 2: another class
    linear, _ = matrix_nms(masks, labels, torch.tensor([0.9, 0.8, 0.7]), kernel="linear")
    assert linear[1] == pytest.approx(0.8 * (1 - iou))


def test_panoptic_fusion_paints_points_by_score_and_drops_stuff_and_small_masks():
    big = 10.0
    masks = torch.full((4, 12), -big)
    masks[0, :6] = big      # muon, confident
    masks[1, 4:10] = big    # proton, overlaps the muon on points 4-5
    masks[2, 10:11] = big   # a 1-point electron: below min_points
    masks[3, :] = big       # "no object"
    logits = torch.full((4, 7), -big)
    logits[0, 2], logits[1, 4], logits[2, 1], logits[3, 6] = big, big, big, big
    stuff = torch.zeros(12)
    stuff[11] = 0.9  # point 11 is stuff (led)
    out = postprocess_event(masks, logits, stuff, {"vertex": torch.arange(12.0).reshape(4, 3)}, stuff_classes=[5],
                            min_points=2, fill_uncovered=False)
    inst, cls = out["instance_labels"].tolist(), out["class_labels"].tolist()
    assert inst[:6] == [1] * 6 and cls[:6] == [2] * 6          # the muon claims the shared points first
    assert inst[6:10] == [2] * 4 and cls[6:10] == [4] * 4      # the proton keeps its own
    assert inst[10:] == [-1, -1] and cls[10:] == [-1, -1]      # too small; stuff
    assert out["query_labels"].tolist()[:10] == [0] * 6 + [1] * 4
    assert out["pred_vertex"][0].tolist() == [0.0, 1.0, 2.0] and torch.isnan(out["pred_vertex"][11]).all()


# -- metrics ----------------------------------------------------------------------
def test_metrics_on_a_hand_made_event():
    # true: A (muon, 4 points), B (proton, 4), C (electron, 2); predicted:
    # A exactly, B with one extra point (IoU 4/5) but called a muon, and a
    # false 2-point photon; C is missed.
    gt = np.array([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, -1, -1])
    gc = np.array([2, 2, 2, 2, 4, 4, 4, 4, 1, 1, 5, 5])
    pr = np.array([7, 7, 7, 7, 8, 8, 8, 8, -1, -1, 8, 9])
    pc = np.array([2, 2, 2, 2, 2, 2, 2, 2, -1, -1, 2, 0])
    counts, confusion, matches = event_counts(gt, pr, gc, pc, 5, iou_thresh=0.5)
    assert sorted(matches) == [(7, 0, 1.0), (8, 1, 0.8)]
    assert counts.tolist() == [3, 3, 2, 1.8, 1, 1.0]
    assert confusion[2, 2] == 1 and confusion[4, 2] == 1 and confusion.sum() == 2
    s = scores(counts, confusion, CLASS_NAMES)
    assert s["ins_det_precision"] == pytest.approx(2 / 3) and s["ins_det_recall"] == pytest.approx(2 / 3)
    assert s["ins_det_f1"] == pytest.approx(2 / 3) and s["ins_det_mean_iou"] == pytest.approx(0.9)
    assert s["ins_det_fp"] == 1 and s["ins_det_fn_per_gt"] == pytest.approx(1 / 3)
    # classes of the matched pairs: muon right (P 1/2, R 1), proton wrong (P 0, R 0)
    assert s["ins_cls_macro_recall"] == pytest.approx(0.5) and s["ins_cls_macro_precision"] == pytest.approx(0.25)
    assert s["ins_cls_f1_muon"] == pytest.approx(2 / 3) and "ins_cls_f1_photon" not in s
    # PQ: one class-correct match (IoU 1), fp = fn = 1 -> RQ = 1 / 2, SQ = 1
    assert (s["ins_sq"], s["ins_rq"], s["ins_pq"]) == pytest.approx((1.0, 0.5, 0.5))
    _, _, class_aware = event_counts(gt, pr, gc, pc, 5, iou_thresh=0.5, require_class_for_match=True)
    assert class_aware == [(7, 0, 1.0)]


def test_adjusted_rand_score_known_values():
    assert adjusted_rand_score(np.array([0, 0, 1, 1]), np.array([5, 5, 3, 3])) == 1.0
    assert adjusted_rand_score(np.array([0, 0, 1, 1]), np.array([0, 0, 1, 2])) == pytest.approx(0.5714285714)
    assert adjusted_rand_score(np.array([0, 0, 0, 0]), np.array([0, 1, 2, 3])) == pytest.approx(0.0)


def test_evaluator_and_tester_build_with_upstreams_arguments():
    hook = HOOKS.build(dict(type="InstanceSegmentationEvaluator", every_n_steps=1000, stuff_classes=[5],
                            class_names={"particle": CLASS_NAMES}, labels=("particle", "interaction"),
                            primary_label="particle"))
    assert hook.metric_name == "particle/ins_det_f1" and hook.every_n_steps == 1000
    tester = TESTERS.build(dict(type="InstanceSegTester", class_names=CLASS_NAMES, stuff_classes=[5],
                                require_class_for_match=False, labels=("particle",)))
    assert tester.evaluator_cfg["type"] == "InstanceSegmentationEvaluator"
    assert HOOKS.build(dict(type="AttentionMaskAnnealingHook", log_frequency=100)).log_frequency == 100


# -- the model --------------------------------------------------------------------------
def detector_config(width: int = 8, **overrides) -> dict:
    criterion = dict(type="FastUnifiedInstanceLoss", cost_class=1.0, loss_weight_focal=2.0, loss_weight_dice=5.0,
                     cls_weight_noobj=0.5, num_points=100_000)
    cfg = dict(
        type="detector-v5", eval_label="particle",
        label_configs=dict(
            particle=dict(num_queries=16, num_classes=6, instance_key="instance_particle", segment_key="segment_pid",
                          stuff_classes=[5], criterion=criterion,
                          query_heads=[dict(name="momentum", use_class_logits=True, sentinel=-1.0),
                                       dict(name="momentum_vec", dim=3, use_class_logits=True, sentinel=-1.0,
                                            unit_normalize=True),
                                       dict(name="vertex", dim=3, sentinel=-1.0),
                                       dict(name="is_primary", kind="categorical", num_classes=2)]),
            interaction=dict(num_queries=4, num_classes=2, instance_key="instance_interaction",
                             segment_key="segment_interaction", stuff_classes=[0], criterion=criterion,
                             query_heads=[dict(name="vertex", dim=3, sentinel=-1.0)])),
        backbone=dict(type="PT-v3m2", in_channels=4, stride=(2,), enc_depths=(1, 1), enc_channels=(width, width),
                      enc_num_head=(1, 1), enc_patch_size=(32, 32), dec_depths=(1,), dec_channels=(width,),
                      dec_num_head=(1,), dec_patch_size=(32,), enc_mode=True),
        full_in_channels=2 * width, hidden_channels=16, num_heads=2, depth=2, mlp_point_proj=True,
        postprocess=dict(min_points=2, fill_uncovered=False))
    cfg.update(overrides)
    return cfg


def generated_batch(num_events: int = 2, seed: int = 0) -> dict:
    from pimm.datasets.collate import point_collate_fn
    from pimm.datasets.transforms import Compose

    keys = ("coord", "grid_coord", "segment_pid", "instance_particle", "segment_interaction", "instance_interaction",
            "momentum", "momentum_vec", "vertex", "is_primary")
    transform = Compose([
        dict(type="GridSample", grid_size=1.0, hash_type="fnv", mode="train", return_grid_coord=True),
        dict(type="NormalizeCoord", center=[384.0, 384.0, 384.0], scale=768.0 * 3 ** 0.5 / 2),
        dict(type="LogTransform", min_val=1.0e-2, max_val=20.0, keys=("energy",)),
        dict(type="MomentumTransform", keys=("momentum",)),
        dict(type="ToTensor"), dict(type="Collect", keys=keys, feat_keys=("coord", "energy"))])
    events = LArTPCSynthDataset(num_events=num_events, seed=seed, points_per_event=(300, 500))
    return point_collate_fn([transform(events[i]) for i in range(num_events)])


def test_model_trains_and_predicts_on_generated_events():
    torch.manual_seed(0)
    model = MODELS.build(detector_config())
    batch = generated_batch()
    out = model(batch)
    assert torch.isfinite(out["loss"]) and {"particle_loss", "particle_vertex", "interaction_stuff_loss"} <= set(out)
    out["loss"].backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert any(n.startswith("backbone.") for n in grads) and any("head_by_key.particle__vertex" in n for n in grads)
    model.eval()
    with torch.no_grad():
        pred = model(batch)
    n = batch["coord"].shape[0]
    assert pred["seg_logits"].shape == (n, 6) and pred["interaction_seg_logits"].shape == (n, 2)
    assert len(pred["pred_masks"]) == 2 and pred["pred_masks"][0].shape[0] == 16
    assert pred["pred_momentum_vec"][0].norm(dim=-1).tolist() == pytest.approx([1.0] * 16, abs=1e-5)
    fused = model.postprocess(pred, label="interaction", conf_threshold=0.0, mask_threshold=0.0)
    assert fused["instance_labels"].shape == (n,) and fused["pred_vertex"].shape == (n, 3)


@pytest.mark.parametrize("change, words", [
    (dict(point_filter=dict(type="stuff", treshold=0.4)), "point_filter: unknown key.*treshold"),
    (dict(eval_label="pion"), "eval_label"),
    (dict(full_in_channels=99), "full_in_channels=99"),
    (dict(postprocess=dict(nms_kernel="box")), "nms_kernel"),
    (dict(postprocess=dict(nms_sigmaa=2.0)), "nms_sigmaa"),
])
def test_bad_detector_settings_are_one_line(change, words):
    with pytest.raises(ConfigError, match=words):
        MODELS.build(detector_config(**change))


def test_bad_label_settings_are_one_line():
    cfg = detector_config()
    cfg["label_configs"]["particle"]["overlap"] = True
    with pytest.raises(UserError, match="overlap"):
        MODELS.build(cfg)
    cfg = detector_config()
    cfg["label_configs"]["particle"]["query_heads"][3] = dict(name="is_primary", kind="categorical")
    with pytest.raises(UserError, match="num_classes"):
        MODELS.build(cfg)
    cfg = detector_config()
    cfg["label_configs"]["interaction"]["num_querys"] = 3
    with pytest.raises(UserError, match="num_querys"):
        MODELS.build(cfg)


# -- the generator's truth ----------------------------------------------------------------
def test_generated_truth_is_consistent_per_particle_and_interaction():
    for event in (LArTPCSynthDataset(num_events=3, seed=4)[i] for i in range(3)):
        led = event["segment"] == 4
        assert (event["segment_pid"][led] == 5).all() and (event["instance_particle"][led] == -1).all()
        assert (event["momentum"][led] == -1).all() and (event["momentum_vec"][led] == -1).all()
        assert np.array_equal(event["instance_particle"], event["instance"])
        for i in np.unique(event["instance"][~led]):
            part = event["instance"] == i
            for key in ("segment_pid", "momentum", "momentum_vec", "vertex", "is_primary", "interaction"):
                assert (event[key][part] == event[key][part][0]).all(), key
            assert event["momentum"][part][0, 0] > 0
            assert np.linalg.norm(event["momentum_vec"][part][0]) == pytest.approx(1.0, abs=1e-6)
        inside = event["interaction"] >= 0
        for k in np.unique(event["interaction"][inside]):  # one vertex per interaction
            assert len(np.unique(event["vertex"][event["interaction"] == k], axis=0)) == 1
        assert (event["segment_interaction"] == inside).all()
        tracks = event["segment"] == 1
        assert set(np.unique(event["segment_pid"][tracks])) <= {2, 4} and (event["is_primary"][tracks] == 1).all()
        assert (event["is_primary"][(event["segment"] == 2) | (event["segment"] == 3)] == 0).all()  # Michel, delta


def test_truth_round_trips_through_a_pilarnet_v3_file(tmp_path):
    from pimm.datasets.pilarnet import PILArNetH5Dataset, write_pilarnet_h5

    events = [LArTPCSynthDataset(num_events=2, seed=5)[i] for i in range(2)]
    (tmp_path / "train").mkdir()
    write_pilarnet_h5(events, tmp_path / "train" / "e.h5", revision="v3")
    read = PILArNetH5Dataset(str(tmp_path), split="train", revision="v3", min_points=0)
    for i, event in enumerate(events):
        got = read[i]
        np.testing.assert_array_equal(got["coord"], event["coord"])  # generated events are stored in file order
        for key in ("segment_pid", "instance_particle", "is_primary", "segment_interaction"):
            np.testing.assert_array_equal(np.asarray(got[key]).reshape(-1), event[key].reshape(-1), err_msg=key)
        for key in ("momentum", "vertex", "momentum_vec"):
            np.testing.assert_allclose(got[key], event[key], atol=1e-6, err_msg=key)


@pytest.mark.slow  # 100 optimizer steps of the model (about a minute on 2 cores)
def test_model_fits_one_batch_masks_and_query_heads_included():
    """Overfitting one batch of two generated events: the total loss and every
    query head's loss fall (the heads see their targets through the matching)."""
    torch.manual_seed(0)
    model = MODELS.build(detector_config(width=16))
    batch = generated_batch(2, seed=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    keys = ("loss", "particle_momentum", "particle_momentum_vec", "particle_vertex", "interaction_vertex")
    history = []
    for _ in range(101):
        out = model(batch)
        history.append({k: float(out[k].detach()) for k in keys})
        optimizer.zero_grad()
        out["loss"].backward()
        optimizer.step()
    first, last = history[0], history[-1]
    assert last["loss"] < 0.5 * first["loss"]
    assert last["particle_momentum"] < 0.2 * first["particle_momentum"]
    assert last["particle_momentum_vec"] < 0.6 * first["particle_momentum_vec"]
    assert last["particle_vertex"] < 0.8 * first["particle_vertex"]
