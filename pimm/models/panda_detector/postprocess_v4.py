"""``detector-v4``'s panoptic fusion over a batch, as upstream returns it.

Each event is fused by :func:`.postprocess.postprocess_event` (the same
fusion as ``detector-v5``); the batch result differs in two ways, both
upstream's v4 behaviour: instance ids run on across the batch (event 2's
first instance is one more than event 1's last) instead of restarting per
event, and the per-query-head entries (``instance_regression``,
``instance_<name>``, ``pred_<name>``, ``instance_momentum``) are there only
when the label has query heads.
"""

from __future__ import annotations

import torch

from .postprocess import postprocess_event

__all__ = ["postprocess_batch_v4", "select_label_outputs"]


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


@torch.no_grad()
def postprocess_batch_v4(pred_masks: list, pred_logits: list, stuff_probs: torch.Tensor | None = None,
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
