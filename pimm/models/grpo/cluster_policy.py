"""ClusterRadiusPolicy: GRPO fine-tuning of a supervised instance model's clustering, event by event.

Why: :class:`~pimm.models.instance.PointGroupLite` groups points with fixed
per-class radii (how far two voxels' centroid votes may disagree and still be
followed, and how close two fragments' votes must be to merge). One setting
for every event is a compromise: a busy event with overlapping showers wants
tighter merging than a clean one. The radii are not differentiable, and the
score that matters (the event's adjusted Rand index, ARI) is not either, so
they are a natural policy for GRPO.

The supervised network (backbone, semantic and offset heads) is **frozen**
and always in eval mode; it is a subclass of PointGroupLite, so a supervised
checkpoint loads into it with ``weight=`` (the new ``policy.*`` and
``reference.*`` keys are reported missing, as expected). A small head
(:class:`RadiusHead`) reads features pooled over the event from the frozen
network (:func:`event_features`) and chooses, for each controlled radius kind
(``agree``, ``merge``) and each class that has instances, one scale out of
``radius_scales``; the radius used is the configured one times that scale.
So a trajectory is ``len(radius_kinds) * instance classes`` decisions, all
made at once and independent given the event (a factorised policy; every
step is active). Its reward is the event's ARI
(:func:`~pimm.evaluation.metrics.adjusted_rand_index`, the definition
``InsSegEvaluator`` reports) of the clustering with the chosen radii.

A rollout runs the frozen network once per event and keeps only the event
features in its context, so the loss re-evaluates only the head (cheap, and
checkpointed with the rollout for exact resume). The G trajectories of an
event are clustered in one call, as G copies of the event with per-copy radii.

Evaluation (``forward``) is greedy (each decision's most likely scale) and
returns ``instance_pred`` (the policy's clustering), ``instance_pred_supervised``
(the configured radii, i.e. the supervised model) and the chosen scales, which
:class:`~pimm.evaluation.cluster_policy.ClusterPolicyEvaluator` compares on
the same events. ``use_event_features=False`` gives the same head a constant
input: it can then only learn one global recalibration of the radii, the
honest baseline for what the per-event policy adds.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.registries import MODELS
from pimm.evaluation.metrics import adjusted_rand_index
from pimm.utils.errors import ConfigError, UserError

from ..instance import PointGroupLite, cluster_instances
from ..point_ops import offset2batch, scatter_mean, scatter_sum
from .objective import GRPOObjective, RolloutTotals, rollout_metrics
from .reference import FrozenReference
from pimm.utils.domains import Choice, DictOf, Int, Positive, Real, Seq, Size

__all__ = ["ClusterRadiusPolicy", "RadiusHead", "event_features"]

RADIUS_KINDS = ("agree", "merge")
_NETWORK = {"backbone", "seg_head", "offset_head"}


def _note_loaded(model: "ClusterRadiusPolicy", incompatible) -> None:
    """Post-hook of ``load_state_dict``: the network counts as loaded when no
    key of it was missing (``weight=`` warm start, or a resume; the keys may
    carry a wrapper's prefix)."""
    if not any(_NETWORK & set(key.split(".")) for key in incompatible.missing_keys):
        model.network_loaded = True


def event_features(feat: torch.Tensor, seg_logits: torch.Tensor, offset_pred: torch.Tensor, events: torch.Tensor,
                   num_events: int, offset_scale: float) -> torch.Tensor:
    """``(events, 2 * width + 4 * classes + 1)`` summary of an event from the
    frozen network: mean and max of the backbone features, and per predicted
    class the fraction and log-count of points, the mean offset length (in
    ``offset_scale`` units) and the mean softmax confidence; plus the log of
    the event's point count."""
    num_classes = seg_logits.shape[1]
    probs = torch.softmax(seg_logits.float(), 1)
    onehot = F.one_hot(probs.argmax(1), num_classes).to(probs.dtype)
    counts = scatter_sum(onehot, events, num_events)
    per_class = counts.clamp(min=1.0)
    offset_length = scatter_sum(onehot * (offset_pred.float().norm(dim=1, keepdim=True) / offset_scale), events,
                                num_events) / per_class
    confidence = scatter_sum(onehot * probs.max(1).values[:, None], events, num_events) / per_class
    feat = feat.float()
    peak = feat.new_full((num_events, feat.shape[1]), float("-inf")).scatter_reduce(
        0, events[:, None].expand_as(feat), feat, "amax")
    total = counts.sum(1, keepdim=True)
    return torch.cat([scatter_mean(feat, events, num_events), peak, counts / total.clamp(min=1.0),
                      torch.log1p(counts), offset_length, confidence, torch.log1p(total)], 1)


class RadiusHead(nn.Module):
    """Logits ``(events, decisions, scales)`` from event features.

    The features are layer-normalised (their scales differ by orders of
    magnitude) and go through a one-hidden-layer MLP. The output layer starts
    at zero weights with a bias of ``keep_bias`` on the scale 1 bin, so the
    initial greedy policy is exactly the supervised model and sampling
    explores around it. ``use_features=False`` feeds a constant instead of
    the features (a global, event-independent policy)."""

    def __init__(self, in_features: int, num_decisions: int, num_scales: int, hidden: int, keep_index: int,
                 keep_bias: float, use_features: bool = True):
        super().__init__()
        self.num_decisions, self.num_scales, self.use_features = num_decisions, num_scales, use_features
        self.norm = nn.LayerNorm(in_features)
        self.mlp = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                 nn.Linear(hidden, num_decisions * num_scales))
        with torch.no_grad():
            out = self.mlp[-1]
            out.weight.zero_()
            out.bias.view(num_decisions, num_scales).zero_()[:, keep_index] = keep_bias

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not self.use_features:
            features = torch.zeros_like(features)
        return self.mlp(self.norm(features)).view(-1, self.num_decisions, self.num_scales)


