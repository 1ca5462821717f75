"""The GRPO objective (pimm.models.grpo.objective) against hand-computed numbers,
and the invariance of its gradient to micro-batching and to the number of ranks."""

from __future__ import annotations

import math

import pytest
import torch

from pimm.models.grpo.objective import (GRPOObjective, RolloutTotals, aggregate, clipped_surrogate, group_advantages,
                                        k3_kl, rollout_metrics)
from pimm.utils.errors import ConfigError

SQRT3 = math.sqrt(3.0)


# -- advantages -----------------------------------------------------------------------
def test_group_advantages_by_hand():
    # group 0: rewards 1 0 0 1 -> mean 1/2, sample std sqrt((4 * 1/4) / 3) = 1/sqrt(3): +-sqrt(3)/2
    # group 1: 2 nan 2 4 -> the nan is left out: mean 8/3, std sqrt((4/9 + 4/9 + 16/9) / 2) = 2/sqrt(3)
    # group 2: 3 3 -> no spread, all 0
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, float("nan"), 2.0, 4.0, 3.0, 3.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
    adv = group_advantages(rewards, groups, "group", eps=0.0)
    half = SQRT3 / 2
    expected = [half, -half, -half, half, -(2 / 3) * SQRT3 / 2, 0.0, -(2 / 3) * SQRT3 / 2, (4 / 3) * SQRT3 / 2, 0, 0]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6)
    assert torch.isfinite(adv).all()


def test_advantage_scaling_batch_and_none():
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    # none: only centred on the group mean (0.5 and 4)
    assert torch.allclose(group_advantages(rewards, groups, "none"), torch.tensor([0.5, -0.5, -1.0, 1.0]))
    # batch: divided by the std of all rewards: mean 9/4, squared deviations sum to 59/4 -> std sqrt(59/12)
    batch_std = math.sqrt(59.0 / 12.0)
    expected = torch.tensor([0.5, -0.5, -1.0, 1.0]) / batch_std
    assert torch.allclose(group_advantages(rewards, groups, "batch", eps=0.0), expected, atol=1e-6)
    with pytest.raises(ConfigError, match="scale_rewards"):
        group_advantages(rewards, groups, "rank")


def test_single_valid_reward_or_all_nan_gives_zero_advantage():
    rewards = torch.tensor([float("nan"), 0.7, float("nan"), float("nan")])
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]), "group")
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0]


# -- clipping and KL ------------------------------------------------------------------------
def test_clipped_surrogate_by_hand():
    ratios = torch.tensor([0.5, 0.9, 1.0, 1.1, 1.5])
    old = torch.zeros(2, 5)
    logp = torch.log(ratios).repeat(2, 1).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0])
    objective, ratio, low, high = clipped_surrogate(logp, old, adv, epsilon=0.2, epsilon_high=0.28)
    assert torch.allclose(ratio, ratios.repeat(2, 1))
    # A > 0: min(r, clip(r, 0.8, 1.28)) ; A < 0: min(-r, -clip(r, 0.8, 1.28))
    assert torch.allclose(objective[0], torch.tensor([0.5, 0.9, 1.0, 1.1, 1.28]))
    assert torch.allclose(objective[1], torch.tensor([-0.8, -0.9, -1.0, -1.1, -1.5]))
    assert low.tolist() == [[False] * 5, [True, False, False, False, False]]
    assert high.tolist() == [[False, False, False, False, True], [False] * 5]
    objective.sum().backward()
    # d(r A)/dlogp = r A where unclipped; 0 where the clip is active
    assert torch.allclose(logp.grad, torch.tensor([[0.5, 0.9, 1.0, 1.1, 0.0], [0.0, -0.9, -1.0, -1.1, -1.5]]))


def test_symmetric_clip_when_epsilon_high_is_none():
    objective, _, _, high = clipped_surrogate(torch.log(torch.tensor([[1.25]])), torch.zeros(1, 1),
                                              torch.tensor([1.0]), epsilon=0.2)
    assert objective.item() == pytest.approx(1.2) and high.item()


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([0.5, 0.5, 0.25]))
    ref = torch.log(torch.tensor([0.25, 0.5, 0.5]))
    # ref - logp = -ln 2, 0, ln 2  ->  e^d - d - 1 = 0.5 + ln2 - 1, 0, 2 - ln2 - 1
    ln2 = math.log(2.0)
    assert torch.allclose(k3_kl(logp, ref), torch.tensor([ln2 - 0.5, 0.0, 1.0 - ln2]), atol=1e-7)


# -- aggregation ----------------------------------------------------------------------------
def test_aggregation_normalisers_by_hand():
    per_step = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])  # the 9s are padding
    mask = torch.tensor([[True, True, False], [True, False, False]])
    totals = RolloutTotals.of_mask(mask)
    assert (totals.trajectories, totals.steps, totals.max_length) == (2.0, 3.0, 2.0)
    assert aggregate(per_step, mask, "grpo", totals).item() == pytest.approx((3 / 2 + 3 / 1) / 2)
    assert aggregate(per_step, mask, "dr_grpo", totals).item() == pytest.approx(6 / (2 * 2))
    assert aggregate(per_step, mask, "dapo", totals).item() == pytest.approx(6 / 3)


