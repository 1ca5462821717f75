"""Query-based (Mask2Former-style) instance segmentation losses, under
upstream pimm's names and arguments: ``FastInstanceSegmentationLoss`` (also
registered as upstream's deprecated ``InstanceSegmentationLoss``) and
``FastInstanceSegmentationRegressionLoss``.

``forward(pred, input_dict)``: ``pred["pred_masks"]`` is one (Q, P_b) tensor
of mask logits per event (P_b its points), optionally ``pred_logits`` (Q, C+1
with the last class "no object"), ``pred_momentum``, ``pred_iou`` and
``aux_outputs`` (a list of such dicts, one per decoder layer);
``input_dict[truth_label]`` holds every point's instance id (``ignore_index``:
no instance) and ``segment`` its class. Per event the true instances are
matched one-to-one to queries by a minimum-cost assignment of ``cost_mask`` x
focal cost + ``cost_dice`` x Dice cost (+ ``cost_class`` x -log p(class));
matched pairs get a sigmoid focal loss (``focal_alpha``, ``focal_gamma``,
mean over points) and a Dice loss; with ``pred_logits`` the matched queries
learn their instance's class (``cls_weight_matched``) and the others "no
object" (``cls_weight_noobj``). Each term is averaged over the events that
have instances; auxiliary layers are added times ``aux_loss_weight``.
Returns ``(loss, components)``: the scalar and a dict of diagnostics
(``focal``, ``dice``, ``cls_matched``, ``cls_noobj``, ``num_pairs``, ...).
"""

from __future__ import annotations

from copy import deepcopy

import torch
import torch.nn.functional as F
from torch import nn

from pimm.utils.domains import (Anything, Count, DictOf, Int, Key, MAX_SIZE, NonNeg, Prob, Real, Seq, Weight)
from pimm.utils.errors import ConfigError

from .assignment import linear_sum_assignment
from .base import LOSSES

__all__ = ["FastInstanceSegmentationLoss", "FastInstanceSegmentationRegressionLoss", "event_instances",
           "match_queries"]


def _column(t: torch.Tensor) -> torch.Tensor:
    return t.squeeze(1) if t.dim() == 2 and t.shape[1] == 1 else t


def _split(values, counts):
    if isinstance(values, (list, tuple)):
        return [_column(v) for v in values]
    values = _column(values)
    if values.shape[0] != sum(counts):
        raise ValueError(f"instance loss: {values.shape[0]} target rows for {sum(counts)} predicted points "
                         "(pred_masks' widths must add up to the batch's points)")
    return list(values.split(counts))


def _first_per_instance(values: torch.Tensor, inverse: torch.Tensor, num: int) -> torch.Tensor:
    """The value at each instance's first point."""
    first = torch.full((num,), inverse.numel(), dtype=torch.long, device=inverse.device)
    first = first.scatter_reduce(0, inverse, torch.arange(inverse.numel(), device=inverse.device), reduce="amin")
    return values[first]


def _mean_per_instance(values: torch.Tensor, inverse: torch.Tensor, num: int) -> torch.Tensor:
    out = values.new_zeros((num,) + values.shape[1:]).index_add_(0, inverse, values)
    count = values.new_zeros(num).index_add_(0, inverse, torch.ones_like(inverse, dtype=values.dtype))
    return out / count.clamp_min(1).view((-1,) + (1,) * (values.dim() - 1))


def event_instances(ids, counts, segment=None, ignore_index=-1, device=None) -> list[dict]:
    """Per event: the kept points (``valid``), each kept point's instance index
    (``inverse``, instances in increasing id order), the instance count,
    sizes, one-hot masks (J, P_valid) and each instance's class (``segment``
    at its first point), or ``num == 0``."""
    ids_list = _split(ids, counts)
    seg_list = _split(segment, counts) if segment is not None else None
    events = []
    for b, full in enumerate(ids_list):
        full = full.to(device) if device is not None else full
        valid = full != ignore_index if ignore_index is not None else torch.ones_like(full, dtype=torch.bool)
        kept = full[valid]
        if kept.numel() == 0:
            events.append(dict(valid=valid, num=0))
            continue
        _, inverse = torch.unique(kept, sorted=True, return_inverse=True)
        num = int(inverse.max()) + 1
        inst_class = None
        if seg_list is not None:
            seg = seg_list[b].to(full.device)[valid]
            inst_class = _first_per_instance(seg, inverse, num).long()
        events.append(dict(valid=valid, inverse=inverse, num=num, sizes=torch.bincount(inverse, minlength=num),
                           masks=F.one_hot(inverse, num).T.float(), inst_class=inst_class))
    return events


