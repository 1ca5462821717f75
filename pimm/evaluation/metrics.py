"""Evaluation metrics as plain functions of tensors.

The counting functions (:func:`confusion_matrix`, the instance matchers) run
on whatever device their inputs live on and return integer counts, so an
evaluator can accumulate them per batch and reduce across ranks with a single
``all_reduce(SUM)`` before turning them into scores with
:func:`segmentation_scores` / :func:`classification_scores`. Scores are
computed in float64 on the CPU and returned as Python floats and lists, ready
for logging.

Only deterministic ops are used (``bincount`` without weights, ``unique``), so
the functions also run under ``torch.use_deterministic_algorithms(True)``.
"""

from __future__ import annotations

import torch

__all__ = [
    "confusion_matrix",
    "segmentation_scores",
    "classification_scores",
    "adjusted_rand_index",
    "match_instances",
    "match_instances_per_class",
]


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, ignore_index: int = -1
) -> torch.Tensor:
    """``(K, K)`` int64 counts, rows = target class, columns = predicted class.

    Points whose target equals ``ignore_index`` are left out. Any other label
    outside ``[0, num_classes)`` is a ``ValueError`` (it would silently land in
    another cell otherwise)."""
    pred = pred.reshape(-1).long()
    target = target.reshape(-1).long()
    if pred.shape != target.shape:
        raise ValueError(f"pred has {pred.numel()} elements but target has {target.numel()}")
    keep = target != ignore_index
    pred, target = pred[keep], target[keep]
    # One device sync for the check; the details only when it fails.
    if bool(((target < 0) | (target >= num_classes) | (pred < 0) | (pred >= num_classes)).any()):
        raise ValueError(
            f"labels must be in [0, {num_classes}) (or ignore_index={ignore_index} in target); got target in "
            f"[{int(target.min())}, {int(target.max())}], pred in [{int(pred.min())}, {int(pred.max())}]"
        )
    counts = torch.bincount(target * num_classes + pred, minlength=num_classes * num_classes)
    return counts.reshape(num_classes, num_classes)


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with nan where ``den == 0`` (an undefined score, not zero)."""
    out = torch.full_like(num, float("nan"))
    defined = den > 0
    out[defined] = num[defined] / den[defined]
    return out


def _nanmean(values: torch.Tensor) -> float:
    return float(torch.nanmean(values)) if values.numel() else float("nan")


def segmentation_scores(conf: torch.Tensor) -> dict:
    """Per-class IoU and accuracy from a confusion matrix (rows = target).

    Returns ``iou`` (list, nan for a class absent from both target and
    prediction), ``mIoU`` (mean over the non-nan classes), ``acc`` (per-class
    recall, nan for a class absent from the target), ``mAcc`` and ``allAcc``
    (overall point accuracy)."""
    conf = conf.detach().to("cpu", torch.float64)
    hit = conf.diagonal()
    in_target = conf.sum(dim=1)
    in_pred = conf.sum(dim=0)
    iou = _ratio(hit, in_target + in_pred - hit)
    acc = _ratio(hit, in_target)
    total = conf.sum()
    return {
        "iou": iou.tolist(),
        "mIoU": _nanmean(iou),
        "acc": acc.tolist(),
        "mAcc": _nanmean(acc),
        "allAcc": float(hit.sum() / total) if total > 0 else float("nan"),
    }


def classification_scores(conf: torch.Tensor) -> dict:
    """Overall accuracy ``acc``, per-class accuracy ``class_acc`` (nan for a
    class with no samples), their mean ``mAcc`` and the confusion matrix as
    nested lists (``confusion``, rows = target)."""
    conf = conf.detach().cpu().long()
    conf_f = conf.double()
    total = conf_f.sum()
    class_acc = _ratio(conf_f.diagonal(), conf_f.sum(dim=1))
    return {
        "acc": float(conf_f.diagonal().sum() / total) if total > 0 else float("nan"),
        "class_acc": class_acc.tolist(),
        "mAcc": _nanmean(class_acc),
        "confusion": conf.tolist(),
    }


def _pairs(counts: torch.Tensor) -> torch.Tensor:
    """Number of unordered pairs, n choose 2, in float64 (exact below 2**53)."""
    counts = counts.double()
    return counts * (counts - 1) / 2


def adjusted_rand_index(labels_true: torch.Tensor, labels_pred: torch.Tensor) -> float:
    """Adjusted Rand index (Hubert & Arabie) between two labelings of the same points.

    Points with ``labels_true == -1`` are left out; label values themselves
    carry no meaning (any permutation scores the same). The index is undefined
    when the expected and maximum index coincide, which happens exactly when
    both partitions are a single cluster or both are all singletons; the
    partitions are then identical and the score is 1.0 (as is one point).
    No points at all gives nan."""
    labels_true = labels_true.reshape(-1)
    labels_pred = labels_pred.reshape(-1)
    if labels_true.shape != labels_pred.shape:
        raise ValueError(f"labels_true has {labels_true.numel()} elements but labels_pred has {labels_pred.numel()}")
    keep = labels_true != -1
    labels_true, labels_pred = labels_true[keep], labels_pred[keep]
    n = labels_true.numel()
    if n == 0:
        return float("nan")
    _, true_idx, true_sizes = torch.unique(labels_true, return_inverse=True, return_counts=True)
    _, pred_idx, pred_sizes = torch.unique(labels_pred, return_inverse=True, return_counts=True)
    # Non-zero cells of the contingency table, without building it densely.
    _, cell_sizes = torch.unique(true_idx * pred_sizes.numel() + pred_idx, return_counts=True)

    index = float(_pairs(cell_sizes).sum())
    sum_true = float(_pairs(true_sizes).sum())
    sum_pred = float(_pairs(pred_sizes).sum())
    all_pairs = n * (n - 1) / 2
    if all_pairs == 0:
        return 1.0
    expected = sum_true * sum_pred / all_pairs
    maximum = (sum_true + sum_pred) / 2
    if maximum == expected:
        return 1.0
    return (index - expected) / (maximum - expected)


def _instance_overlaps(gt_ids: torch.Tensor, pred_ids: torch.Tensor):
    """Compact gt/pred instance indices, their sizes, and every overlapping
    (gt, pred) pair with its IoU. Points with gt id -1 are left out; pred id
    -1 means "in no predicted instance"."""
    gt_ids = gt_ids.reshape(-1)
    pred_ids = pred_ids.reshape(-1)
    if gt_ids.shape != pred_ids.shape:
        raise ValueError(f"gt_ids has {gt_ids.numel()} elements but pred_ids has {pred_ids.numel()}")
    keep = gt_ids != -1
    gt_ids, pred_ids = gt_ids[keep], pred_ids[keep]
    gt_uniq, gt_idx, gt_sizes = torch.unique(gt_ids, return_inverse=True, return_counts=True)
    in_pred = pred_ids >= 0
    pred_uniq, pred_idx_valid, pred_sizes = torch.unique(pred_ids[in_pred], return_inverse=True, return_counts=True)
    pred_idx = torch.full_like(gt_idx, -1)
    pred_idx[in_pred] = pred_idx_valid
    num_pred = pred_uniq.numel()
    pair_codes, inter = torch.unique(gt_idx[in_pred] * num_pred + pred_idx_valid, return_counts=True)
    pair_gt = pair_codes // max(num_pred, 1)
    pair_pred = pair_codes % max(num_pred, 1)
    union = gt_sizes[pair_gt] + pred_sizes[pair_pred] - inter
    iou = inter.double() / union.double()
    return gt_idx, pred_idx, gt_uniq.numel(), num_pred, pair_gt, pair_pred, iou


def _count_matches(pair_gt: torch.Tensor, pair_pred: torch.Tensor, iou: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which candidate pairs are matched, one-to-one, among pairs with IoU > threshold.

    For threshold >= 0.5 no gt (or pred) can have two such pairs: IoU > 0.5
    means the overlap is more than half of each instance, and two disjoint
    instances cannot both cover more than half of a third. Every candidate is
    then a match and greedy matching is exact. Below 0.5 pairs are taken
    greedily by decreasing IoU (ties by lower gt, then pred index), a standard
    approximation of the optimal assignment."""
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"iou_threshold must be in [0, 1), got {threshold!r}")
    candidate = iou > threshold
    if threshold >= 0.5:
        return candidate
    matched = torch.zeros_like(candidate)
    order = sorted(
        candidate.nonzero().flatten().tolist(),
        key=lambda i: (-float(iou[i]), int(pair_gt[i]), int(pair_pred[i])),
    )
    used_gt: set[int] = set()
    used_pred: set[int] = set()
    for i in order:
        g, p = int(pair_gt[i]), int(pair_pred[i])
        if g not in used_gt and p not in used_pred:
            used_gt.add(g)
            used_pred.add(p)
            matched[i] = True
    return matched


