"""Matched-instance metrics of one event, as upstream pimm's instance
evaluator computes them, kept as sums that add over events and ranks.

Per event: true and predicted instances (ids >= 0 per point; -1 none) get a
class each, the most frequent valid class (0..K-1) of their points (ties: the
smaller class; an instance with none has no class). Candidate pairs are every
overlapping (pred, true) pair with IoU >= ``iou_thresh`` (same class only,
with ``require_class_for_match``); they are matched greedily, highest IoU
first, one-to-one.

:func:`event_counts` returns the sums; :func:`scores` turns summed counts into
upstream's numbers: detection ``precision = TP / #pred``, ``recall = TP /
#true``, ``f1``, the mean IoU of the matches, fp / fn per true instance; the
classification of the matched pairs (a K x K confusion matrix: per-class
precision, recall, F1 and their macro means over the classes that occur
among the matched true instances); and panoptic quality ``PQ = SQ x RQ`` with
``SQ`` the mean IoU of the class-correct matches and ``RQ = TP_c / (TP_c +
FP/2 + FN/2)`` (``TP_c`` the class-correct matches, FP and FN unmatched
predicted and true instances).
"""

from __future__ import annotations

import numpy as np

__all__ = ["instance_classes", "match_greedy", "event_counts", "scores", "adjusted_rand_score", "COUNT_NAMES"]


def instance_classes(inst: np.ndarray, cls: np.ndarray, num_classes: int) -> dict[int, int]:
    """Instance id -> its majority class among points with a class in 0..K-1."""
    use = (inst >= 0) & (cls >= 0) & (cls < num_classes)
    out: dict[int, int] = {}
    if not use.any():
        return out
    pairs, counts = np.unique(np.stack([inst[use], cls[use]], axis=1), axis=0, return_counts=True)
    # Within each instance: most points first, then the smaller class (stable).
    order = np.lexsort((pairs[:, 1], -counts, pairs[:, 0]))
    pairs = pairs[order]
    first = np.r_[True, pairs[1:, 0] != pairs[:-1, 0]]
    for i, c in pairs[first]:
        out[int(i)] = int(c)
    return out


def match_greedy(gt: np.ndarray, pred: np.ndarray, iou_thresh: float, gt_class=None, pred_class=None):
    """One-to-one matches ``[(pred id, true id, iou)]`` by decreasing IoU, plus
    the instance sizes ``(pred sizes, true sizes)`` as dicts. With class maps,
    only pairs of the same class are candidates."""
    pred_ids, pred_n = np.unique(pred[pred >= 0], return_counts=True)
    gt_ids, gt_n = np.unique(gt[gt >= 0], return_counts=True)
    pred_size = dict(zip(pred_ids.tolist(), pred_n.tolist()))
    gt_size = dict(zip(gt_ids.tolist(), gt_n.tolist()))
    both = (gt >= 0) & (pred >= 0)
    candidates = []
    if both.any():
        pairs, inter = np.unique(np.stack([pred[both], gt[both]], axis=1), axis=0, return_counts=True)
        for (p, g), n in zip(pairs.tolist(), inter.tolist()):
            if gt_class is not None and (pred_class.get(p, -1) != gt_class.get(g, -2)):
                continue
            iou = n / (pred_size[p] + gt_size[g] - n)
            if iou >= iou_thresh:
                candidates.append((iou, p, g))
    # Highest IoU first; equal IoUs in (pred, true) id order, so the result is deterministic.
    candidates.sort(key=lambda t: (-t[0], t[1], t[2]))
    used_p, used_g, matches = set(), set(), []
    for iou, p, g in candidates:
        if p not in used_p and g not in used_g:
            matches.append((p, g, iou))
            used_p.add(p), used_g.add(g)
    return matches, pred_size, gt_size