@MODELS.register_module()
class ClusterRadiusPolicy(PointGroupLite):
    """A frozen PointGroupLite whose clustering radii a GRPO policy picks per event.

    Args (besides PointGroupLite's, which describe the supervised model and
    must match its checkpoint):
        radius_scales: the scales a decision chooses from; must contain 1.0
            (the configured radius, where the policy starts).
        radius_kinds: which radii the policy controls: ``"agree"``, ``"merge"`` or both.
        num_generations: G, trajectories sampled per event in a rollout (>= 2).
        hidden: width of the head's hidden layer.
        keep_bias: initial logit advantage of scale 1.0 over the others.
        use_event_features: False = a global policy (see the module docstring).
        require_weights: refuse to sample rollouts until trained weights were
            loaded into the network (``weight=`` or a resume): fine-tuning the
            clustering of an untrained network is a mistake that costs a run.
        grpo: options of :class:`~pimm.models.grpo.objective.GRPOObjective`.
    """

    # ``model.grpo.<key>`` options are checked against the objective (pimm.utils.config_slots).
    config_sections = {"grpo": GRPOObjective}

    domains = dict(radius_scales=Seq(Positive, min_len=1), radius_kinds=Seq(Choice("agree", "merge"), min_len=1),
                   num_generations=Int(2, 4096), hidden=Size, keep_bias=Real(-100, 100), grpo=DictOf() | None)

    def __init__(self, radius_scales: Sequence[float] = (0.5, 0.7, 0.85, 1.0, 1.2, 1.4, 2.0),
                 radius_kinds: Sequence[str] = RADIUS_KINDS, num_generations: int = 8, hidden: int = 64,
                 keep_bias: float = 1.0, use_event_features: bool = True, require_weights: bool = True,
                 grpo: dict | None = None, **segmentor):
        super().__init__(**segmentor)
        name = type(self).__name__
        scales = [float(s) for s in radius_scales] if isinstance(radius_scales, (list, tuple)) else []
        if not scales or min(scales) <= 0 or 1.0 not in scales or len(set(scales)) != len(scales):
            raise ConfigError(f"{name}: radius_scales={radius_scales!r} must be distinct positive numbers "
                              "including 1.0 (the configured radius)")
        kinds = (radius_kinds,) if isinstance(radius_kinds, str) else tuple(radius_kinds)
        if not kinds or any(k not in RADIUS_KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ConfigError(f"{name}: radius_kinds={radius_kinds!r}: choose from {RADIUS_KINDS}")
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 2:
            raise ConfigError(f"{name}: num_generations={num_generations!r} must be an integer >= 2: GRPO "
                              "compares a group's trajectories with each other")
        if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
            raise ConfigError(f"{name}: hidden={hidden!r} must be a positive integer")
        for flag, value in (("use_event_features", use_event_features), ("require_weights", require_weights)):
            if not isinstance(value, bool):
                raise ConfigError(f"{name}: {flag} must be True or False, got {value!r}")
        self.require_weights = require_weights
        self.network_loaded = False  # set when a state dict fills the network (see _note_loaded)
        self.register_load_state_dict_post_hook(_note_loaded)
        # The supervised network is frozen: not trained, not in the optimizer, always in eval mode.
        for part in (self.backbone, self.seg_head, self.offset_head):
            part.requires_grad_(False)
        self.register_buffer("scales", torch.tensor(scales), persistent=False)
        self.kinds = kinds
        self.controlled = [c for c in range(self.num_classes) if c not in self.stuff_classes]
        if not self.controlled:
            raise ConfigError(f"{name}: every class is a stuff class; there is no radius to choose")
        self.num_generations = num_generations
        self.objective = GRPOObjective.from_config(grpo)
        width = self.seg_head.in_features
        self.policy = RadiusHead(2 * width + 4 * self.num_classes + 1, len(kinds) * len(self.controlled),
                                 len(scales), hidden, scales.index(1.0), float(keep_bias), use_event_features)
        self.reference = FrozenReference(self.policy) if self.objective.uses_reference else None

    def train(self, mode: bool = True) -> "ClusterRadiusPolicy":
        super().train(mode)
        for part in (self.backbone, self.seg_head, self.offset_head):
            part.eval()  # batch-norm statistics of the supervised model stay as trained
        return self

    # -- the frozen network ------------------------------------------------------------
    @torch.no_grad()
    def _frozen_pass(self, batch: dict) -> dict:
        feat = self.backbone(batch)
        seg_logits = self.seg_head(feat)
        offset_pred = self.offset_head(feat) * self.offset_scale
        events = offset2batch(batch["offset"].to(feat.device))
        num_events = len(batch["offset"])
        features = event_features(feat, seg_logits, offset_pred, events, num_events, self.offset_scale)
        return {"seg_logits": seg_logits, "offset_pred": offset_pred, "events": events, "features": features,
                "semantic": seg_logits.argmax(1)}

    def base_radii(self, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """The configured radii, ``(classes,)`` per kind."""
        out = {}
        for kind, value in (("agree", self.agree_radius), ("merge", self.merge_radius)):
            values = [value] * self.num_classes if isinstance(value, float) else list(value)[: self.num_classes]
            out[kind] = like.new_tensor(values, dtype=torch.float32)
        return out

    def radii_of(self, actions: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(radii, scales)``: per kind, ``(rows, classes)`` radii and scales of
        ``(rows, decisions)`` actions (uncontrolled radii keep scale 1)."""
        base = self.base_radii(self.scales)
        chosen = self.scales[actions]
        controlled = torch.tensor(self.controlled, device=actions.device)
        radii, scales = {}, {}
        for k, kind in enumerate(RADIUS_KINDS):
            scale = torch.ones(actions.shape[0], self.num_classes, device=actions.device)
            if kind in self.kinds:
                j = self.kinds.index(kind) * len(self.controlled)
                scale[:, controlled] = chosen[:, j:j + len(self.controlled)]
            scales[kind], radii[kind] = scale, base[kind][None, :] * scale
        return radii, scales

    def _cluster(self, coord, shifted, semantic, events, radii) -> torch.Tensor:
        return cluster_instances(coord, shifted, semantic, events, self.grid_size, radii["agree"], radii["merge"],
                                 self.min_points, self.stuff_classes)

    # -- evaluation: the greedy policy -----------------------------------------------------
    def forward(self, input_dict: dict) -> dict:
        frozen = self._frozen_pass(input_dict)
        coord = input_dict["coord"]
        shifted = coord + frozen["offset_pred"]
        with torch.no_grad():
            logits = self.policy(frozen["features"])
            radii, scales = self.radii_of(logits.argmax(-1))
            out = {"seg_logits": frozen["seg_logits"], "offset_pred": frozen["offset_pred"], "policy_logits": logits,
                   "agree_scale": scales["agree"], "merge_scale": scales["merge"],
                   "instance_pred": self._cluster(coord, shifted, frozen["semantic"], frozen["events"], radii)}
            out["instance_pred_supervised"] = cluster_instances(
                coord, shifted, frozen["semantic"], frozen["events"], self.grid_size, self.agree_radius,
                self.merge_radius, self.min_points, self.stuff_classes)
        return out

    # -- GRPO contract -------------------------------------------------------------------------
    def trajectory_logp(self, logits: torch.Tensor, actions: torch.Tensor, with_entropy: bool = False):
        """``(T, L)`` log-probabilities of the actions under ``(T, L, S)`` logits
        (and the entropy of each decision when asked)."""
        log_probs = torch.log_softmax(logits, -1)
        logp = log_probs.gather(2, actions[:, :, None]).squeeze(2)
        entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
        return logp, entropy

    def rewards(self, input_dict: dict, frozen: dict, actions: torch.Tensor, event_index: torch.Tensor):
        """ARI of each trajectory's clustering; the G trajectories of an event
        are clustered together as G copies of it."""
        coord, instance = input_dict["coord"], input_dict["instance"].long()
        shifted = coord + frozen["offset_pred"]
        radii, _ = self.radii_of(actions)
        rewards = torch.empty(actions.shape[0], dtype=torch.float32)
        ends = input_dict["offset"].tolist()
        for event, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
            rows = torch.nonzero(event_index == event).squeeze(1)
            copies, n = len(rows), end - start
            copy_index = torch.arange(copies, device=coord.device).repeat_interleave(n)
            labels = self._cluster(coord[start:end].repeat(copies, 1), shifted[start:end].repeat(copies, 1),
                                   frozen["semantic"][start:end].repeat(copies), copy_index,
                                   {k: v[rows] for k, v in radii.items()})
            truth = instance[start:end]
            for i, row in enumerate(rows.tolist()):
                rewards[row] = adjusted_rand_index(truth, labels[i * n:(i + 1) * n])
        return rewards.to(actions.device)

    @torch.no_grad()
    def sample_grpo_batch(self, batch: dict) -> dict:
        """G radius choices per event, scored by ARI, with group advantages (docs/grpo.md)."""
        missing = [k for k in ("coord", "feat", "offset", "instance") if k not in batch]
        if missing:
            raise UserError(f"{type(self).__name__} needs {', '.join(missing)} in the batch (an instance-"
                            "segmentation data set, e.g. LArTPCSynthDataset with Collect keys coord, instance)")
        if self.require_weights and not self.network_loaded:
            raise UserError(f"{type(self).__name__} fine-tunes the clustering of a trained instance model, but no "
                            "weights were loaded into its network: start from the supervised checkpoint with "
                            "--options weight=PATH (or set model.require_weights=False)")
        frozen = self._frozen_pass(batch)
        num_events = frozen["features"].shape[0]
        logits = self.policy(frozen["features"])
        event_index = torch.arange(num_events, device=logits.device).repeat_interleave(self.num_generations)
        traj_logits = logits[event_index]
        num_scales = traj_logits.shape[-1]
        actions = torch.multinomial(torch.softmax(traj_logits, -1).view(-1, num_scales), 1).view(traj_logits.shape[:2])
        action_mask = torch.ones_like(actions, dtype=torch.bool)
        old_logp, _ = self.trajectory_logp(traj_logits, actions)
        rewards = self.rewards(batch, frozen, actions, event_index)
        trajectories = {"actions": actions, "action_mask": action_mask, "old_logp": old_logp, "rewards": rewards,
                        "advantages": self.objective.advantages(rewards, event_index, num_events),
                        "event_index": event_index}
        if self.reference is not None:
            self.reference.ensure(self.policy)
            trajectories["ref_logp"], _ = self.trajectory_logp(self.reference(frozen["features"])[event_index], actions)
        metrics = rollout_metrics(rewards, event_index, action_mask)
        metrics["greedy_scale_is_one"] = (self.scales[logits.argmax(-1)] == 1.0).float().mean()
        return {"trajectories": trajectories, "context": {"features": frozen["features"]}, "metrics": metrics}

    def grpo_loss_from_batch(self, rollout: dict, update_index: int = 0, policy_updates_per_rollout: int = 1) -> dict:
        """This micro-batch's share of the GRPO loss and metrics (docs/grpo.md)."""
        traj = rollout["trajectories"]
        logits = self.policy(rollout["context"]["features"][traj["event_index"]])
        logp, entropy = self.trajectory_logp(logits, traj["actions"], with_entropy=True)
        loss, metrics = self.objective.loss(logp, traj["old_logp"], traj["advantages"], traj["action_mask"],
                                            RolloutTotals.of_rollout(rollout), ref_logp=traj.get("ref_logp"),
                                            entropy=entropy)
        return {"loss": loss, **metrics}
