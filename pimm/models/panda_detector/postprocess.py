"""Panoptic fusion of the detector's query predictions into per-point labels.

Per event: a query is kept when its most probable class is a real "thing"
class (not "no object", not a stuff class), its probability reaches
``conf_threshold`` and its thresholded mask (``sigmoid > mask_threshold``,
minus the points the stuff head claims) has ``min_points`` points. Kept
queries are scored by class probability x mean mask probability inside the
mask, decayed by matrix NMS (SOLOv2: a mask overlapping a higher-scoring
mask of the same class loses score, ``gaussian`` exp(-sigma IoU^2) or
``linear`` 1 - IoU), filtered again at ``conf_threshold``, and painted in
decreasing score order, each point to the first query that claims it (a
query left with fewer than ``min_points`` unclaimed points paints nothing).
``fill_uncovered`` lets the kept queries, best first, also claim points
that the NMS survivors left uncovered. Points of stuff (stuff probability at
``stuff_threshold``) end as instance -1.

Returned per point (the batch concatenated): ``instance_labels`` (-1 none;
:func:`postprocess_event` numbers an event's instances from 1, and
:func:`postprocess_batch` makes them unique in the batch as upstream does:
each event's ids are shifted by one more than the largest id before it, so
event 2's first instance is event 1's last plus 2),
``class_labels`` (``background_class_label`` where none), ``confidences``,
``query_labels`` (the painting query) and, with query heads, each head's value
of the painting query, ``instance_<name>`` / ``pred_<name>`` (nan where none).
"""

from __future__ import annotations

import torch

__all__ = ["matrix_nms", "postprocess_event", "postprocess_batch", "select_label_outputs"]


