"""The GRPO objective as plain tensor functions, reusable by any policy model.

GRPO (Group Relative Policy Optimisation, DeepSeekMath, arXiv 2402.03300)
samples G trajectories per event from the policy, scores each with a reward,
and uses the reward relative to the event's group as the advantage of every
step of the trajectory. Per step, with ``ratio = exp(logp - old_logp)``::

    objective = min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A)
                - beta * KL_k3(policy || reference)

and the loss is minus the aggregated objective (minus an optional entropy
bonus). Nothing here knows about a model: a policy passes log-probabilities
``(T, L)`` of its T trajectories' L steps, an ``action_mask`` ``(T, L)`` of
the steps that happened, and per-trajectory advantages ``(T,)``.

Micro-batch and multi-process invariance
----------------------------------------
A rollout may be split by whole trajectories into micro-batches whose
gradients are accumulated, and it is spread over ranks whose gradients DDP
averages. Every additive quantity (the loss and the step/trajectory means
among the metrics) is therefore a *sum over the micro-batch's own terms*
divided by a normaliser counted over the **whole rollout on all ranks**
(:class:`RolloutTotals`) and multiplied by the world size: summing the
micro-batches gives the rank's share, and DDP's mean over ranks gives the
global value exactly. A per-micro-batch mean ("bnpo") is not invariant and is
deliberately not offered.

=========  ==============================================================
loss_type  normaliser of the summed per-step terms
=========  ==============================================================
grpo       each trajectory's steps are averaged, then trajectories are
           averaged: sum_i (sum_t x_it / len_i) / trajectories
dr_grpo    trajectories x the longest trajectory (Dr. GRPO, arXiv 2503.20783)
dapo       active steps of the whole rollout (DAPO, arXiv 2503.14476)
=========  ==============================================================

Advantages are computed on whole groups before any split (``scale_rewards``:
``group`` divides by the group's reward std, ``batch`` by the std of all
rewards of the rollout, ``none`` only centres, as in Dr. GRPO). A non-finite
reward (an unscorable trajectory) gets advantage 0 and is left out of its
group's statistics, so it neither learns nor poisons the batch.

Written here rather than taken from TRL or verl: both tie the objective to
language-model batches (token ids, attention masks, their own trainers); the
formulas are short, and owning them lets the normalisers be global.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pimm.utils.errors import ConfigError
from pimm.utils.domains import Choice, Real, Rule

__all__ = ["GRPOObjective", "RolloutTotals", "group_advantages", "k3_kl", "clipped_surrogate", "aggregate",
           "step_mean", "rollout_metrics", "SCALE_REWARDS", "LOSS_TYPES"]

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


# -- normalisers ----------------------------------------------------------------
@dataclass(frozen=True)
class RolloutTotals:
    """Counts over the whole rollout on all ranks, fixed before any split.

    ``trajectories`` and ``steps`` are summed over ranks, ``max_length`` is the
    longest trajectory on any rank; ``world_size`` scales each rank's share so
    that DDP's gradient mean becomes the global normalisation."""

    trajectories: float
    steps: float
    max_length: float
    world_size: int = 1

    @classmethod
    def of_mask(cls, action_mask: torch.Tensor) -> "RolloutTotals":
        """Totals of a single-process, unsplit rollout."""
        mask = action_mask.bool()
        return cls(trajectories=float(mask.shape[0]), steps=float(mask.sum()),
                   max_length=float(mask.sum(1).max()) if mask.numel() else 0.0)

    @classmethod
    def of_rollout(cls, rollout: dict) -> "RolloutTotals":
        """The totals the trainer attached (``rollout["totals"]``), else the
        rollout's own (a model used without GRPOTrainer, one process, no split)."""
        totals = rollout.get("totals")
        if totals is None:
            return cls.of_mask(rollout["trajectories"]["action_mask"])
        return cls(trajectories=float(totals["trajectories"]), steps=float(totals["steps"]),
                   max_length=float(totals["max_length"]), world_size=int(totals.get("world_size", 1)))