def _random_rollout(seed: int, num: int = 24, steps: int = 5):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, steps + 1, (num,), generator=gen)
    mask = torch.arange(steps)[None, :] < lengths[:, None]
    old = -torch.rand(num, steps, generator=gen) * 3
    ref = old + 0.3 * torch.randn(num, steps, generator=gen)
    rewards = torch.rand(num, generator=gen)
    groups = torch.arange(num) // 6
    theta = (old + 0.4 * torch.randn(num, steps, generator=gen)).requires_grad_(True)  # a stale policy
    entropy_base = torch.rand(num, steps, generator=gen)
    return dict(theta=theta, old=old, ref=ref, mask=mask, adv=group_advantages(rewards, groups), entropy=entropy_base)


def _grad(objective: GRPOObjective, r: dict, chunks: list[slice], totals_of) -> torch.Tensor:
    """Accumulated gradient over micro-batches, each normalised by ``totals_of(chunk)``."""
    theta = r["theta"]
    theta.grad = None
    for chunk in chunks:
        logp = theta[chunk]
        loss, _ = objective.loss(logp, r["old"][chunk], r["adv"][chunk], r["mask"][chunk], totals_of(chunk),
                                 ref_logp=r["ref"][chunk], entropy=r["entropy"][chunk] * logp.exp())
        loss.backward()
    return theta.grad.clone()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_gradient_is_micro_batch_invariant(loss_type):
    objective = GRPOObjective(epsilon=0.2, epsilon_high=0.28, beta=0.04, loss_type=loss_type, entropy_coef=0.01)
    r = _random_rollout(0)
    whole = RolloutTotals.of_mask(r["mask"])
    full = _grad(objective, r, [slice(0, 24)], lambda c: whole)
    assert full.abs().sum() > 0
    uneven = [slice(0, 5), slice(5, 13), slice(13, 14), slice(14, 24)]
    split = _grad(objective, r, uneven, lambda c: whole)
    assert torch.allclose(split, full, rtol=1e-5, atol=1e-7)
    # A per-micro-batch normaliser ("bnpo") is what the global totals avoid:
    # the same split with local totals gives another gradient.
    local = _grad(objective, r, uneven, lambda c: RolloutTotals.of_mask(r["mask"][c]))
    assert not torch.allclose(local, full, rtol=1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_mean_over_ranks_of_rank_shares_is_the_global_gradient(loss_type):
    """What DDP computes: each rank's gradient with the global totals and world
    size 2, averaged, equals the single-process gradient of the whole rollout."""
    objective = GRPOObjective(beta=0.04, loss_type=loss_type)
    r = _random_rollout(1)
    whole = RolloutTotals.of_mask(r["mask"])
    shared = RolloutTotals(whole.trajectories, whole.steps, whole.max_length, world_size=2)
    full = _grad(objective, r, [slice(0, 24)], lambda c: whole)
    rank0 = _grad(objective, r, [slice(0, 12)], lambda c: shared)
    rank1 = _grad(objective, r, [slice(12, 24)], lambda c: shared)
    assert torch.allclose((rank0 + rank1) / 2, full, rtol=1e-5, atol=1e-7)


def test_loss_metrics_and_ratio_one_at_the_first_update():
    objective = GRPOObjective(epsilon=0.2, epsilon_high=0.28, beta=0.1)
    r = _random_rollout(2)
    logp = r["old"].clone().requires_grad_(True)  # the sampling policy itself: ratio exactly 1
    loss, metrics = objective.loss(logp, r["old"], r["adv"], r["mask"], RolloutTotals.of_mask(r["mask"]),
                                   ref_logp=r["ref"], entropy=r["entropy"])
    kl = k3_kl(r["old"], r["ref"])[r["mask"]].mean()
    assert metrics["kl"].item() == pytest.approx(kl.item(), rel=1e-6)
    assert metrics["ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["clip_frac"].item() == 0.0
    assert metrics["entropy"].item() == pytest.approx(r["entropy"][r["mask"]].mean().item(), rel=1e-6)
    # The surrogate's value is mean(A) over steps (tiny); its gradient is not.
    loss.backward()
    assert logp.grad.abs().sum() > 0


def test_rollout_metrics():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, float("nan"), 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]]).bool()
    m = rollout_metrics(rewards, groups, mask)
    assert m["reward_mean"].item() == pytest.approx(3.0 / 5)
    assert m["reward_nan_frac"].item() == pytest.approx(1 / 6)
    # groups 1 (0.5, 0.5) and 2 (one finite reward) carry no signal
    assert m["zero_spread_frac"].item() == pytest.approx(2 / 3)
    assert (m["length_min"].item(), m["length_max"].item()) == (1.0, 3.0)
    assert m["length_mean"].item() == pytest.approx(12 / 6)


@pytest.mark.parametrize("options,match", [
    (dict(epsilon=0.0), "epsilon"), (dict(epsilon_high=-0.1), "epsilon_high"), (dict(beta=-1), "beta"),
    (dict(loss_type="bnpo"), "depends on the split"), (dict(scale_rewards="rank"), "scale_rewards"),
    (dict(entropy_coef="x"), "entropy_coef"), (dict(epsilom=0.2), "unknown option"),
])
def test_bad_objective_options_are_config_errors(options, match):
    with pytest.raises(ConfigError, match=match):
        GRPOObjective.from_config(options)