@torch.no_grad()
def matrix_nms(masks: torch.Tensor, labels: torch.Tensor, scores: torch.Tensor, kernel: str = "gaussian",
               sigma: float = 2.0, pre: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Decayed scores of boolean ``masks`` (K, P) and the order they were
    sorted in (descending input score; ``pre`` > 0 keeps only the first
    ``pre``). Only same-label pairs decay each other."""
    order = torch.argsort(scores, descending=True, stable=True)
    if pre > 0:
        order = order[:pre]
    if order.numel() == 0:
        return scores.new_zeros(0), order
    m = masks[order].float()
    area = m.sum(1)
    inter = m @ m.T
    iou = (inter / (area[:, None] + area[None, :] - inter).clamp_min(1e-6)).triu(diagonal=1)
    same = labels[order][:, None] == labels[order][None, :]
    iou = iou * same.triu(diagonal=1)
    # Each mask's own worst overlap with a better one: a mask that is itself
    # suppressed suppresses others less (the "compensation" of matrix NMS).
    comp = iou.max(dim=0).values[:, None].expand_as(iou)
    if kernel == "gaussian":
        decay = (torch.exp(-sigma * iou ** 2) / torch.exp(-sigma * comp ** 2).clamp_min(1e-6)).min(dim=0).values
    elif kernel == "linear":
        decay = ((1 - iou) / (1 - comp).clamp_min(1e-6)).min(dim=0).values
    else:
        raise ValueError(f"matrix_nms: kernel must be 'gaussian' or 'linear', got {kernel!r}")
    return scores[order] * decay, order


@torch.no_grad()
def postprocess_event(masks: torch.Tensor, logits: torch.Tensor, stuff_probs: torch.Tensor | None = None,
                      regression: dict | None = None, stuff_classes=(), stuff_threshold: float = 0.5,
                      mask_threshold: float = 0.5, conf_threshold: float = 0.5, nms_kernel: str = "gaussian",
                      nms_sigma: float = 2.0, nms_pre: int = -1, nms_max: int = -1, min_points: int = 20,
                      fill_uncovered: bool = True, background_class_label: int = -1) -> dict:
    """One event: ``masks`` (Q, P) logits, ``logits`` (Q, C+1), ``stuff_probs`` (P,),
    ``regression`` name -> (Q,) or (Q, D) -> the per-point dict of the module doc."""
    num_points, device = masks.shape[1], masks.device
    prob_mask = masks.float().sigmoid()
    binary = prob_mask > mask_threshold
    if stuff_probs is not None:
        binary &= (stuff_probs.float() < stuff_threshold).unsqueeze(0)
    probs = logits.float().softmax(-1)
    scores, labels = probs.max(-1)
    no_object = logits.shape[-1] - 1
    keep = (labels != no_object) & (scores >= conf_threshold) & (binary.sum(1) >= min_points)
    for cls in stuff_classes:
        keep &= labels != int(cls)
    inst = torch.full((num_points,), -1, dtype=torch.long, device=device)
    cls_out = torch.full((num_points,), background_class_label, dtype=torch.long, device=device)
    conf = torch.zeros(num_points, device=device)
    query = torch.full((num_points,), -1, dtype=torch.long, device=device)
    regression = {k: v.float() for k, v in (regression or {}).items()}
    reg_out = {k: torch.full((num_points,) + v.shape[1:], float("nan"), device=device) for k, v in regression.items()}

    def paint(where: torch.Tensor, q: int, label: int, score: float, inst_id: int) -> None:
        inst[where], cls_out[where], conf[where], query[where] = inst_id, label, score, q
        for name, values in regression.items():
            reg_out[name][where] = values[q]

    kept = torch.nonzero(keep).flatten()
    if kept.numel():
        sel_binary = binary[kept]
        mean_prob = (prob_mask[kept] * sel_binary).sum(1) / sel_binary.sum(1).clamp_min(1)
        combined = mean_prob * scores[kept]
        decayed, order = matrix_nms(sel_binary, labels[kept], combined, nms_kernel, nms_sigma, nms_pre)
        survivors = decayed >= conf_threshold
        decayed, order = decayed[survivors], order[survivors]
        resort = torch.argsort(decayed, descending=True, stable=True)
        decayed, order = decayed[resort], order[resort]
        if nms_max > 0:
            decayed, order = decayed[:nms_max], order[:nms_max]
        taken = torch.zeros(num_points, dtype=torch.bool, device=device)
        for rank, (i, score) in enumerate(zip(order.tolist(), decayed.tolist())):
            claim = sel_binary[i] & ~taken
            if int(claim.sum()) < min_points:
                continue
            paint(claim, int(kept[i]), int(labels[kept[i]]), score, rank + 1)
            taken |= claim
        if fill_uncovered:
            for i in torch.argsort(combined, descending=True, stable=True).tolist():
                claim = sel_binary[i] & ~taken
                if int(claim.sum()) < min_points:
                    continue
                paint(claim, int(kept[i]), int(labels[kept[i]]), float(combined[i]), int(inst.max()) + 1)
                taken |= claim
    if stuff_probs is not None:
        stuff = stuff_probs.float() >= stuff_threshold
        inst[stuff], cls_out[stuff], query[stuff] = -1, background_class_label, -1
        conf[stuff] = stuff_probs.float()[stuff]
        for values in reg_out.values():
            values[stuff] = float("nan")
    out = {"instance_labels": inst, "class_labels": cls_out, "confidences": conf, "query_labels": query,
           "instance_regression": reg_out}
    for name, values in reg_out.items():
        out[f"instance_{name}"] = out[f"pred_{name}"] = values
    return out


@torch.no_grad()
def postprocess_batch(pred_masks: list, pred_logits: list, stuff_probs: torch.Tensor | None = None,
                      pred_regression: dict | None = None, point_counts: torch.Tensor | None = None,
                      **options) -> dict:
    """Per point over the batch: ``instance_labels`` (-1: none; ids unique in
    the batch), ``class_labels``, ``confidences``, ``query_labels`` and, with
    query heads, each head's value of the painting query. The stuff
    probabilities are cut per event by ``point_counts`` (upstream ignores
    them when the counts are not given)."""
    if stuff_probs is not None and point_counts is None:
        stuff_probs = None
    starts = [0]
    for masks in pred_masks:
        starts.append(starts[-1] + masks.shape[1])
    events, next_id = [], 0
    for b, (masks, logits) in enumerate(zip(pred_masks, pred_logits)):
        stuff = None if stuff_probs is None else stuff_probs[starts[b]:starts[b + 1]]
        regression = {name: values[b] for name, values in (pred_regression or {}).items()}
        event = postprocess_event(masks, logits, stuff, regression, **options)
        ids = event["instance_labels"]
        assigned = ids >= 0
        if assigned.any():
            ids[assigned] += next_id
            next_id = int(ids.max()) + 1
        events.append(event)
    out = {key: torch.cat([e[key] for e in events]) if events else torch.zeros(0)
           for key in ("instance_labels", "class_labels", "confidences", "query_labels")}
    names = list(events[0]["instance_regression"]) if events else []
    if names:
        out["instance_regression"] = {name: torch.cat([e["instance_regression"][name] for e in events])
                                      for name in names}
        for name, values in out["instance_regression"].items():
            out[f"instance_{name}"] = out[f"pred_{name}"] = values
        out["instance_momentum"] = out["instance_regression"].get("momentum")
    return out


def select_label_outputs(forward_output: dict, label: str) -> tuple:
    """(pred_masks, pred_logits, stuff_probs, pred_regression, point_counts)
    of ``label`` from a forward output: its ``outputs_by_label``, else its
    ``*_by_label`` maps, else the plain keys (upstream's three forms)."""
    counts = forward_output.get("point_counts")
    if counts is None:
        counts = forward_output.get(f"{label}_point_counts")
    if "outputs_by_label" in forward_output:
        out = forward_output["outputs_by_label"][label]
        return out["pred_masks"], out["pred_logits"], out.get("stuff_probs"), out.get("pred_regression"), counts
    if label in forward_output.get("pred_masks_by_label", {}):
        return (forward_output["pred_masks_by_label"][label], forward_output["pred_logits_by_label"][label],
                forward_output.get("stuff_probs_by_label", {}).get(label),
                forward_output.get("pred_regression_by_label", {}).get(label), counts)
    return (forward_output["pred_masks"], forward_output["pred_logits"], forward_output.get("stuff_probs"),
            forward_output.get("pred_regression"), counts)