def _share(total: float, world_size: int) -> float:
    # max(.., 1): an empty rollout (no active step anywhere) gives a zero loss, not nan.
    return max(total, 1.0) / world_size


def aggregate(per_step: torch.Tensor, action_mask: torch.Tensor, loss_type: str,
              totals: RolloutTotals) -> torch.Tensor:
    """Aggregate ``(T, L)`` per-step terms into this micro-batch's additive share
    (see the module docstring for the normalisers)."""
    mask = action_mask.to(per_step.dtype)
    masked = per_step * mask
    if loss_type == "grpo":
        lengths = mask.sum(1).clamp(min=1.0)
        return (masked.sum(1) / lengths).sum() / _share(totals.trajectories, totals.world_size)
    if loss_type == "dr_grpo":
        return masked.sum() / _share(totals.trajectories * totals.max_length, totals.world_size)
    if loss_type == "dapo":
        return masked.sum() / _share(totals.steps, totals.world_size)
    raise ConfigError(f"loss_type={loss_type!r} is not supported; use one of {', '.join(LOSS_TYPES)}")


def step_mean(per_step: torch.Tensor, action_mask: torch.Tensor, totals: RolloutTotals) -> torch.Tensor:
    """The micro-batch's share of the mean over all active steps (a metric)."""
    return aggregate(per_step, action_mask, "dapo", totals)


# -- the terms --------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, scale: str = "group",
                     eps: float = 1e-4, num_groups: int | None = None) -> torch.Tensor:
    """Per-trajectory advantages ``(T,)`` from rewards ``(T,)`` and the group
    (event) index of each trajectory.

    ``group``: ``(r - mean_g) / (std_g + eps)``; ``batch``: divided by the std of
    all finite rewards instead; ``none``: ``r - mean_g``. Stds are the unbiased
    sample std (as in TRL). Non-finite rewards get 0 and are left out of the
    statistics; a group whose rewards are all equal gets 0 everywhere."""
    if scale not in SCALE_REWARDS:
        raise ConfigError(f"scale_rewards={scale!r} is not supported; use one of {', '.join(SCALE_REWARDS)}")
    rewards = rewards.double()
    group_index = group_index.long()
    groups = int(group_index.max()) + 1 if num_groups is None and group_index.numel() else (num_groups or 0)
    valid = torch.isfinite(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    weight = valid.double()
    count = torch.zeros(groups, dtype=torch.float64, device=r.device).index_add_(0, group_index, weight)
    total = torch.zeros_like(count).index_add_(0, group_index, r)
    mean = total / count.clamp(min=1.0)
    centred = (r - mean[group_index]) * weight
    if scale == "group":
        sq = torch.zeros_like(count).index_add_(0, group_index, centred * centred)
        scale_by = (sq / (count - 1.0).clamp(min=1.0)).sqrt()[group_index] + eps
    elif scale == "batch":
        finite = rewards[valid]
        std = finite.std() if finite.numel() > 1 else torch.zeros((), dtype=torch.float64, device=r.device)
        scale_by = (std + eps).expand_as(centred)
    else:
        scale_by = torch.ones_like(centred)
    # A group without spread is centred to exactly 0; keep it 0 even when eps = 0.
    advantages = torch.where(scale_by > 0, centred / scale_by.clamp(min=torch.finfo(torch.float64).tiny),
                             torch.zeros_like(centred))
    return advantages.to(torch.float32)


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-step k3 estimate of KL(policy || reference) from the sampled action's
    log-probabilities: ``exp(ref - logp) - (ref - logp) - 1`` (always >= 0,
    unbiased for actions sampled from the policy)."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1.0


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                      epsilon: float, epsilon_high: float | None = None):
    """PPO's clipped surrogate per step. ``advantages`` is ``(T,)`` (one per
    trajectory) or already ``(T, L)``.

    Returns ``(objective, ratio, clipped_low, clipped_high)``: ``clipped_low``
    marks steps with ``ratio < 1 - epsilon`` and a negative advantage,
    ``clipped_high`` those with ``ratio > 1 + epsilon_high`` and a positive
    one: the steps whose gradient the clip removes."""
    high = epsilon if epsilon_high is None else epsilon_high
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    ratio = torch.exp(logp - old_logp)
    clipped = ratio.clamp(1.0 - epsilon, 1.0 + high)
    objective = torch.minimum(ratio * advantages, clipped * advantages)
    clipped_low = (ratio < 1.0 - epsilon) & (advantages < 0)
    clipped_high = (ratio > 1.0 + high) & (advantages > 0)
    return objective, ratio, clipped_low, clipped_high