def adjusted_rand_score(a: np.ndarray, b: np.ndarray) -> float:
    """Adjusted Rand index of two labelings of the same points (every label,
    -1 included, is a cluster); nan for fewer than two points."""
    n = len(a)
    if n < 2:
        return float("nan")
    _, ai = np.unique(a, return_inverse=True)
    _, bi = np.unique(b, return_inverse=True)
    table = np.zeros((ai.max() + 1, bi.max() + 1), dtype=np.float64)
    np.add.at(table, (ai, bi), 1)
    comb = lambda x: (x * (x - 1) / 2.0).sum()  # noqa: E731
    index, rows, cols = comb(table), comb(table.sum(1)), comb(table.sum(0))
    expected = rows * cols / comb(np.array([n], dtype=np.float64))
    maximum = (rows + cols) / 2.0
    if maximum == expected:  # both labelings a single cluster (or all singletons): identical partitions
        return 1.0
    return float((index - expected) / (maximum - expected))


COUNT_NAMES = ("num_gt", "num_pred", "num_matched", "iou_sum", "tp_class", "iou_sum_class")


def event_counts(gt_inst, pred_inst, gt_cls, pred_cls, num_classes: int, iou_thresh: float = 0.5,
                 require_class_for_match: bool = False) -> tuple[np.ndarray, np.ndarray, list]:
    """One event -> (counts: the ``COUNT_NAMES`` sums, the K x K confusion
    of the matched pairs (true class rows), the matches ``[(pred, true, iou)]``)."""
    gt_inst, pred_inst = np.asarray(gt_inst, np.int64), np.asarray(pred_inst, np.int64)
    gt_map = instance_classes(gt_inst, np.asarray(gt_cls, np.int64), num_classes)
    pred_map = instance_classes(pred_inst, np.asarray(pred_cls, np.int64), num_classes)
    classes = (gt_map, pred_map) if require_class_for_match else (None, None)
    matches, pred_size, gt_size = match_greedy(gt_inst, pred_inst, iou_thresh, *classes)
    confusion = np.zeros((num_classes, num_classes), dtype=np.int64)
    tp_class, iou_class = 0, 0.0
    for p, g, iou in matches:
        gc, pc = gt_map.get(g, -1), pred_map.get(p, -1)
        if gc >= 0 and pc >= 0:
            confusion[gc, pc] += 1
            if gc == pc:
                tp_class, iou_class = tp_class + 1, iou_class + iou
    counts = np.array([len(gt_size), len(pred_size), len(matches), sum(m[2] for m in matches), tp_class, iou_class],
                      dtype=np.float64)
    return counts, confusion, matches


def _ratio(num: float, den: float) -> float:
    return float(num / den) if den > 0 else 0.0  # upstream reports 0 for an undefined ratio


def scores(counts, confusion, class_names) -> dict[str, float]:
    """Upstream's metrics from summed :func:`event_counts` (module doc)."""
    num_gt, num_pred, tp, iou_sum, tp_class, iou_class = (float(c) for c in counts)
    fp, fn = num_pred - tp, num_gt - tp
    precision, recall = _ratio(tp, num_pred), _ratio(tp, num_gt)
    out = {"ins_det_precision": precision, "ins_det_recall": recall,
           "ins_det_f1": _ratio(2 * precision * recall, precision + recall), "ins_det_mean_iou": _ratio(iou_sum, tp),
           "ins_det_fp": fp, "ins_det_fn": fn, "ins_det_fp_per_gt": _ratio(fp, num_gt),
           "ins_det_fn_per_gt": _ratio(fn, num_gt)}
    confusion = np.asarray(confusion, dtype=np.float64)
    diag = np.diag(confusion)
    per_p = [_ratio(d, c) for d, c in zip(diag, confusion.sum(0))]
    per_r = [_ratio(d, c) for d, c in zip(diag, confusion.sum(1))]
    per_f = [_ratio(2 * p * r, p + r) for p, r in zip(per_p, per_r)]
    present = confusion.sum(1) > 0
    for key, values in (("precision", per_p), ("recall", per_r), ("f1", per_f)):
        out[f"ins_cls_macro_{key}"] = float(np.mean(np.asarray(values)[present])) if present.any() else 0.0
    for name, f1, n in zip(class_names, per_f, present):
        if n:
            out[f"ins_cls_f1_{name}"] = f1
    sq = _ratio(iou_class, tp_class)
    rq = _ratio(tp_class, tp_class + 0.5 * fp + 0.5 * fn)
    out.update(ins_pq=sq * rq, ins_sq=sq, ins_rq=rq)
    return out
