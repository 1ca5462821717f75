"""Task 1 pieces: the straight-tracks data set, proposal matching and F1, the
track-proposal policy's GRPO contract, its frozen reference and ProposalEvaluator."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pimm.datasets.collate import collate_fn
from pimm.datasets.tracks import StraightTracksDataset
from pimm.engines.trainers.grpo import split_rollout
from pimm.evaluation.proposal import ProposalEvaluator, count_matches, f1_scores, match_proposals
from pimm.models.grpo import TrackProposalPolicy
from pimm.utils.errors import ConfigError, UserError

DEG = math.pi / 180


def _batch(num: int = 6, split: str = "train", seed: int = 0) -> dict:
    dataset = StraightTracksDataset(num_events=num, split=split, seed=seed)
    return collate_fn([dataset[i] for i in range(num)])


# -- data -----------------------------------------------------------------------------
def test_events_depend_only_on_seed_split_and_index():
    a = StraightTracksDataset(num_events=20, seed=3)
    b = StraightTracksDataset(num_events=20, seed=3)
    for i in (7, 0, 19):  # any access order
        assert all(np.array_equal(a[i][k], b[i][k]) for k in a[i])
    assert not np.array_equal(a[5]["coord"], StraightTracksDataset(num_events=20, seed=3, split="val")[5]["coord"])
    assert not np.array_equal(a[5]["coord"], StraightTracksDataset(num_events=20, seed=4)[5]["coord"])


def test_event_content_matches_its_truth():
    dataset = StraightTracksDataset(num_events=200, noise_hits=(5, 5))
    muon_dedx, proton_dedx = [], []
    for i in range(200):
        event = dataset[i]
        classes = event["track_class"][0]
        count = int((classes >= 0).sum())
        assert 1 <= count <= 3 and (classes[count:] == -1).all()
        assert len(event["coord"]) == 12 * count + 5 and (event["coord"][:, 2] == 0).all()
        angles = event["track_angle"][0, :count]
        for track in range(count):
            hits = event["instance"] == track
            assert hits.sum() == 12
            phi = np.arctan2(event["coord"][hits, 1], event["coord"][hits, 0])
            spread = np.abs((phi - angles[track] + np.pi) % (2 * np.pi) - np.pi)
            assert spread.max() < 0.1  # 0.02 rad angular noise
            assert (event["segment"][hits] == 1 + classes[track]).all()
            (proton_dedx if classes[track] == 1 else muon_dedx).append(event["feat"][hits, 0].mean())
        gaps = np.abs((angles[:, None] - angles[None, :] + np.pi) % (2 * np.pi) - np.pi) + np.eye(count) * 10
        assert gaps.min() >= 30 * DEG - 1e-6
    assert min(proton_dedx) > max(muon_dedx)  # dE/dx tells the types apart


@pytest.mark.parametrize("options,match", [
    (dict(num_tracks=(1, 4)), "at most 3"), (dict(num_tracks=(2, 1)), "num_tracks"),
    (dict(split="dev"), "split"), (dict(hits_per_track=1), "hits_per_track"),
    (dict(min_separation_deg=150, num_tracks=(1, 3)), "leave room"), (dict(angle_noise=-1), "angle_noise"),
])
def test_bad_data_set_options(options, match):
    with pytest.raises(UserError, match=match):
        StraightTracksDataset(**options)


# -- matching -----------------------------------------------------------------------------
def test_matching_is_one_to_one_and_maximum():
    # Row 0: two proposals on track 0 -> 1 match. Row 1: proposal 0 may take track
    # 0 or 1, proposal 1 only track 0 -> a maximum matching pairs both (greedy could not).
    match = torch.tensor([[[1, 0], [1, 0]], [[1, 1], [1, 0]]], dtype=torch.bool)
    assert count_matches(match).tolist() == [1, 2]


def test_match_proposals_by_hand():
    true_angle = torch.tensor([[10 * DEG, 100 * DEG, 0.0]])
    true_class = torch.tensor([[0, 1, -1]])
    pred_angle = torch.tensor([[17 * DEG, 355 * DEG, 95 * DEG, 100 * DEG]])
    pred_class = torch.tensor([[0, 0, 0, 1]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    # 17 vs 10 degrees: match (7 < 10); 355 vs 10 wraps to 15 degrees: no; 95 is class 0: no; 100/class 1: match
    tp = match_proposals(pred_angle, pred_class, valid, true_angle, true_class, true_class >= 0, 10 * DEG)
    assert tp.tolist() == [2]
    assert match_proposals(pred_angle, pred_class, valid, true_angle, true_class, true_class >= 0, 10 * DEG,
                           use_class=False).tolist() == [2]  # 95 degrees would match track 1, already taken
    assert f1_scores(tp, valid.sum(1), torch.tensor([2])).tolist() == [pytest.approx(2 * 2 / 6)]
    assert f1_scores(torch.tensor([0]), torch.tensor([0]), torch.tensor([0])).tolist() == [1.0]


def test_proposal_evaluator_scores_greedy_proposals():
    evaluator = ProposalEvaluator(angle_tolerance_deg=10)
    evaluator.trainer = SimpleNamespace(device=torch.device("cpu"))
    evaluator.reset()
    batch = {"track_angle": torch.tensor([[0.5, 2.0, 0.0], [1.0, 0.0, 0.0]]),
             "track_class": torch.tensor([[0, 1, -1], [1, -1, -1]])}
    output = {"proposal_angle": torch.tensor([[0.5, 2.0], [1.0, 3.0]]),
              "proposal_class": torch.tensor([[0, 0], [1, 1]]),
              "proposal_valid": torch.tensor([[True, True], [True, False]])}
    evaluator.process(batch, output)
    metrics = evaluator.compute(evaluator.accumulators())
    # event 0: one of two right (2.0 has the wrong class): F1 1/2; event 1: perfect
    assert metrics["f1"] == pytest.approx((0.5 + 1.0) / 2)
    assert metrics["direction_f1"] == pytest.approx(1.0)
    assert metrics["precision"] == pytest.approx(2 / 3) and metrics["recall"] == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match="angle_tolerance_deg"):
        ProposalEvaluator(angle_tolerance_deg=0)


# -- the policy -------------------------------------------------------------------------------
def _policy(**options) -> TrackProposalPolicy:
    torch.manual_seed(0)
    return TrackProposalPolicy(**{"grpo": dict(beta=0.04, epsilon_high=0.28), **options})


def test_rollout_follows_the_contract():
    model, batch = _policy(), _batch(6)
    torch.manual_seed(1)
    rollout = model.sample_grpo_batch(batch)
    traj = rollout["trajectories"]
    assert traj["actions"].shape == traj["action_mask"].shape == traj["old_logp"].shape == (48, 4)
    assert traj["event_index"].tolist() == [e for e in range(6) for _ in range(8)]
    mask, actions = traj["action_mask"], traj["actions"]
    lengths = mask.sum(1)
    for row in range(48):
        taken = actions[row, : lengths[row]].tolist()
        assert mask[row, : lengths[row]].all() and not mask[row, lengths[row]:].any()
        picks = [a for a in taken if a > 0]
        assert len(picks) == len(set(picks))  # a pair is proposed at most once
        assert taken[:-1] == picks[: len(taken) - 1]  # STOP only as the last step
        assert len(picks) == 4 or taken[-1] == 0  # ends with STOP or at max_proposals
    # rewards are the F1 of the decoded proposals
    angle, classes, valid = model._decode(actions, mask)
    tc = batch["track_class"][traj["event_index"]]
    tp = match_proposals(angle, classes, valid, batch["track_angle"][traj["event_index"]], tc, tc >= 0,
                         10 * DEG)
    assert torch.allclose(traj["rewards"], f1_scores(tp, valid.sum(1), (tc >= 0).sum(1)).float())
    assert torch.allclose(traj["advantages"], model.objective.advantages(traj["rewards"], traj["event_index"]))
    # the reference is the policy itself at the first rollout: zero KL
    assert torch.allclose(traj["ref_logp"], traj["old_logp"])
    out = model.grpo_loss_from_batch(rollout)
    assert out["ratio_mean"].item() == pytest.approx(1.0, abs=1e-6)
    assert out["kl"].item() == pytest.approx(0.0, abs=1e-6)
    assert 0 < out["entropy"].item() <= math.log(model.num_actions)


def test_model_gradient_is_micro_batch_invariant():
    model, batch = _policy(), _batch(6)
    torch.manual_seed(2)
    rollout = model.sample_grpo_batch(batch)
    rollout["totals"] = {"trajectories": 48, "steps": float(rollout["trajectories"]["action_mask"].sum()),
                         "max_length": float(rollout["trajectories"]["action_mask"].sum(1).max()), "world_size": 1}
    with torch.no_grad():  # a stale policy, so the clip and the KL are active
        for p in model.policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = list(model.policy.parameters())

    def gradient(size):
        for p in params:
            p.grad = None
        for micro in split_rollout(rollout, size):
            model.grpo_loss_from_batch(micro)["loss"].backward()
        return torch.cat([p.grad.flatten() for p in params])

    full = gradient(None)
    assert full.abs().sum() > 0
    assert len(split_rollout(rollout, 11)) == 5  # 48 trajectories, groups cut across micro-batches
    assert torch.allclose(gradient(11), full, rtol=1e-4, atol=1e-7)


def test_reference_is_the_policy_grpo_starts_from_and_stays_frozen():
    model, batch = _policy(), _batch(4)
    warm = _policy(stop_bias=-1.0)  # stands for weights loaded with weight=... after the model was built
    model.load_state_dict({k: v for k, v in warm.state_dict().items() if k.startswith("policy.")}, strict=False)
    start = {k: v.clone() for k, v in model.policy.state_dict().items()}
    assert not model.reference.taken
    model.sample_grpo_batch(batch)
    assert model.reference.taken
    assert all(torch.equal(model.reference.network.state_dict()[k], v) for k, v in start.items())
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.1)
    assert not any(p.requires_grad for p in model.reference.parameters())
    model.grpo_loss_from_batch(model.sample_grpo_batch(batch))["loss"].backward()
    optimizer.step()
    model.sample_grpo_batch(batch)  # a later rollout does not re-take the snapshot
    assert all(torch.equal(model.reference.network.state_dict()[k], v) for k, v in start.items())
    assert not all(torch.equal(model.policy.state_dict()[k], v) for k, v in start.items())
    # the reference is part of the checkpointed state, and restores
    state = model.state_dict()
    assert "reference.taken" in state and "reference.network.stop_head.bias" in state
    fresh = _policy()
    fresh.load_state_dict(state)
    assert fresh.reference.taken and torch.equal(fresh.reference.network.stop_head.bias,
                                                 start["stop_head.bias"])
    assert _policy(grpo=dict(beta=0.0)).reference is None  # no copy without a KL term


def test_greedy_forward_proposes_pairs_that_beat_stop():
    model, batch = _policy(), _batch(5)
    with torch.no_grad():
        model.policy.stop_head.bias.fill_(-100.0)  # every pair beats STOP: max_proposals each
    out = model(batch)
    assert out["proposal_valid"].sum(1).tolist() == [4] * 5
    with torch.no_grad():
        model.policy.stop_head.bias.fill_(100.0)
    assert model(batch)["proposal_valid"].sum().item() == 0
    logits = out["logits"]
    best = logits[:, 1:].argmax(1)
    assert torch.allclose(out["proposal_angle"][:, 0], ((best // 2).float() + 0.5) * (2 * math.pi / 24))


def test_bad_policy_options_and_batches():
    with pytest.raises(ConfigError, match="num_generations"):
        TrackProposalPolicy(num_generations=1)
    with pytest.raises(ConfigError, match="max_proposals"):
        TrackProposalPolicy(num_direction_bins=2, num_classes=1, max_proposals=3)
    with pytest.raises(ConfigError, match="loss_type"):
        TrackProposalPolicy(grpo=dict(loss_type="ppo"))
    with pytest.raises(UserError, match="track_angle"):
        TrackProposalPolicy().sample_grpo_batch({k: v for k, v in _batch(2).items() if k != "track_angle"})