def rollout_metrics(rewards: torch.Tensor, group_index: torch.Tensor, action_mask: torch.Tensor) -> dict:
    """Scalar metrics of a sampled rollout (this rank's): ``reward_mean``,
    ``reward_std``, ``reward_nan_frac``, ``zero_spread_frac`` (share of groups
    whose finite rewards are all equal: no learning signal), ``length_mean``,
    ``length_min``, ``length_max`` (steps per trajectory)."""
    rewards = rewards.double()
    valid = torch.isfinite(rewards)
    finite = rewards[valid]
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=rewards.device)
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    big = torch.finfo(torch.float64).max
    high = torch.full((groups,), -big, dtype=torch.float64, device=rewards.device)
    low = torch.full((groups,), big, dtype=torch.float64, device=rewards.device)
    high = high.scatter_reduce(0, group_index[valid], finite, "amax")
    low = low.scatter_reduce(0, group_index[valid], finite, "amin")
    lengths = action_mask.sum(1).double()
    return {
        "reward_mean": finite.mean() if finite.numel() else nan,
        "reward_std": finite.std() if finite.numel() > 1 else nan,
        "reward_nan_frac": (~valid).double().mean() if valid.numel() else nan,
        "zero_spread_frac": (high <= low).double().mean() if groups else nan,
        "length_mean": lengths.mean() if lengths.numel() else nan,
        "length_min": lengths.min() if lengths.numel() else nan,
        "length_max": lengths.max() if lengths.numel() else nan,
    }


# -- the configured objective ----------------------------------------------------------
def _number(name: str, value, low: float, high: float = math.inf, low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"GRPO objective: {name}={value!r} must be a finite number")
    if value < low or value > high or (low_open and value == low):
        bound = f"{'>' if low_open else '>='} {low}" + (f" and <= {high}" if high != math.inf else "")
        raise ConfigError(f"GRPO objective: {name}={value!r} must be {bound}")
    return float(value)


