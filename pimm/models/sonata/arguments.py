"""What ``Sonata-v1m1``'s arguments may be (:mod:`pimm.utils.domains`): each
one's domain and the relations between them, checked on the resolved config
before anything is built."""

from __future__ import annotations

from pimm.engines.registries import MODELS
from pimm.utils.config_domains import ask_class, domains_of
from pimm.utils.domains import (MAX_SIZE, Choice, DictOf, Int, Key, Length, NonNeg, Prob, Real, Registered, Rule,
                                Size, Weight)

__all__ = ["DOMAINS", "RULES"]

_TEMPERATURE = Real(0, 100, lo_open=True)


class _TeacherOptionsTakeTheBackbones(Rule):
    """Each ``teacher_custom`` entry is a backbone option: it takes the backbone type's own domain."""

    def __init__(self):
        super().__init__(lambda a: True, "teacher_custom", "")

    def check(self, args: dict, where: str) -> None:
        custom, backbone = args.get("teacher_custom"), args.get("backbone")
        kind = backbone.get("type") if isinstance(backbone, dict) else None
        if not isinstance(custom, dict) or not isinstance(kind, str) or kind not in MODELS:
            return
        domains, _ = domains_of(MODELS.get(kind))
        for key, value in custom.items():
            if key in domains:
                domains[key](f"{where}teacher_custom.{key}", value)


def _mask_losses(a) -> bool:
    return a.mask_loss_weight > 0 or a.roll_mask_loss_weight > 0


def _masks_features(a) -> bool:
    """False only when the backbone's type says its config does not mask (unknown types pass)."""
    return not _mask_losses(a) or ask_class(a.backbone, "model.backbone", "masks_features") is not False


def _ramps_up(name: str) -> Rule:
    """``<name>_start <= <name>_base``: a warm-up rises to its base value."""
    return Rule(lambda a: getattr(a, f"{name}_start") <= getattr(a, f"{name}_base"), f"{name}_start",
                f"a value <= {name}_base (the warm-up rises from start to base)")


#: Sonata-v1m1's arguments and the relations between them.
DOMAINS = dict(
    backbone=Registered("model"), head_in_channels=Size, head_hidden_channels=Size, head_embed_channels=Size,
    head_num_prototypes=Size, teacher_custom=DictOf(Key, what="a dict of backbone options for the teacher") | None,
    num_global_view=Choice(1, 2), num_local_view=Int(0, 256), mask_size_start=Length, mask_size_base=Length,
    mask_size_warmup_ratio=Prob, mask_ratio_start=Prob, mask_ratio_base=Prob, mask_ratio_warmup_ratio=Prob,
    mask_jitter=NonNeg | None, mask_jitter_start=NonNeg, mask_jitter_base=NonNeg, mask_jitter_warmup_ratio=Prob,
    teacher_temp_start=_TEMPERATURE, teacher_temp_base=_TEMPERATURE, teacher_temp_warmup_ratio=Prob,
    student_temp=_TEMPERATURE, mask_loss_weight=Weight, roll_mask_loss_weight=Weight, unmask_loss_weight=Weight,
    momentum_base=Prob, momentum_final=Prob, match_max_k=Int(1, 1024), match_max_r=Length,
    up_cast_level=Int(0, 16), representation_fusion_channels=Size | None,
    # hidden channels 0 or None: upstream's default width (it tests the value's truth)
    representation_fusion_hidden_channels=Int(0, MAX_SIZE) | None, representation_fusion_dropout=Prob)
RULES = (
    _TeacherOptionsTakeTheBackbones(),
    Rule(lambda a: a.momentum_base <= a.momentum_final, "momentum_base", "a value <= momentum_final"),
    *(_ramps_up(name) for name in ("mask_size", "mask_ratio", "teacher_temp", "mask_jitter")),
    Rule(lambda a: a.mask_loss_weight + a.roll_mask_loss_weight + a.unmask_loss_weight > 0, "mask_loss_weight",
         "a positive value when the other loss weights are 0 (some loss must train)"),
    Rule(lambda a: a.num_global_view == 2 or a.roll_mask_loss_weight == 0, "roll_mask_loss_weight",
         "0 with num_global_view=1 (the roll-mask loss swaps the two global views)"),
    Rule(lambda a: a.num_local_view >= 1 or a.unmask_loss_weight == 0, "unmask_loss_weight",
         "0 with num_local_view=0 (the unmask loss reads the local views)"),
    Rule(_masks_features, "backbone", "a backbone that masks the student's masked points when mask_loss_weight "
         "or roll_mask_loss_weight > 0: set mask_token=True in it (or both weights to 0)"),
)
