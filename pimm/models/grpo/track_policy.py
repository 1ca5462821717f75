"""TrackProposalPolicy: propose track instances one after another, trained with GRPO.

The action space of an event is STOP plus every (direction bin, class) pair:
``1 + num_direction_bins * num_classes`` actions. A trajectory picks pairs
one at a time, each pair at most once, until it picks STOP or has made
``max_proposals`` picks. Its reward is the F1 of a one-to-one matching of
the proposals (bin centre, class) to the true tracks (direction within
``angle_tolerance_deg`` and the same class; :mod:`pimm.evaluation.proposal`).

The network (:class:`ProposalNet`) reads the point cloud once per event and
pools per-point features into direction bins (see its docstring); the
event's logits do not change along a trajectory, an already chosen pair is
masked out. So one forward pass serves all G trajectories of an event and
every step of them, and re-scoring a trajectory in the loss is a gather.
The STOP logit starts at ``stop_bias`` so that short and long trajectories
are both explored (in a prototype of this task, without it the entropy
collapsed and the reward plateaued low).

Evaluation (``forward``) is greedy: the pairs whose logits beat STOP, best
first, at most ``max_proposals``.

GRPO contract: :meth:`sample_grpo_batch` and :meth:`grpo_loss_from_batch`
(see ``docs/grpo.md``); the objective's settings come from ``grpo=dict(...)``
(:class:`~pimm.models.grpo.objective.GRPOObjective`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.evaluation.proposal import f1_scores, match_proposals
from pimm.utils.errors import ConfigError, UserError

from ..point_ops import offset2batch, scatter_mean, scatter_sum
from .objective import GRPOObjective, RolloutTotals, rollout_metrics
from .reference import FrozenReference
from pimm.utils.domains import DictOf, Int, MAX_SIZE, Positive, Real, Size

__all__ = ["TrackProposalPolicy", "ProposalNet"]


class ProposalNet(nn.Module):
    """Event logits ``(B, 1 + bins * classes)`` from a point cloud, by pooling
    per-point features into direction bins.

    Each point gets rotation-invariant features (distance from the vertex,
    deposit) through a small MLP; each direction bin sums the features of the
    points near it (a triangular kernel one bin wide on the azimuth, so a
    point feeds its two nearest bins); one head shared by all bins turns a
    bin's sum and its neighbours' into class logits. Sharing the head across
    bins makes the policy rotation-equivariant: what it learns about a track
    in one direction holds in every direction. STOP's logit comes from the
    event's pooled (mean and max) point features, starting at ``stop_bias``.
    """

    def __init__(self, num_bins: int, num_classes: int, hidden: int = 32, dedx_scale: float = 5.0,
                 stop_bias: float = 2.5):
        super().__init__()
        self.num_bins, self.dedx_scale = num_bins, dedx_scale
        self.point_mlp = nn.Sequential(nn.Linear(3, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.bin_head = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        self.stop_head = nn.Linear(2 * hidden, 1)
        with torch.no_grad():
            self.stop_head.weight.zero_()
            self.stop_head.bias.fill_(stop_bias)

    def forward(self, batch: dict) -> torch.Tensor:
        coord, offset = batch["coord"], batch["offset"]
        radius = torch.sqrt(coord[:, 0] ** 2 + coord[:, 1] ** 2)
        dedx = batch["feat"][:, 0] / self.dedx_scale
        hidden = self.point_mlp(torch.stack([radius, dedx, radius * dedx], 1))
        # The triangular kernel, one bin wide, touches the two bins whose
        # centres enclose the point's azimuth: linear interpolation weights.
        position = torch.remainder(torch.atan2(coord[:, 1], coord[:, 0]), 2.0 * math.pi) * (
            self.num_bins / (2.0 * math.pi)) - 0.5
        lower = torch.floor(position)
        upper_weight = (position - lower)[:, None]
        lower = lower.long().remainder(self.num_bins)
        events = offset2batch(offset, coord.shape[0])  # the size given: no host read of offset
        num_events = len(offset)
        slots = torch.cat([events * self.num_bins + lower, events * self.num_bins + (lower + 1) % self.num_bins])
        binned = scatter_sum(torch.cat([hidden * (1.0 - upper_weight), hidden * upper_weight]), slots,
                             num_events * self.num_bins).view(num_events, self.num_bins, -1)
        neighbours = torch.roll(binned, 1, 1) + torch.roll(binned, -1, 1)
        pair_logits = self.bin_head(torch.cat([binned, neighbours], 2)).flatten(1)  # (B, bins * classes)
        mean = scatter_mean(hidden, events, num_events)
        peak = torch.zeros_like(mean).scatter_reduce(0, events[:, None].expand_as(hidden), hidden, "amax",
                                                     include_self=False)
        stop = self.stop_head(torch.cat([mean, peak], 1))
        return torch.cat([stop, pair_logits], 1)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"TrackProposalPolicy: {name}={value!r} must be a positive integer")
    return value


@MODELS.register_module()
class TrackProposalPolicy(nn.Module):
    """Sequential (direction bin, class) proposals over a track event.

    Args:
        num_direction_bins: bins of the azimuth; a proposal points at its bin's centre.
        num_classes: track classes (the data set's ``track_class`` values).
        max_proposals: picks per trajectory at most.
        num_generations: G, trajectories sampled per event in a rollout.
        angle_tolerance_deg: a proposal matches a track within this angle.
        hidden, dedx_scale, stop_bias: see :class:`ProposalNet`.
        grpo: options of :class:`~pimm.models.grpo.objective.GRPOObjective`.
    """

    # ``model.grpo.<key>`` options are checked against the objective (pimm.utils.config_slots).
    config_sections = {"grpo": GRPOObjective}

    domains = dict(num_direction_bins=Int(1, 4096), num_classes=Int(1, MAX_SIZE), max_proposals=Int(1, 1024),
                   num_generations=Int(2, 4096), angle_tolerance_deg=Real(0, 180, lo_open=True), hidden=Size,
                   dedx_scale=Positive, stop_bias=Real(-100, 100), grpo=DictOf() | None)

    def __init__(self, num_direction_bins: int = 24, num_classes: int = 2, max_proposals: int = 4,
                 num_generations: int = 8, angle_tolerance_deg: float = 10.0, hidden: int = 32,
                 dedx_scale: float = 5.0, stop_bias: float = 2.5, grpo: dict | None = None):
        super().__init__()
        self.num_bins = _positive_int("num_direction_bins", num_direction_bins)
        self.num_classes = _positive_int("num_classes", num_classes)
        self.max_proposals = _positive_int("max_proposals", max_proposals)
        self.num_generations = _positive_int("num_generations", num_generations)
        if num_generations < 2:
            raise ConfigError("TrackProposalPolicy: num_generations must be >= 2: GRPO compares a group's "
                              "trajectories with each other")
        if isinstance(angle_tolerance_deg, bool) or not isinstance(angle_tolerance_deg, (int, float)) \
                or not 0 < angle_tolerance_deg <= 180:
            raise ConfigError(f"TrackProposalPolicy: angle_tolerance_deg={angle_tolerance_deg!r} must be in (0, 180]")
        self.tolerance = math.radians(angle_tolerance_deg)
        self.num_actions = 1 + self.num_bins * self.num_classes
        if self.max_proposals > self.num_actions - 1:
            raise ConfigError(f"TrackProposalPolicy: max_proposals={max_proposals} exceeds the "
                              f"{self.num_actions - 1} (bin, class) pairs")
        self.objective = GRPOObjective.from_config(grpo)
        self.policy = ProposalNet(self.num_bins, self.num_classes, _positive_int("hidden", hidden), dedx_scale,
                                  stop_bias)
        self.reference = FrozenReference(self.policy) if self.objective.uses_reference else None

    # -- actions ---------------------------------------------------------------
    def _decode(self, actions: torch.Tensor, valid: torch.Tensor):
        """(angle, class, valid) of pick actions; STOP and padding are invalid."""
        pick = actions - 1
        valid = valid & (actions > 0)
        bins = pick.clamp(min=0) // self.num_classes
        classes = pick.clamp(min=0) % self.num_classes
        angle = (bins.to(torch.float32) + 0.5) * (2.0 * math.pi / self.num_bins)
        return angle, classes, valid

    @staticmethod
    def _step_logits(logits: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        """``(T, L, A)`` logits of every step: pairs picked at earlier steps masked out."""
        steps = actions.shape[1]
        picked = F.one_hot(actions.clamp(min=0), logits.shape[1]).to(torch.bool) & action_mask[:, :, None]
        picked[:, :, 0] = False  # STOP ends a trajectory; it is never masked
        earlier = torch.cumsum(picked.to(torch.int32), 1) - picked.to(torch.int32)
        expanded = logits[:, None, :].expand(-1, steps, -1)
        return expanded.masked_fill(earlier > 0, float("-inf"))

    def trajectory_logp(self, logits: torch.Tensor, actions: torch.Tensor, action_mask: torch.Tensor,
                        with_entropy: bool = False):
        """Log-probabilities ``(T, L)`` of the taken actions (0 on padded steps),
        and the policy's entropy at each step when asked."""
        log_probs = torch.log_softmax(self._step_logits(logits, actions, action_mask), -1)
        logp = log_probs.gather(2, actions.clamp(min=0)[:, :, None]).squeeze(2)
        logp = torch.where(action_mask, logp, torch.zeros_like(logp))
        if not with_entropy:
            return logp, None
        probs = log_probs.exp()
        entropy = -(probs * torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))).sum(-1)
        return logp, torch.where(action_mask, entropy, torch.zeros_like(entropy))

    def _sample_actions(self, logits: torch.Tensor):
        """Sample trajectories from ``(T, A)`` logits (the global torch RNG)."""
        num, steps = logits.shape[0], self.max_proposals
        actions = torch.zeros(num, steps, dtype=torch.long, device=logits.device)
        action_mask = torch.zeros(num, steps, dtype=torch.bool, device=logits.device)
        chosen = torch.zeros_like(logits, dtype=torch.bool)
        alive = torch.ones(num, dtype=torch.bool, device=logits.device)
        for step in range(steps):
            probs = torch.softmax(logits.masked_fill(chosen, float("-inf")), -1)
            action = torch.multinomial(probs, 1).squeeze(1)
            actions[:, step] = torch.where(alive, action, torch.zeros_like(action))
            action_mask[:, step] = alive
            chosen[torch.arange(num, device=logits.device), action] |= alive & (action > 0)
            alive = alive & (action > 0)
        return actions, action_mask

    def _rewards(self, actions, action_mask, track_angle, track_class) -> torch.Tensor:
        angle, classes, valid = self._decode(actions, action_mask)
        true_valid = track_class >= 0
        tp = match_proposals(angle, classes, valid, track_angle, track_class, true_valid, self.tolerance)
        return f1_scores(tp, valid.sum(1), true_valid.sum(1)).to(torch.float32)

    # -- evaluation: greedy proposals ----------------------------------------------
    def forward(self, batch: dict) -> dict:
        logits = self.policy(batch)
        order = torch.argsort(logits[:, 1:], dim=1, descending=True)[:, : self.max_proposals] + 1
        keep = logits.gather(1, order) > logits[:, :1]  # sorted, so the kept ones come first
        angle, classes, valid = self._decode(order, keep)
        return {"logits": logits, "proposal_angle": angle, "proposal_class": classes, "proposal_valid": valid}

    # -- GRPO contract -------------------------------------------------------------------
    def _check_batch(self, batch: dict) -> None:
        missing = [k for k in ("coord", "feat", "offset", "track_angle", "track_class") if k not in batch]
        if missing:
            raise UserError(f"TrackProposalPolicy needs {', '.join(missing)} in the batch (use StraightTracksDataset "
                            "or a data set with the same keys)")

    @torch.no_grad()
    def sample_grpo_batch(self, batch: dict) -> dict:
        """G trajectories per event, scored and with group advantages (see docs/grpo.md)."""
        self._check_batch(batch)
        logits = self.policy(batch)
        num_events = logits.shape[0]
        event_index = torch.arange(num_events, device=logits.device).repeat_interleave(self.num_generations)
        traj_logits = logits[event_index]
        actions, action_mask = self._sample_actions(traj_logits)
        old_logp, _ = self.trajectory_logp(traj_logits, actions, action_mask)
        rewards = self._rewards(actions, action_mask, batch["track_angle"][event_index],
                                batch["track_class"][event_index])
        trajectories = {
            "actions": actions, "action_mask": action_mask, "old_logp": old_logp, "rewards": rewards,
            "advantages": self.objective.advantages(rewards, event_index, num_events), "event_index": event_index,
            # The same on the host: an update picks its micro-batch's events from these without
            # reading device values (a rollout may sync, the updates after it do not).
            "host_event_index": torch.arange(num_events).repeat_interleave(self.num_generations),
        }
        if self.reference is not None:
            self.reference.ensure(self.policy)
            ref_logits = self.reference(batch)[event_index]
            trajectories["ref_logp"], _ = self.trajectory_logp(ref_logits, actions, action_mask)
        context = {k: batch[k] for k in ("coord", "feat", "offset")}
        context["host_offset"] = batch["offset"].cpu()  # read once per rollout, see host_event_index
        return {"trajectories": trajectories, "context": context,
                "metrics": rollout_metrics(rewards, event_index, action_mask)}

    def grpo_loss_from_batch(self, rollout: dict, update_index: int = 0, policy_updates_per_rollout: int = 1) -> dict:
        """This micro-batch's share of the GRPO loss and metrics (see docs/grpo.md)."""
        traj = rollout["trajectories"]
        context = rollout["context"]
        # On the host when the rollout holds host copies (it always does, unless a resume moved
        # them to the device): no host sync in the update.
        index = traj.get("host_event_index", traj["event_index"])
        events, local = torch.unique(index, return_inverse=True)
        device = context["coord"].device
        logits = self.policy(_select_events(context, events))[local.to(device, non_blocking=True)]
        logp, entropy = self.trajectory_logp(logits, traj["actions"], traj["action_mask"], with_entropy=True)
        loss, metrics = self.objective.loss(logp, traj["old_logp"], traj["advantages"], traj["action_mask"],
                                            RolloutTotals.of_rollout(rollout), ref_logp=traj.get("ref_logp"),
                                            entropy=entropy)
        return {"loss": loss, **metrics}


def _select_events(batch: dict, events: torch.Tensor) -> dict:
    """The sub-batch of ``events`` (sorted indices) of a point batch. The point
    indices are worked out next to ``events`` (on the host when ``events`` and
    ``batch["host_offset"]`` are host tensors) and only gathered on the device."""
    offset = batch.get("host_offset", batch["offset"])
    if len(events) == len(offset):
        return batch
    offset = offset.to(events.device)
    keep = torch.isin(offset2batch(offset), events).nonzero().squeeze(1)
    counts = torch.diff(offset, prepend=offset.new_zeros(1))[events]
    device = batch["coord"].device
    keep = keep.to(device, non_blocking=True)
    return {"coord": batch["coord"].index_select(0, keep), "feat": batch["feat"].index_select(0, keep),
            "offset": torch.cumsum(counts, 0).to(device, non_blocking=True)}
