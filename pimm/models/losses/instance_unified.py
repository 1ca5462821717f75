"""``FastUnifiedInstanceLoss``: upstream's query-based instance loss with
configurable per-query heads (continuous and categorical), built on the
shared loss of :mod:`pimm.models.losses.instance_query`."""

from __future__ import annotations

import torch
from torch import nn

from pimm.utils.domains import DictOf, Key, Real, Seq, Weight
from pimm.utils.errors import ConfigError

from .base import LOSSES
from .instance_query import _TARGET, _QueryInstanceLoss, _first_per_instance, _mean_per_instance, _split

__all__ = ["FastUnifiedInstanceLoss"]


_HEAD_CRITERIA = {"continuous": dict(type="SmoothL1RegressionLoss", beta=1.0, reduction="mean"),
                  "categorical": dict(type="CrossEntropyHeadLoss", reduction="mean")}
_HEAD_KEYS = {"name", "kind", "pred_key", "target_key", "aggregation", "loss_weight", "criterion", "required",
              "sentinel"}


def _mode_per_instance(values: torch.Tensor, inverse: torch.Tensor, num: int) -> torch.Tensor:
    """The most frequent value of each instance (ties: the smallest)."""
    values = values.long().reshape(-1)
    out = values.new_zeros(num)
    for inst in range(num):
        picked = values[inverse == inst]
        if picked.numel():
            out[inst] = torch.bincount(picked).argmax()
    return out


