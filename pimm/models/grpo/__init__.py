"""GRPO for policy models: the reusable objective (``objective``), the frozen
reference policy (``reference``), the track-proposal policy of task 1
(``track_policy``) and the clustering-radius policy of task 2 over a frozen
instance model (``cluster_policy``). The trainer side is
``pimm.engines.trainers.grpo``; the contract between the two is documented in
``docs/grpo.md``."""

from .objective import (LOSS_TYPES, SCALE_REWARDS, GRPOObjective, RolloutTotals, aggregate, clipped_surrogate,
                        group_advantages, k3_kl, rollout_metrics, step_mean)
from .cluster_policy import ClusterRadiusPolicy, RadiusHead
from .reference import FrozenReference
from .track_policy import ProposalNet, TrackProposalPolicy

__all__ = ["GRPOObjective", "RolloutTotals", "FrozenReference", "TrackProposalPolicy", "ProposalNet",
           "ClusterRadiusPolicy", "RadiusHead", "aggregate", "clipped_surrogate", "group_advantages", "k3_kl",
           "rollout_metrics", "step_mean", "LOSS_TYPES", "SCALE_REWARDS"]