@torch.no_grad()
def match_queries(mask_logits: torch.Tensor, event: dict, logits=None, cost_mask=1.0, cost_dice=1.0, cost_class=0.0,
                  num_points=0, focal_alpha=0.25, focal_gamma=2.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(query index, instance index) of the minimum-cost matching of one event."""
    empty = (torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    if event["num"] == 0 or mask_logits.shape[0] == 0:
        return empty
    pred = mask_logits[:, event["valid"]].float()
    points = pred.shape[1]
    if points == 0:
        return empty
    if num_points and points > num_points:
        pick = torch.randint(0, points, (num_points,), device=pred.device)  # upstream's sampling, with replacement
    else:
        pick = torch.arange(points, device=pred.device)
    pred, inverse = pred[:, pick], event["inverse"][pick]
    target = F.one_hot(inverse, event["num"]).T.float()
    prob = pred.sigmoid()
    neg = (1 - focal_alpha) * prob.pow(focal_gamma) * F.softplus(pred)
    pos = focal_alpha * (1 - prob).pow(focal_gamma) * F.softplus(-pred)
    cost = cost_mask * (neg.sum(-1, keepdim=True) + (pos - neg) @ target.T) / pred.shape[1]
    dice = 1 - (2 * prob @ target.T + 1) / (prob.sum(-1)[:, None] + target.sum(-1)[None, :] + 1)
    cost = cost + cost_dice * dice
    if logits is not None and cost_class > 0 and event["inst_class"] is not None:
        classes = logits.shape[-1] - 1
        inst_class = event["inst_class"] if pick.numel() == points else _first_per_instance(
            event["inst_class"][event["inverse"]][pick], inverse, event["num"])
        prob_class = logits[:, :classes].float().softmax(-1)
        cost = cost + cost_class * -torch.log(prob_class[:, inst_class.clamp(0, classes - 1)] + 1e-8)
    rows, cols = linear_sum_assignment(cost.cpu().numpy())
    return torch.as_tensor(rows, dtype=torch.long), torch.as_tensor(cols, dtype=torch.long)


_TARGET = Anything("a regression target's settings (target_key, pred_key, aggregation, loss_weight, criterion, "
                   "required), checked when the loss is built")


class _QueryInstanceLoss(nn.Module):
    """The shared single-layer loss and the deep-supervision sum."""

    domains = dict(cost_mask=NonNeg, cost_dice=NonNeg, cost_class=NonNeg, num_points=Count,
                   ignore_index=Int(-MAX_SIZE, MAX_SIZE), loss_weight_focal=Weight, loss_weight_dice=Weight,
                   cls_weight_matched=Weight, cls_weight_noobj=Weight, focal_alpha=Prob, focal_gamma=Real(0, 100),
                   truth_label=Key, aux_loss_weight=Weight)
    _AUX_KEYS = ("focal", "dice", "cls_matched", "cls_noobj", "momentum", "iou")

    def __init__(self, cost_mask=1.0, cost_dice=1.0, cost_class=0.0, num_points=0, ignore_index=-1,
                 loss_weight_focal=1.0, loss_weight_dice=1.0, cls_weight_matched=2.0, cls_weight_noobj=0.1,
                 focal_alpha=0.25, focal_gamma=2.0, truth_label="segment", aux_loss_weight=1.0,
                 momentum_loss_weight=0.0, iou_loss_weight=0.0):
        super().__init__()
        if cost_mask == 0 and cost_dice == 0 and cost_class == 0:
            raise ConfigError(f"{type(self).__name__}: cost_mask, cost_dice and cost_class are all 0: the matching "
                              "would be arbitrary; give at least one a positive weight")
        self.costs = dict(cost_mask=float(cost_mask), cost_dice=float(cost_dice), cost_class=float(cost_class),
                          num_points=int(num_points), focal_alpha=float(focal_alpha), focal_gamma=float(focal_gamma))
        self.ignore_index, self.truth_label = ignore_index, truth_label
        self.loss_weight_focal, self.loss_weight_dice = float(loss_weight_focal), float(loss_weight_dice)
        self.cls_weight_matched, self.cls_weight_noobj = float(cls_weight_matched), float(cls_weight_noobj)
        self.focal_alpha, self.focal_gamma = float(focal_alpha), float(focal_gamma)
        self.aux_loss_weight = float(aux_loss_weight)
        self.momentum_loss_weight, self.iou_loss_weight = float(momentum_loss_weight), float(iou_loss_weight)
        self.segment_key = "segment"
        self.noobj_mask_loss_weight = 0.0  # FastUnifiedInstanceLoss: push unmatched queries' masks to empty

    # -- terms -----------------------------------------------------------------
    def _mask_terms(self, pred_sel, gt_sel, sizes):
        prob = pred_sel.sigmoid()
        ce = F.binary_cross_entropy_with_logits(pred_sel, gt_sel, reduction="none")
        p_t = prob * gt_sel + (1 - prob) * (1 - gt_sel)
        alpha_t = self.focal_alpha * gt_sel + (1 - self.focal_alpha) * (1 - gt_sel)
        focal = (alpha_t * (1 - p_t) ** self.focal_gamma * ce).mean(dim=1)
        dice = 1 - (2 * (prob * gt_sel).sum(dim=1) + 1) / (prob.sum(dim=1) + sizes.to(prob.dtype) + 1)
        return focal, dice

    def _class_terms(self, logits, inst_class, idx_q, idx_gt):
        no_object = logits.shape[-1] - 1
        total, count, matched_ce, noobj_ce = logits.new_tensor(0.0), 0, None, None
        if idx_q.numel() and inst_class is not None:
            matched_ce = F.cross_entropy(logits[idx_q], inst_class[idx_gt])
            total, count = total + self.cls_weight_matched * matched_ce, count + 1
        unmatched = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        unmatched[idx_q] = False
        if unmatched.any():
            rest = logits[unmatched]
            noobj_ce = F.cross_entropy(rest, rest.new_full((rest.shape[0],), no_object, dtype=torch.long))
            total, count = total + self.cls_weight_noobj * noobj_ce, count + 1
        return total, count, matched_ce, noobj_ce

    def _extra_terms(self, pred, input_dict, b, counts, event, idx_q, idx_gt, pred_sel, gt_sel) -> dict:
        """name -> weighted scalar of the optional per-pair regressions."""
        out = {}
        if self.momentum_loss_weight > 0 and "pred_momentum" in pred and "momentum" in input_dict:
            mom = _split(input_dict["momentum"], counts)[b].to(pred_sel.device)[event["valid"]].float()
            per_inst = _mean_per_instance(mom, event["inverse"], event["num"])
            out["momentum"] = (self.momentum_loss_weight, F.smooth_l1_loss(
                pred["pred_momentum"][b].to(pred_sel.device)[idx_q], per_inst[idx_gt]))
        if self.iou_loss_weight > 0 and "pred_iou" in pred:
            hard = pred_sel.sigmoid() > 0.5
            inter = (hard * gt_sel).sum(dim=1)
            iou = inter / (hard.sum(dim=1) + gt_sel.sum(dim=1) - inter + 1e-6)
            out["iou"] = (self.iou_loss_weight, F.mse_loss(pred["pred_iou"][b].to(pred_sel.device)[idx_q], iou))
        return out

    # -- one decoder layer -----------------------------------------------------
    def single_layer(self, pred: dict, input_dict: dict, events: list[dict]):
        masks = pred["pred_masks"]
        counts = [m.shape[1] for m in masks]
        zero = masks[0].new_tensor(0.0)
        sums = dict(focal=zero, dice=zero, cls=zero, noobj=zero)
        extra_sum, extra_batches, extra_seen = {}, {}, {}
        diag = dict(focal=zero, dice=zero, ce_matched=zero, n_matched=zero, ce_noobj=zero, n_noobj=zero)
        pairs, batches, queries, instances = 0, 0, zero, zero
        logits_all = pred.get("pred_logits")
        for b, (mask_logits, event) in enumerate(zip(masks, events)):
            queries = queries + mask_logits.shape[0]
            idx_q, idx_gt = match_queries(mask_logits, event, None if logits_all is None else logits_all[b],
                                          **self.costs)
            if idx_q.numel() == 0 or event["num"] == 0:
                continue
            pm = mask_logits[:, event["valid"]]
            idx_q, idx_gt = idx_q.to(pm.device), idx_gt.to(pm.device)
            instances = instances + event["num"]
            pred_sel, gt_sel = pm[idx_q], event["masks"].to(pm.dtype)[idx_gt]
            focal, dice = self._mask_terms(pred_sel, gt_sel, event["sizes"][idx_gt])
            n = pred_sel.shape[0]
            sums["focal"] = sums["focal"] + focal.sum() / n
            sums["dice"] = sums["dice"] + dice.sum() / n
            diag["focal"], diag["dice"] = diag["focal"] + focal.sum(), diag["dice"] + dice.sum()
            pairs += n
            batches += 1
            if self.noobj_mask_loss_weight > 0:
                unmatched = torch.ones(pm.shape[0], dtype=torch.bool, device=pm.device)
                unmatched[idx_q] = False
                if unmatched.any():
                    rest = pm[unmatched]
                    sums["noobj"] = sums["noobj"] + F.binary_cross_entropy_with_logits(rest, torch.zeros_like(rest))
            if logits_all is not None and self.segment_key in input_dict:
                inst_class = None if event["inst_class"] is None else event["inst_class"].to(pm.device)
                cls_total, cls_count, matched_ce, noobj_ce = self._class_terms(logits_all[b], inst_class, idx_q,
                                                                               idx_gt)
                if cls_count:
                    sums["cls"] = sums["cls"] + cls_total / cls_count
                if matched_ce is not None:
                    diag["ce_matched"], diag["n_matched"] = diag["ce_matched"] + matched_ce, diag["n_matched"] + 1
                if noobj_ce is not None:
                    diag["ce_noobj"], diag["n_noobj"] = diag["ce_noobj"] + noobj_ce, diag["n_noobj"] + 1
            for name, (weight, value) in self._extra_terms(pred, input_dict, b, counts, event, idx_q, idx_gt,
                                                           pred_sel, gt_sel).items():
                extra_sum[name] = extra_sum.get(name, zero) + value
                extra_batches[name] = extra_batches.get(name, 0) + 1
                extra_seen[name] = weight
        denom = max(batches, 1)
        loss = (self.loss_weight_focal * sums["focal"] / denom + self.loss_weight_dice * sums["dice"] / denom
                + sums["cls"] / denom)
        if self.noobj_mask_loss_weight > 0:
            loss = loss + self.noobj_mask_loss_weight * sums["noobj"] / denom
        for name, total in extra_sum.items():
            loss = loss + extra_seen[name] * total / extra_batches[name]
        components = {
            "focal": diag["focal"] / max(pairs, 1), "dice": diag["dice"] / max(pairs, 1),
            "cls_matched": diag["ce_matched"] / diag["n_matched"].clamp_min(1),
            "cls_noobj": diag["ce_noobj"] / diag["n_noobj"].clamp_min(1),
            "num_pairs": pairs, "queries_total": queries, "gt_instances_total": instances,
            "unmatched_queries": queries - pairs, "unmatched_gt": instances - pairs,
            "num_cls_matched": diag["n_matched"], "num_cls_noobj": diag["n_noobj"],
        }
        for name in self._component_names():
            components.setdefault(name, extra_sum.get(name, zero) / max(extra_batches.get(name, 0), 1))
        return loss, components

    def _component_names(self):
        return ("momentum", "iou")

    def forward(self, pred, input_dict: dict):
        if hasattr(pred, "outputs"):
            pred = pred.outputs
        if not isinstance(pred, dict) or "pred_masks" not in pred:
            raise TypeError(f"{type(self).__name__}: the model's prediction must be a dict with 'pred_masks' (one "
                            "(queries, points) tensor per event)")
        if self.truth_label not in input_dict:
            raise KeyError(f"{type(self).__name__}: the batch has no {self.truth_label!r} (truth_label: the "
                           f"per-point instance ids); keys: {sorted(input_dict)}")
        masks = pred["pred_masks"]
        events = event_instances(input_dict[self.truth_label], [m.shape[1] for m in masks],
                                 segment=input_dict.get(self.segment_key), ignore_index=self.ignore_index,
                                 device=masks[0].device if len(masks) else None)
        loss, components = self.single_layer(pred, input_dict, events)
        if pred.get("aux_outputs"):
            aux = masks[0].new_tensor(0.0)
            for layer, aux_pred in enumerate(pred["aux_outputs"]):
                aux_loss, aux_comp = self.single_layer(aux_pred, input_dict, events)
                aux = aux + aux_loss
                for key in self._AUX_KEYS + tuple(self._component_names()):
                    if key in aux_comp:
                        components[f"aux_{key}_L{layer}"] = aux_comp[key]
            loss = loss + self.aux_loss_weight * aux
        return loss, components


@LOSSES.register_module(["FastInstanceSegmentationLoss", "InstanceSegmentationLoss"])
class FastInstanceSegmentationLoss(_QueryInstanceLoss):
    """The query-based instance loss (module doc). ``momentum_loss_weight``:
    smooth-L1 of ``pred_momentum`` against each matched instance's mean
    ``momentum``; ``iou_loss_weight``: MSE of ``pred_iou`` against the matched
    mask's IoU (prediction thresholded at 0.5). ``InstanceSegmentationLoss``
    is upstream's deprecated name of the same loss."""

    domains = dict(momentum_loss_weight=Weight, iou_loss_weight=Weight)

    def __init__(self, cost_mask: float = 1.0, cost_dice: float = 1.0, cost_class: float = 0.0, num_points: int = 0,
                 ignore_index: int = -1, loss_weight_focal: float = 1.0, loss_weight_dice: float = 1.0,
                 cls_weight_matched: float = 2.0, cls_weight_noobj: float = 0.1, focal_alpha: float = 0.25,
                 focal_gamma: float = 2.0, truth_label: str = "segment", aux_loss_weight: float = 1.0,
                 momentum_loss_weight: float = 0.0, iou_loss_weight: float = 0.0):
        super().__init__(cost_mask, cost_dice, cost_class, num_points, ignore_index, loss_weight_focal,
                         loss_weight_dice, cls_weight_matched, cls_weight_noobj, focal_alpha, focal_gamma,
                         truth_label, aux_loss_weight, momentum_loss_weight, iou_loss_weight)


def _regression_targets(targets) -> list[dict]:
    if targets is None:
        return []
    if isinstance(targets, dict):
        targets = [targets] if "name" in targets else [dict(cfg, name=name) for name, cfg in targets.items()]
    out, seen = [], set()
    for cfg in targets:
        if not isinstance(cfg, dict) or not cfg.get("name"):
            raise ConfigError(f"regression_targets: every entry needs a non-empty 'name', got {cfg!r}")
        cfg = deepcopy(cfg)
        if cfg["name"] in seen:
            raise ConfigError(f"regression_targets: {cfg['name']!r} appears twice")
        seen.add(cfg["name"])
        unknown = set(cfg) - {"name", "target_key", "pred_key", "aggregation", "loss_weight", "criterion", "required"}
        if unknown:
            raise ConfigError(f"regression_targets[{cfg['name']!r}]: unknown key(s) {sorted(unknown)}; it takes name, "
                              "target_key, pred_key, aggregation, loss_weight, criterion, required")
        cfg.setdefault("target_key", cfg["name"])
        cfg.setdefault("pred_key", f"pred_{cfg['name']}")
        cfg.setdefault("aggregation", "mean")
        cfg.setdefault("loss_weight", 1.0)
        cfg.setdefault("criterion", dict(type="SmoothL1RegressionLoss", beta=1.0, reduction="mean"))
        cfg.setdefault("required", True)
        if cfg["aggregation"] not in ("mean", "first"):
            raise ConfigError(f"regression_targets[{cfg['name']!r}]: aggregation must be 'mean' or 'first', got "
                              f"{cfg['aggregation']!r}")
        out.append(cfg)
    return out


@LOSSES.register_module()
class FastInstanceSegmentationRegressionLoss(_QueryInstanceLoss):
    """The query-based instance loss plus per-instance regressions on the
    matched pairs. ``regression_targets``: a list (or a name-keyed dict) of
    ``dict(name, target_key=name, pred_key="pred_<name>", aggregation="mean"
    | "first", loss_weight=1.0, criterion=SmoothL1RegressionLoss, required=True)``:
    ``pred[pred_key][b]`` (one row per query) is compared by ``criterion``
    with the instance's mean (or first point's) ``input_dict[target_key]``.
    A missing key is an error unless ``required=False``."""

    domains = dict(regression_targets=Seq(DictOf(Key, _TARGET)) | DictOf(Key, _TARGET) | None)

    def __init__(self, cost_mask: float = 1.0, cost_dice: float = 1.0, cost_class: float = 0.0, num_points: int = 0,
                 ignore_index: int = -1, loss_weight_focal: float = 1.0, loss_weight_dice: float = 1.0,
                 cls_weight_matched: float = 2.0, cls_weight_noobj: float = 0.1, focal_alpha: float = 0.25,
                 focal_gamma: float = 2.0, truth_label: str = "segment", aux_loss_weight: float = 1.0,
                 regression_targets=None):
        super().__init__(cost_mask, cost_dice, cost_class, num_points, ignore_index, loss_weight_focal,
                         loss_weight_dice, cls_weight_matched, cls_weight_noobj, focal_alpha, focal_gamma,
                         truth_label, aux_loss_weight)
        self.regression_targets = _regression_targets(regression_targets)
        self.regression_losses = nn.ModuleDict({cfg["name"]: LOSSES.build(cfg["criterion"])
                                                for cfg in self.regression_targets})

    def _component_names(self):
        return tuple(cfg["name"] for cfg in self.regression_targets)

    def _extra_terms(self, pred, input_dict, b, counts, event, idx_q, idx_gt, pred_sel, gt_sel) -> dict:
        out = {}
        for cfg in self.regression_targets:
            weight = float(cfg["loss_weight"])
            if weight == 0.0:
                continue
            if cfg["pred_key"] not in pred or cfg["target_key"] not in input_dict:
                if cfg["required"]:
                    raise KeyError(f"FastInstanceSegmentationRegressionLoss: regression target {cfg['name']!r} needs "
                                   f"the prediction {cfg['pred_key']!r} and the batch key {cfg['target_key']!r}")
                continue
            values = _split(input_dict[cfg["target_key"]], counts)[b].to(pred_sel.device)[event["valid"]].float()
            per_inst = (_mean_per_instance(values, event["inverse"], event["num"]) if cfg["aggregation"] == "mean"
                        else _first_per_instance(values, event["inverse"], event["num"]))
            predicted = pred[cfg["pred_key"]][b].to(pred_sel.device)[idx_q]
            target = per_inst[idx_gt].to(predicted.dtype)
            if predicted.dim() == 1 and target.dim() == 2 and target.shape[-1] == 1:
                target = target.squeeze(-1)
            if predicted.dim() == 2 and predicted.shape[-1] == 1 and target.dim() == 1:
                predicted = predicted.squeeze(-1)
            out[cfg["name"]] = (1.0, weight * self.regression_losses[cfg["name"]](predicted, target))
        return out