def match_instances(
    gt_ids: torch.Tensor, pred_ids: torch.Tensor, iou_threshold: float = 0.5
) -> tuple[int, int, int]:
    """One-to-one match of predicted to ground-truth instances; ``(tp, fp, fn)``.

    ``gt_ids`` / ``pred_ids`` are per-point instance ids (any integers). Points
    with gt id -1 are ignored entirely; pred id -1 marks points in no predicted
    instance. A pair matches when its IoU is strictly above ``iou_threshold``
    (unique at >= 0.5, see :func:`_count_matches`). fp counts predicted
    instances left unmatched, fn ground-truth instances left unmatched."""
    _, _, num_gt, num_pred, pair_gt, pair_pred, iou = _instance_overlaps(gt_ids, pred_ids)
    tp = int(_count_matches(pair_gt, pair_pred, iou, iou_threshold).sum())
    return tp, num_pred - tp, num_gt - tp


def _majority_class(inst_idx: torch.Tensor, labels: torch.Tensor, num_inst: int, num_classes: int,
                    ignore_index: int) -> torch.Tensor:
    """Most frequent label per instance (lowest class on ties), -1 if it has no
    valid label. ``inst_idx`` -1 = point in no instance."""
    valid = (inst_idx >= 0) & (labels != ignore_index)
    votes = torch.bincount(
        inst_idx[valid] * num_classes + labels[valid].long(), minlength=num_inst * num_classes
    ).reshape(num_inst, num_classes)
    cls = votes.argmax(dim=1)
    cls[votes.sum(dim=1) == 0] = -1
    return cls