class GRPOObjective:
    """The GRPO loss with its settings (a model builds it from its ``grpo=dict(...)``).

    Args:
        epsilon: lower clip range (ratio >= 1 - epsilon); 0.2 as in PPO.
        epsilon_high: upper clip range; None = ``epsilon``; DAPO's "clip-higher" uses 0.28.
        beta: weight of the k3 KL to the frozen reference policy; 0 = no KL and
            no reference copy at all.
        scale_rewards: ``group``, ``batch`` or ``none`` (see :func:`group_advantages`).
        loss_type: ``grpo``, ``dr_grpo`` or ``dapo`` (see the module docstring).
        entropy_coef: weight of the entropy bonus (subtracted from the loss).
        advantage_eps: added to the std before dividing.
    """

    domains = dict(epsilon=Real(0, 1, lo_open=True), epsilon_high=Real(0, 10, lo_open=True) | None, beta=Real(0, 100),
                   scale_rewards=Choice(*SCALE_REWARDS), loss_type=Choice(*LOSS_TYPES), entropy_coef=Real(0, 100),
                   advantage_eps=Real(0, 1))
    domain_rules = (Rule(lambda a: a.epsilon_high is None or a.epsilon_high >= a.epsilon, "epsilon_high",
                         "a value >= epsilon (the clip range is [1 - epsilon, 1 + epsilon_high])"),)

    def __init__(self, epsilon: float = 0.2, epsilon_high: float | None = None, beta: float = 0.0,
                 scale_rewards: str = "group", loss_type: str = "dapo", entropy_coef: float = 0.0,
                 advantage_eps: float = 1e-4):
        self.epsilon = _number("epsilon", epsilon, 0.0, 1.0, low_open=True)
        self.epsilon_high = None if epsilon_high is None else _number("epsilon_high", epsilon_high, 0.0,
                                                                      low_open=True)
        self.beta = _number("beta", beta, 0.0)
        if scale_rewards not in SCALE_REWARDS:
            raise ConfigError(f"GRPO objective: scale_rewards={scale_rewards!r} is not supported; "
                              f"use one of {', '.join(SCALE_REWARDS)}")
        if loss_type not in LOSS_TYPES:
            hint = " (bnpo's per-micro-batch mean depends on the split; use dapo)" if loss_type == "bnpo" else ""
            raise ConfigError(f"GRPO objective: loss_type={loss_type!r} is not supported; "
                              f"use one of {', '.join(LOSS_TYPES)}{hint}")
        self.scale_rewards, self.loss_type = scale_rewards, loss_type
        self.entropy_coef = _number("entropy_coef", entropy_coef, 0.0)
        self.advantage_eps = _number("advantage_eps", advantage_eps, 0.0)

    @classmethod
    def from_config(cls, cfg: "GRPOObjective | dict | None") -> "GRPOObjective":
        if isinstance(cfg, GRPOObjective):
            return cfg
        if cfg is None:
            return cls()
        if not isinstance(cfg, dict):
            raise ConfigError(f"grpo must be a dict of objective options, got {cfg!r}")
        try:
            return cls(**cfg)
        except TypeError:
            import inspect

            valid = [p for p in inspect.signature(cls).parameters]
            unknown = sorted(set(cfg) - set(valid))
            raise ConfigError(f"grpo: unknown option(s) {', '.join(map(repr, unknown))}; "
                              f"valid: {', '.join(valid)}") from None

    @property
    def uses_reference(self) -> bool:
        return self.beta > 0

    def advantages(self, rewards: torch.Tensor, group_index: torch.Tensor,
                   num_groups: int | None = None) -> torch.Tensor:
        return group_advantages(rewards, group_index, self.scale_rewards, self.advantage_eps, num_groups)

    def loss(self, logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
             action_mask: torch.Tensor, totals: RolloutTotals, ref_logp: torch.Tensor | None = None,
             entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
        """This micro-batch's share of the loss and of the metrics ``kl`` (beta > 0),
        ``entropy`` (when given), ``clip_frac_low``, ``clip_frac_high``,
        ``clip_frac`` and ``ratio_mean``, all step means over the rollout."""
        objective, ratio, low, high = clipped_surrogate(logp, old_logp, advantages, self.epsilon,
                                                        self.epsilon_high)
        per_step = -objective
        metrics = {}
        if self.beta > 0:
            if ref_logp is None:
                raise ValueError("beta > 0 needs the reference policy's log-probabilities (ref_logp)")
            kl = k3_kl(logp, ref_logp)
            per_step = per_step + self.beta * kl
            metrics["kl"] = step_mean(kl.detach(), action_mask, totals)
        loss = aggregate(per_step, action_mask, self.loss_type, totals)
        if entropy is not None:
            if self.entropy_coef > 0:
                loss = loss - self.entropy_coef * aggregate(entropy, action_mask, self.loss_type, totals)
            metrics["entropy"] = step_mean(entropy.detach(), action_mask, totals)
        low, high = low.to(logp.dtype), high.to(logp.dtype)
        metrics["clip_frac_low"] = step_mean(low, action_mask, totals)
        metrics["clip_frac_high"] = step_mean(high, action_mask, totals)
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
        metrics["ratio_mean"] = step_mean(ratio.detach(), action_mask, totals)
        return loss, metrics
