"""``Sonata-v1m1``: self-distillation pre-training of a point backbone (Wu et
al., "Sonata", CVPR 2025) as upstream pimm configures it.

A student and an EMA teacher share one backbone config (the teacher with
``teacher_custom`` applied, e.g. no drop path). Each batch holds two global
views and several local views of every event (``MultiViewGenerator``):

* mask loss: the student sees the global views with random cubic patches
  masked (the backbone's mask token replaces their features, their
  coordinates jittered by ``mask_jitter``) and predicts, per point, the
  teacher's prototype assignment of the nearest unmasked point of the same view;
* roll-mask loss: the same prediction against the *other* global view of
  the event;
* unmask loss: the student sees the local views and predicts the teacher's
  assignment of the nearest point of the event's first (principal) global view.

Targets are Sinkhorn-Knopp balanced assignments at the teacher temperature;
predictions are softmaxed at ``student_temp``; points are matched on
``origin_coord`` within ``match_max_r``. Features are taken ``up_cast_level``
levels above the encoder's coarsest one, every level's features
concatenated (``head_in_channels`` must be that width).

The mask losses need a backbone that replaces the masked points' features
(PT-v3's ``mask_token=True``): without one the student would see the masked
views unmasked and half the objective would train on nothing hidden. Upstream's
PT-v3 crashes on that batch; pimm refuses the config.

``representation_fusion_channels`` (upstream's option, off by default) puts a
small residual MLP between the up-cast features and the heads (:mod:`.fusion`);
the probe output (``return_point=True``) is then the fused features on the
input points.

Schedules (mask size and ratio, teacher temperature, EMA momentum, mask
jitter when ``mask_jitter`` is None) are functions of the optimizer step
(:mod:`.schedules`): the model is a hook (list ``ModelHook`` in ``hooks``)
that sets them before every step and updates the teacher after it, so a
resumed run continues them exactly. Without a trainer the start values hold
(``set_step`` moves them by hand).

One deliberate difference from upstream: the mask jitter is clipped to
+-2*jitter (upstream clips only the upper side).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import MODELS
from pimm.utils.errors import ConfigError

from ..point_ops import batch2offset, offset2batch, scatter_mean
from ..ptv3.structure import Point
from .arguments import DOMAINS, RULES
from .fusion import RepresentationFusion
from .heads import PrototypeHead
from .matching import match_nearest, mean_per_segment, patch_mask, segment_bounds, sinkhorn_knopp
from .schedules import WarmupCosine

__all__ = ["Sonata"]

# More training passes than any gradient accumulation uses, with no EMA update
# in between: the loop does not drive the model (no ModelHook).
_MAX_FORWARDS_WITHOUT_UPDATE = 64


@MODELS.register_module("Sonata-v1m1")
class Sonata(nn.Module, HookBase):
    """Student/teacher self-distillation around ``backbone`` (see the module doc).

    Keys are upstream's; ``head_*`` size the prototype heads, ``*_start`` /
    ``*_base`` / ``*_warmup_ratio`` the warm-up schedules (fractions of the
    run's steps), ``momentum_base -> momentum_final`` the teacher's EMA
    momentum (cosine over the whole run), ``*_loss_weight`` the three losses
    (a zero weight drops the loss and its head).
    """

    domains, domain_rules = DOMAINS, RULES
    variant = "Sonata-v1m1"

    def __init__(self, backbone: dict, head_in_channels: int, head_hidden_channels: int = 4096,
                 head_embed_channels: int = 512, head_num_prototypes: int = 4096, teacher_custom: dict | None = None,
                 num_global_view: int = 2, num_local_view: int = 4, mask_size_start: float = 0.1,
                 mask_size_base: float = 0.4, mask_size_warmup_ratio: float = 0.05, mask_ratio_start: float = 0.3,
                 mask_ratio_base: float = 0.7, mask_ratio_warmup_ratio: float = 0.05,
                 mask_jitter: float | None = None, mask_jitter_start: float = 0.0, mask_jitter_base: float = 0.01,
                 mask_jitter_warmup_ratio: float = 0.05, teacher_temp_start: float = 0.04,
                 teacher_temp_base: float = 0.07, teacher_temp_warmup_ratio: float = 0.05,
                 student_temp: float = 0.1, mask_loss_weight: float = 2 / 8, roll_mask_loss_weight: float = 2 / 8,
                 unmask_loss_weight: float = 4 / 8, momentum_base: float = 0.996, momentum_final: float = 1.0,
                 match_max_k: int = 8, match_max_r: float = 0.08, up_cast_level: int = 2,
                 representation_fusion_channels: int | None = None,
                 representation_fusion_hidden_channels: int | None = None, representation_fusion_dropout: float = 0.0,
                 representation_fusion_residual: bool = True, representation_fusion_output_norm: bool = True,
                 **unsupported: Any):
        nn.Module.__init__(self)
        if unsupported:
            raise ConfigError(f"{self.variant}: unknown option(s) {sorted(unsupported)}; see docs/pretraining.md")
        if not isinstance(backbone, dict) or "type" not in backbone:
            raise ConfigError(f"{self.variant}: backbone must be a dict(type=...), got {backbone!r}")
        weights = dict(mask=mask_loss_weight, roll_mask=roll_mask_loss_weight, unmask=unmask_loss_weight)
        if any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
            raise ConfigError(f"{self.variant}: loss weights {weights} must be >= 0 with a positive sum")
        if num_global_view not in (1, 2):
            raise ConfigError(f"{self.variant}: num_global_view={num_global_view}; use 1 or 2 (the roll-mask loss "
                              "swaps the two global views)")
        if num_global_view == 1 and roll_mask_loss_weight > 0:
            raise ConfigError(f"{self.variant}: roll_mask_loss_weight > 0 needs num_global_view=2")
        if unmask_loss_weight > 0 and num_local_view < 1:
            raise ConfigError(f"{self.variant}: unmask_loss_weight > 0 needs num_local_view >= 1")
        self.num_global_view, self.num_local_view = int(num_global_view), int(num_local_view)
        self.mask_loss_weight, self.roll_mask_loss_weight = float(mask_loss_weight), float(roll_mask_loss_weight)
        self.unmask_loss_weight, self.student_temp = float(unmask_loss_weight), float(student_temp)
        self.match_max_k, self.match_max_r, self.up_cast_level = match_max_k, float(match_max_r), int(up_cast_level)

        self.schedules = dict(
            mask_size=WarmupCosine(mask_size_start, mask_size_base, mask_size_base, mask_size_warmup_ratio),
            mask_ratio=WarmupCosine(mask_ratio_start, mask_ratio_base, mask_ratio_base, mask_ratio_warmup_ratio),
            teacher_temp=WarmupCosine(teacher_temp_start, teacher_temp_base, teacher_temp_base,
                                      teacher_temp_warmup_ratio),
            momentum=WarmupCosine(momentum_base, momentum_base, momentum_final, 0.0),
        )
        if mask_jitter is None:  # upstream: held at start through the warm-up, then cosine up to base
            self.schedules["mask_jitter"] = WarmupCosine(mask_jitter_start, mask_jitter_start, mask_jitter_base,
                                                         mask_jitter_warmup_ratio)
        self.mask_jitter = mask_jitter
        self.mask_size, self.mask_ratio = float(mask_size_start), float(mask_ratio_start)
        self.teacher_temp, self.momentum = float(teacher_temp_start), float(momentum_base)
        if mask_jitter is None:
            self.mask_jitter = float(mask_jitter_start)
        self.schedule_step = 0

        student = nn.ModuleDict({"backbone": MODELS.build(dict(backbone))})
        teacher = nn.ModuleDict({"backbone": MODELS.build({**backbone, **(teacher_custom or {})})})
        self._check_widths(student["backbone"], backbone, head_in_channels)
        if (mask_loss_weight > 0 or roll_mask_loss_weight > 0) and \
                getattr(student["backbone"], "has_mask_token", None) is False:
            raise ConfigError(f"{self.variant}: the mask losses need the backbone {backbone['type']!r} to mask the "
                              "student's masked points: set mask_token=True in it (or mask_loss_weight and "
                              "roll_mask_loss_weight to 0)")
        self.representation_fusion_enabled = representation_fusion_channels is not None
        if self.representation_fusion_enabled:
            for net in (student, teacher):
                net["representation_fusion"] = RepresentationFusion(
                    head_in_channels, representation_fusion_channels, representation_fusion_hidden_channels,
                    representation_fusion_dropout, representation_fusion_residual, representation_fusion_output_norm)
            head_in_channels = representation_fusion_channels

        def head():
            return PrototypeHead(head_in_channels, head_hidden_channels, head_embed_channels, head_num_prototypes)

        if mask_loss_weight > 0 or roll_mask_loss_weight > 0:
            student["mask_head"], teacher["mask_head"] = head(), head()
        if unmask_loss_weight > 0:
            student["unmask_head"], teacher["unmask_head"] = head(), head()
        self.student, self.teacher = student, teacher
        for name, module in self.student.items():
            self.teacher[name].load_state_dict(module.state_dict())
        for p in self.teacher.parameters():
            p.requires_grad = False
        #: Set by a monitoring hook before a step it logs; the forward then keeps
        #: detached features and logits in ``diagnostics`` for it.
        self.keep_diagnostics = False
        self.diagnostics: dict[str, torch.Tensor] = {}
        self._forwards_since_update = 0

    def _check_widths(self, net: nn.Module, cfg: dict, head_in_channels: int) -> None:
        if not getattr(net, "enc_mode", True):
            raise ConfigError(f"{self.variant}: the backbone must run encoder-only (enc_mode=True): the losses read "
                              "the encoder's levels")
        channels = list(cfg.get("enc_channels") or [])
        if channels:
            if not 0 <= self.up_cast_level < len(channels):
                raise ConfigError(f"{self.variant}: up_cast_level={self.up_cast_level} must be in "
                                  f"0..{len(channels) - 1} (the backbone has {len(channels)} encoder levels)")
            width = sum(channels[len(channels) - 1 - self.up_cast_level:])
            if width != head_in_channels:
                raise ConfigError(f"{self.variant}: head_in_channels={head_in_channels} but up_cast_level="
                                  f"{self.up_cast_level} concatenates enc_channels {channels[-1 - self.up_cast_level:]}"
                                  f" = {width} channels; set head_in_channels={width}")

    # -- hook side: schedules and the teacher's EMA --------------------------
    def set_step(self, step: int, total_steps: int) -> dict[str, float]:
        """Set every scheduled value for optimizer step ``step`` (0-based) of a
        ``total_steps`` run; returns them."""
        self.schedule_step = int(step)
        values = {name: schedule(step, total_steps) for name, schedule in self.schedules.items()}
        for name, value in values.items():
            setattr(self, name, value)
        return values

    def before_step(self) -> None:
        trainer = self.trainer
        total = trainer.iters_per_epoch * trainer.max_epoch
        values = self.set_step(trainer.global_step, total)
        trainer.metrics.publish({f"params/{k}": v for k, v in values.items()}, step=trainer.global_step + 1)

    @torch.no_grad()
    def update_teacher(self, momentum: float | None = None) -> None:
        """``teacher = m * teacher + (1 - m) * student`` over every parameter."""
        self._forwards_since_update = 0
        m = self.momentum if momentum is None else momentum
        teacher = list(self.teacher.parameters())
        student = [p.detach() for name in self.teacher for p in self.student[name].parameters()]
        torch._foreach_mul_(teacher, m)
        torch._foreach_add_(teacher, student, alpha=1 - m)

    def after_step(self) -> None:
        self.update_teacher()

    # -- features ------------------------------------------------------------
    def _encode(self, net: nn.ModuleDict, point: Point, to_input_points: bool = False) -> Point:
        """Backbone, then the features of ``up_cast_level`` levels concatenated
        onto the points of that level (with their mean ``origin_coord``), fused
        when the model has a representation fusion; ``to_input_points``: those
        features copied on down to the backbone's finest level."""
        events = len(point["offset"])
        out = net["backbone"](point)
        chain = [out]
        while "pooling_parent" in chain[-1]:
            chain.append(chain[-1]["pooling_parent"])
        if self.up_cast_level >= len(chain):
            raise ConfigError(f"{self.variant}: up_cast_level={self.up_cast_level} but the backbone returned "
                              f"{len(chain)} levels")
        origin = chain[-1]["origin_coord"]
        for j in range(len(chain) - 2, self.up_cast_level - 1, -1):
            origin = scatter_mean(origin, chain[j]["pooling_inverse"], chain[j]["feat"].shape[0])
        feat = chain[0]["feat"]
        for i in range(1, self.up_cast_level + 1):
            feat = torch.cat([chain[i]["feat"], feat.index_select(0, chain[i - 1]["pooling_inverse"])], dim=-1)
        if "representation_fusion" in net:
            feat = net["representation_fusion"](feat)
        level = chain[self.up_cast_level]
        if to_input_points:
            for i in range(self.up_cast_level + 1, len(chain)):
                feat = feat.index_select(0, chain[i - 1]["pooling_inverse"])
            level, origin = chain[-1], chain[-1]["origin_coord"]
        batch = level["batch"]
        return Point(feat=feat, origin_coord=origin, batch=batch, offset=batch2offset(batch, events))

    def forward(self, data_dict: dict, return_point: bool = False) -> dict:
        if return_point:  # features for probing: the teacher's (fused: on the input points, as upstream)
            point = Point(**{k: v for k, v in data_dict.items() if isinstance(v, torch.Tensor)})
            point.setdefault("origin_coord", point["coord"])
            return dict(point=self._encode(self.teacher, point, to_input_points=self.representation_fusion_enabled))
        missing = [k for k in ("global_feat", "global_coord", "global_origin_coord", "global_offset", "grid_size")
                   if k not in data_dict]
        if self.unmask_loss_weight > 0:
            missing += [k for k in ("local_feat", "local_coord", "local_origin_coord", "local_offset")
                        if k not in data_dict]
        if missing:
            raise ConfigError(f"{self.variant}: the batch has no {missing}; build the views with MultiViewGenerator "
                              "and Collect(global_feat_keys=..., local_feat_keys=...)")
        if self.training and torch.is_grad_enabled():
            self._forwards_since_update += 1
            if self._forwards_since_update > _MAX_FORWARDS_WITHOUT_UPDATE:
                raise ConfigError(f"{self.variant}: {_MAX_FORWARDS_WITHOUT_UPDATE} training passes without a teacher "
                                  "update: list dict(type='ModelHook') in hooks (it advances the schedules and the "
                                  "EMA teacher)")
        grid_size = data_dict["grid_size"]
        grid_size = float(grid_size.flatten()[0]) if isinstance(grid_size, torch.Tensor) else float(grid_size)

        with torch.no_grad():
            view = dict(feat=data_dict["global_feat"], origin_coord=data_dict["global_origin_coord"],
                        offset=data_dict["global_offset"], grid_size=grid_size)
            batch = offset2batch(view["offset"], view["feat"].shape[0])
            mask, _ = patch_mask(data_dict["global_coord"], batch, self.mask_size, self.mask_ratio)
            masked_coord = data_dict["global_coord"].clone()
            if self.mask_jitter:
                noise = torch.randn_like(masked_coord[mask]) * self.mask_jitter
                masked_coord[mask] += noise.clamp(-2 * self.mask_jitter, 2 * self.mask_jitter)
            teacher_global = self._encode(self.teacher, Point(view, coord=data_dict["global_coord"]))
            teacher_feat = teacher_global["feat"]
        keep = self.keep_diagnostics
        self.diagnostics = {"teacher_feat": teacher_feat.detach()} if keep else {}
        losses: dict[str, torch.Tensor] = {}

        if self.mask_loss_weight > 0 or self.roll_mask_loss_weight > 0:
            with torch.no_grad():
                target_logits = self.teacher[self._teacher_head("mask_head")](teacher_feat)
            student_masked = self._encode(self.student, Point(view, coord=masked_coord, mask=mask))
            pred = self.student["mask_head"](student_masked["feat"])
            if keep:
                self.diagnostics.update(student_feat=student_masked["feat"].detach(),
                                        teacher_mask_logits=target_logits.detach())
            if self.mask_loss_weight > 0:
                losses["mask_loss"] = self._distill(pred, student_masked, target_logits, teacher_global["origin_coord"],
                                                    teacher_global["offset"])
            if self.roll_mask_loss_weight > 0:
                rolled_logits, rolled_origin, rolled_offset = self._roll(target_logits, teacher_global)
                losses["roll_mask_loss"] = self._distill(pred, student_masked, rolled_logits, rolled_origin,
                                                         rolled_offset)

        if self.unmask_loss_weight > 0:
            with torch.no_grad():
                target_logits = self.teacher[self._teacher_head("unmask_head")](teacher_feat)
            local = dict(feat=data_dict["local_feat"], coord=data_dict["local_coord"],
                         origin_coord=data_dict["local_origin_coord"], offset=data_dict["local_offset"],
                         grid_size=grid_size)
            student_local = self._encode(self.student, Point(local))
            pred = self.student["unmask_head"](student_local["feat"])
            if keep:
                self.diagnostics["teacher_unmask_logits"] = target_logits.detach()
            principal = teacher_global["batch"] % self.num_global_view == 0
            principal_batch = teacher_global["batch"][principal] // self.num_global_view
            events = len(teacher_global["offset"]) // self.num_global_view
            query_offset = student_local["offset"][self.num_local_view - 1::self.num_local_view]
            if len(query_offset) != events:
                raise ConfigError(f"{self.variant}: the batch has {len(student_local['offset'])} local views for "
                                  f"{events} events; num_local_view={self.num_local_view} must match "
                                  "MultiViewGenerator's local_view_num")
            losses["unmask_loss"] = self._distill(pred, student_local, target_logits[principal],
                                                  teacher_global["origin_coord"][principal],
                                                  batch2offset(principal_batch, events), query_offset=query_offset)

        weight = dict(mask_loss=self.mask_loss_weight, roll_mask_loss=self.roll_mask_loss_weight,
                      unmask_loss=self.unmask_loss_weight)
        total = sum(losses[k] * weight[k] for k in losses)
        out = dict(losses)
        out["loss"] = total
        out["total_loss"] = total.detach()
        return out

    def _teacher_head(self, student_head: str) -> str:
        """The teacher head whose assignments train ``student_head``: its own twin."""
        return student_head

    def _distill(self, pred: torch.Tensor, query: Point, target_logits: torch.Tensor, target_origin: torch.Tensor,
                 target_offset: torch.Tensor, query_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-entropy between the student's prediction of each query point
        and the balanced teacher assignment of its nearest target point,
        averaged per query view, then over views."""
        pairs = match_nearest(query["origin_coord"], query["offset"] if query_offset is None else query_offset,
                              target_origin, target_offset, self.match_max_r)
        if pairs.shape[0] == 0:  # no point within match_max_r: no signal, keep the graph
            return pred.sum() * 0.0
        with torch.no_grad():
            target = sinkhorn_knopp(target_logits[pairs[:, 1]], self.teacher_temp)
        log_prob = F.log_softmax(pred[pairs[:, 0]].float() / self.student_temp, dim=-1)
        loss = -(target * log_prob).sum(dim=-1)
        return mean_per_segment(loss, query["batch"][pairs[:, 0]])

    def _roll(self, logits: torch.Tensor, point: Point) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two global views of every event swapped: view 2b+1's points take
        slot 2b and the reverse (logits, origin_coord, offset)."""
        bounds = segment_bounds(point["offset"])
        order = [v ^ 1 for v in range(len(bounds))]  # 0<->1, 2<->3, ...
        index = torch.cat([torch.arange(*bounds[v], device=logits.device) for v in order])
        counts = torch.tensor([bounds[v][1] - bounds[v][0] for v in order], device=logits.device)
        return logits[index], point["origin_coord"][index], torch.cumsum(counts, 0)