def match_instances_per_class(
    gt_ids: torch.Tensor,
    pred_ids: torch.Tensor,
    gt_sem: torch.Tensor,
    pred_sem: torch.Tensor,
    num_classes: int,
    iou_threshold: float = 0.5,
    ignore_index: int = -1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-class ``(tp, fp, fn)``, each a ``(num_classes,)`` int64 tensor.

    An instance's class is the majority label of its points: ``gt_sem`` for
    ground-truth instances, ``pred_sem`` (the predicted semantic labels) for
    predicted ones; points labelled ``ignore_index`` do not vote, and an
    instance with no voting point is left out of the counts. Only instances of
    the same class can match. Points with gt id -1 are ignored as in
    :func:`match_instances`."""
    gt_ids, pred_ids = gt_ids.reshape(-1), pred_ids.reshape(-1)
    gt_sem, pred_sem = gt_sem.reshape(-1), pred_sem.reshape(-1)
    if not gt_ids.shape == pred_ids.shape == gt_sem.shape == pred_sem.shape:
        raise ValueError("gt_ids, pred_ids, gt_sem and pred_sem must have one entry per point")
    for name, sem in (("gt_sem", gt_sem), ("pred_sem", pred_sem)):
        bad = (sem != ignore_index) & ((sem < 0) | (sem >= num_classes))
        if bool(bad.any()):
            raise ValueError(f"{name} has labels outside [0, {num_classes}) that are not ignore_index={ignore_index}")
    gt_idx, pred_idx, num_gt, num_pred, pair_gt, pair_pred, iou = _instance_overlaps(gt_ids, pred_ids)
    keep = gt_ids != -1
    gt_cls = _majority_class(gt_idx, gt_sem[keep], num_gt, num_classes, ignore_index)
    pred_cls = _majority_class(pred_idx, pred_sem[keep], num_pred, num_classes, ignore_index)

    # Restricting candidates to same-class pairs splits the matching into
    # independent per-class problems, so one pass serves every class.
    same = (gt_cls[pair_gt] == pred_cls[pair_pred]) & (gt_cls[pair_gt] >= 0)
    pair_gt, pair_pred, iou = pair_gt[same], pair_pred[same], iou[same]
    matched = _count_matches(pair_gt, pair_pred, iou, iou_threshold)

    def per_class(cls: torch.Tensor) -> torch.Tensor:
        return torch.bincount(cls[cls >= 0], minlength=num_classes)

    tp = per_class(gt_cls[pair_gt[matched]])
    return tp, per_class(pred_cls) - tp, per_class(gt_cls) - tp
