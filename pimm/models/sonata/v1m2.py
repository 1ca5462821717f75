"""``Sonata-v1m2`` (upstream's ``sonata_v1m2_uni_teacher_head``): Sonata-v1m1
with one teacher head.

What differs from :class:`~pimm.models.sonata.model.Sonata` (everything
else -- views, masks, matching, Sinkhorn targets, losses, schedules, EMA --
is v1m1's, so this is a thin subclass):

* the teacher assigns prototypes with one head for every loss: its
  ``mask_head`` when a mask loss is on (``mask_loss_weight`` or
  ``roll_mask_loss_weight`` > 0), else its ``unmask_head``; the unmask loss
  of the student's ``unmask_head`` is then trained against the teacher's
  ``mask_head``. Both teacher heads exist and follow the student's by EMA, as
  upstream's (the other is a "dummy head for EMA"), so checkpoints hold the
  same tensors as v1m1's;
* ``mask_jitter=None`` means no jitter (v1m1 schedules it instead), and the
  ``mask_jitter_*`` schedule and ``representation_fusion_*`` arguments do not
  exist;
* the output is ``loss`` and the losses that ran (no ``total_loss``).
"""

from __future__ import annotations

from pimm.engines.registries import MODELS

from .model import Sonata

__all__ = ["SonataV1m2"]


@MODELS.register_module("Sonata-v1m2")
class SonataV1m2(Sonata):
    """Sonata with one shared teacher head (see the module doc); upstream's keys and defaults."""

    variant = "Sonata-v1m2"

    def __init__(self, backbone: dict, head_in_channels: int, head_hidden_channels: int = 4096,
                 head_embed_channels: int = 512, head_num_prototypes: int = 4096, teacher_custom: dict | None = None,
                 num_global_view: int = 2, num_local_view: int = 4, mask_size_start: float = 0.1,
                 mask_size_base: float = 0.4, mask_size_warmup_ratio: float = 0.05, mask_ratio_start: float = 0.3,
                 mask_ratio_base: float = 0.7, mask_ratio_warmup_ratio: float = 0.05,
                 mask_jitter: float | None = None, teacher_temp_start: float = 0.04, teacher_temp_base: float = 0.07,
                 teacher_temp_warmup_ratio: float = 0.05, student_temp: float = 0.1,
                 mask_loss_weight: float = 2 / 8, roll_mask_loss_weight: float = 2 / 8,
                 unmask_loss_weight: float = 4 / 8, momentum_base: float = 0.996, momentum_final: float = 1.0,
                 match_max_k: int = 8, match_max_r: float = 0.08, up_cast_level: int = 2):
        super().__init__(backbone, head_in_channels, head_hidden_channels, head_embed_channels, head_num_prototypes,
                         teacher_custom, num_global_view, num_local_view, mask_size_start, mask_size_base,
                         mask_size_warmup_ratio, mask_ratio_start, mask_ratio_base, mask_ratio_warmup_ratio,
                         mask_jitter=mask_jitter, teacher_temp_start=teacher_temp_start,
                         teacher_temp_base=teacher_temp_base, teacher_temp_warmup_ratio=teacher_temp_warmup_ratio,
                         student_temp=student_temp, mask_loss_weight=mask_loss_weight,
                         roll_mask_loss_weight=roll_mask_loss_weight, unmask_loss_weight=unmask_loss_weight,
                         momentum_base=momentum_base, momentum_final=momentum_final, match_max_k=match_max_k,
                         match_max_r=match_max_r, up_cast_level=up_cast_level)
        if mask_jitter is None:  # no jitter at all (v1m1 would schedule one)
            self.schedules.pop("mask_jitter", None)
            self.mask_jitter = None

    def _teacher_head(self, student_head: str) -> str:
        return "mask_head" if self.mask_loss_weight > 0 or self.roll_mask_loss_weight > 0 else "unmask_head"

    def forward(self, data_dict: dict, return_point: bool = False) -> dict:
        out = super().forward(data_dict, return_point=return_point)
        out.pop("total_loss", None)
        return out