@LOSSES.register_module()
class FastUnifiedInstanceLoss(_QueryInstanceLoss):
    """The query-based instance loss with configurable per-query heads
    (upstream's loss of its detector-v5). ``query_heads``: a list of
    ``dict(name, kind="continuous" | "categorical", pred_key="pred_<name>",
    target_key=name, aggregation="mean" (continuous) | "mode" (categorical) |
    "first", loss_weight=1.0, criterion=SmoothL1RegressionLoss |
    CrossEntropyHeadLoss, required=True, sentinel=None)``: each matched query's
    ``pred[pred_key][b]`` row against its instance's aggregated per-point
    ``input_dict[target_key]``; a continuous head with ``sentinel`` skips
    instances whose target is the sentinel in every component.
    ``noobj_mask_loss_weight``: BCE pushing unmatched queries' masks to empty.
    ``overlap=True`` (upstream's overlapping-ring mode, from a membership
    matrix) is not built here: one error line."""

    domains = dict(segment_key=Key, query_heads=Seq(DictOf(Key, _TARGET)), membership_key=Key, valid_key=Key,
                   mask_pe_thresh=Real(-1e9, 1e9), noobj_mask_loss_weight=Weight)

    def __init__(self, cost_mask: float = 1.0, cost_dice: float = 1.0, cost_class: float = 0.0, num_points: int = 0,
                 ignore_index: int = -1, loss_weight_focal: float = 1.0, loss_weight_dice: float = 1.0,
                 cls_weight_matched: float = 2.0, cls_weight_noobj: float = 0.1, focal_alpha: float = 0.25,
                 focal_gamma: float = 2.0, truth_label: str = "instance", segment_key: str = "segment",
                 aux_loss_weight: float = 1.0, *, query_heads, overlap: bool = False, membership_key: str = "inst_pe",
                 valid_key: str = "ring_valid", mask_pe_thresh: float = 0.0, noobj_mask_loss_weight: float = 0.0):
        super().__init__(cost_mask, cost_dice, cost_class, num_points, ignore_index, loss_weight_focal,
                         loss_weight_dice, cls_weight_matched, cls_weight_noobj, focal_alpha, focal_gamma,
                         truth_label, aux_loss_weight)
        if overlap:
            raise ConfigError("FastUnifiedInstanceLoss: overlap=True (overlapping instances from a membership "
                              f"matrix {membership_key!r}) is not built here; use overlap=False with per-point "
                              "instance ids")
        self.segment_key, self.noobj_mask_loss_weight = segment_key, float(noobj_mask_loss_weight)
        self.overlap, self.membership_key, self.valid_key = False, membership_key, valid_key
        self.mask_pe_thresh = float(mask_pe_thresh)
        heads = []
        for head in query_heads or []:
            if not isinstance(head, dict) or not head.get("name"):
                raise ConfigError(f"FastUnifiedInstanceLoss: every query head needs a 'name', got {head!r}")
            unknown = set(head) - _HEAD_KEYS
            if unknown:
                raise ConfigError(f"FastUnifiedInstanceLoss: query head {head['name']!r} has unknown key(s) "
                                  f"{sorted(unknown)}; it takes {', '.join(sorted(_HEAD_KEYS))}")
            kind = head.get("kind", "continuous")
            if kind not in _HEAD_CRITERIA:
                raise ConfigError(f"FastUnifiedInstanceLoss: query head {head['name']!r}: kind must be 'continuous' "
                                  f"or 'categorical', got {kind!r}")
            aggregation = head.get("aggregation", "mean" if kind == "continuous" else "mode")
            if aggregation not in ("mean", "first", "mode"):
                raise ConfigError(f"FastUnifiedInstanceLoss: query head {head['name']!r}: aggregation must be "
                                  f"'mean', 'first' or 'mode', got {aggregation!r}")
            heads.append(dict(head, kind=kind, aggregation=aggregation))
        self.query_heads = heads
        self.head_losses = nn.ModuleDict({h["name"]: LOSSES.build(h.get("criterion", _HEAD_CRITERIA[h["kind"]]))
                                          for h in heads})

    def _component_names(self):
        return tuple(h["name"] for h in self.query_heads)

    def single_layer(self, pred: dict, input_dict: dict, events: list[dict]):
        loss, components = super().single_layer(pred, input_dict, events)
        # upstream's unified loss reports no class-term counts (its detectors' outputs have none)
        components.pop("num_cls_matched", None)
        components.pop("num_cls_noobj", None)
        return loss, components

    def _extra_terms(self, pred, input_dict, b, counts, event, idx_q, idx_gt, pred_sel, gt_sel) -> dict:
        out = {}
        for head in self.query_heads:
            name, kind = head["name"], head["kind"]
            pred_key, target_key = head.get("pred_key", f"pred_{name}"), head.get("target_key", name)
            weight = float(head.get("loss_weight", 1.0))
            if weight == 0.0:
                continue
            if pred_key not in pred or target_key not in input_dict:
                if head.get("required", True):
                    raise KeyError(f"FastUnifiedInstanceLoss: query head {name!r} needs the prediction {pred_key!r} "
                                   f"and the batch key {target_key!r}")
                continue
            values = _split(input_dict[target_key], counts)[b].to(pred_sel.device)[event["valid"]]
            if head["aggregation"] == "mean":
                per_inst = _mean_per_instance(values.float(), event["inverse"], event["num"])
            elif head["aggregation"] == "first":
                per_inst = _first_per_instance(values, event["inverse"], event["num"])
            else:
                per_inst = _mode_per_instance(values, event["inverse"], event["num"])
            predicted = pred[pred_key][b].to(pred_sel.device)[idx_q]
            target = per_inst[idx_gt]
            sentinel = head.get("sentinel")
            if kind == "continuous" and sentinel is not None:
                flat = target.reshape(target.shape[0], -1) if target.dim() > 1 else target[:, None]
                keep = ~(flat == float(sentinel)).all(dim=1)
                if not bool(keep.any()):
                    out[name] = (1.0, weight * (predicted.float().sum() * 0.0))
                    continue
                predicted, target = predicted[keep], target[keep]
            if kind == "continuous":
                target = target.to(predicted.dtype)
                if predicted.dim() == 1 and target.dim() == 2 and target.shape[-1] == 1:
                    target = target.squeeze(-1)
                if predicted.dim() == 2 and predicted.shape[-1] == 1 and target.dim() == 1:
                    predicted = predicted.squeeze(-1)
            out[name] = (1.0, weight * self.head_losses[name](predicted, target))
        return out
