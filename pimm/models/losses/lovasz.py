"""Lovász losses (Berman, Rannen Triki, Blaschko, CVPR 2018): convex
surrogates of 1 - IoU, with upstream pimm's arguments.

* ``mode="multiclass"``: Lovász-softmax. Per class ``c``: the errors
  ``|[y = c] - p_c|`` sorted in decreasing order, dotted with the gradient of
  the Lovász extension of the Jaccard loss (``lovasz_grad``, the paper's
  Alg. 1); the loss is the mean over the classes taken.
* ``mode="binary"`` / ``"multilabel"``: Lovász hinge on raw logits (targets
  0/1; multilabel flattens the (N, C) scores and targets into one binary
  problem, as upstream does). Errors ``relu(1 - s * (2y - 1))``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from pimm.utils.domains import Choice, DictOf, Int, MAX_SIZE, NonNeg, Seq, Weight
from pimm.utils.errors import ConfigError

from .base import LOSSES, drop_ignored, split_events, zero_loss

__all__ = ["LovaszLoss", "lovasz_grad"]

MODES = ("multiclass", "binary", "multilabel")


def lovasz_grad(gt_sorted: torch.Tensor) -> torch.Tensor:
    """Gradient of the Lovász extension of the Jaccard loss w.r.t. errors sorted
    in decreasing order (Berman et al. 2018, Alg. 1), along the last dimension
    (a (K, N) input holds K independent problems, one per row)."""
    gt_sorted = gt_sorted.float()
    gts = gt_sorted.sum(-1, keepdim=True)
    intersection = gts - gt_sorted.cumsum(-1)
    union = gts + (1.0 - gt_sorted).cumsum(-1)
    jaccard = 1.0 - intersection / union
    if gt_sorted.shape[-1] > 1:
        jaccard[..., 1:] = jaccard[..., 1:] - jaccard[..., :-1]
    return jaccard


def _class_weights(value) -> dict[int, float] | list[float] | None:
    if value is None:
        return None
    try:
        if isinstance(value, Mapping):
            return {int(k): float(v) for k, v in value.items()}
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if isinstance(value, Sequence) and not isinstance(value, str):
            return [float(v) for v in value]
    except (TypeError, ValueError):
        pass
    raise ConfigError(f"class_weights must be None, a list of numbers (one per class) or a dict "
                      f"{{class: weight}}, got {value!r}")


def _class_seen(value) -> frozenset[int] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return frozenset([value])
    try:
        return frozenset(int(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"class_seen must be None, a class id or a list of class ids, "
                          f"got {value!r}") from None


@LOSSES.register_module()
class LovaszLoss(nn.Module):
    """Lovász-softmax (multiclass) or Lovász hinge (binary, multilabel).

    Args:
        mode: ``"multiclass"`` (softmax over the logits), ``"binary"`` or
            ``"multilabel"`` (hinge on raw logits, 0/1 targets).
        classes: multiclass: ``"present"`` averages over the classes present in
            the (kept) target, as upstream always does; ``"all"`` over every class.
        class_seen: multiclass: only these class ids take part.
        class_weights: multiclass: a list (one per class) or dict ``{class:
            weight}`` (missing: 1). Each class's loss is multiplied by its weight
            and the mean stays over the number of classes taken (upstream: no
            renormalisation by the weights). ``None``: unweighted.
        penalize_pred: multiclass with ``class_weights``: weigh each point's
            error by the weight of its *predicted* class instead of weighting
            whole classes.
        per_image: one loss per event of the batch (cut by ``offset``), then the
            mean over events that have kept points; ``False``: the whole batch as
            one set of points.
        ignore_index: target value that takes no part (``None``: none ignored).
        loss_weight: factor on the result.
    """

    domains = dict(mode=Choice("multiclass", "binary", "multilabel"), classes=Choice("present", "all"),
                   class_seen=Int(0, MAX_SIZE) | Seq(Int(0, MAX_SIZE)) | None,
                   class_weights=Seq(NonNeg, min_len=1) | DictOf(Int(0, MAX_SIZE), NonNeg) | None,
                   ignore_index=Int(-1, MAX_SIZE) | None, loss_weight=Weight)

    @classmethod
    def logit_columns(cls, args: dict) -> int | None:
        """The hinge of ``mode="binary"`` scores one logit per target (upstream
        has no meaning for it on multiclass logits: its flattening crashes)."""
        return 1 if args.get("mode") == "binary" else None

    def __init__(self, mode: str = "multiclass", classes: str = "present", class_seen=None, class_weights=None,
                 per_image: bool = False, ignore_index: int | None = -1, loss_weight: float = 1.0,
                 penalize_pred: bool = False):
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if classes not in ("present", "all"):
            raise ConfigError(f"classes must be 'present' or 'all', got {classes!r}")
        self.mode = mode
        self.classes = classes
        self.class_seen = _class_seen(class_seen)
        self.class_weights = _class_weights(class_weights)
        self.per_image = bool(per_image)
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight
        self.penalize_pred = bool(penalize_pred)

    def forward(self, logits: torch.Tensor, target: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "multiclass":
            if target.dim() == 2 and target.shape[-1] == 1:
                target = target.squeeze(-1)
            scores = logits.float().softmax(dim=1)
            one_set = self._softmax_flat
        else:
            if logits.numel() != target.numel():
                raise ValueError(f"LovaszLoss({self.mode}): logits {tuple(logits.shape)} and target "
                                 f"{tuple(target.shape)} must have one target per score")
            scores = logits.float().reshape(logits.shape[0], -1)
            target = target.reshape(logits.shape[0], -1)
            one_set = self._hinge_flat
        if not self.per_image:
            value = one_set(scores, target)
        else:
            values = [one_set(scores[rows], target[rows])
                      for rows in split_events(offset, logits.shape[0], "LovaszLoss")]
            values = [v for v in values if v is not None]
            value = torch.stack(values).mean() if values else None
        return zero_loss(logits) if value is None else value * self.loss_weight

    def _hinge_flat(self, scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        scores, target = drop_ignored(scores.reshape(-1), target.reshape(-1), self.ignore_index)
        if target.numel() == 0:
            return None
        labels = target.float()
        errors = 1.0 - scores * (2.0 * labels - 1.0)
        errors_sorted, perm = torch.sort(errors, descending=True)
        return torch.relu(errors_sorted) @ lovasz_grad(labels[perm])

    def _weight_vector(self, num_classes: int, device) -> torch.Tensor:
        weights = self.class_weights
        if isinstance(weights, list):
            if len(weights) < num_classes:
                raise ConfigError(f"LovaszLoss: class_weights has {len(weights)} entries but the model predicts "
                                  f"{num_classes} classes: give one weight per class (or a dict)")
            return torch.tensor(weights[:num_classes], device=device)
        vector = torch.ones(num_classes, device=device)
        for cls, w in weights.items():
            if 0 <= cls < num_classes:
                vector[cls] = w
        return vector

    def _softmax_flat(self, probs: torch.Tensor, target: torch.Tensor) -> torch.Tensor | None:
        probs, target = drop_ignored(probs, target, self.ignore_index)
        if target.numel() == 0:
            return None
        num_classes = probs.shape[1]
        taken = range(num_classes) if self.classes == "all" else target.unique().tolist()
        if self.class_seen is not None:
            taken = [c for c in taken if c in self.class_seen]
        weights = None if self.class_weights is None else self._weight_vector(num_classes, probs.device)
        point_weights = weights[probs.detach().argmax(dim=1)] if weights is not None and self.penalize_pred else None
        if not taken:
            return probs.sum() * 0.0
        # All classes as the rows of one (K, N) problem: one sort and one
        # cumsum call instead of K of each (K x N floats of memory per
        # intermediate, where the per-class loop held N).
        classes = torch.tensor(list(taken), device=probs.device)
        fg = (target.unsqueeze(0) == classes.unsqueeze(1)).float()
        errors = (fg - probs.t()[classes]).abs()
        # Non-negative float32s order as their bit patterns do, and the CPU
        # sorts int32 keys ~1.6x faster than floats (a radix sort).
        keys = errors.detach()
        keys = keys.view(torch.int32) if keys.dtype == torch.float32 else keys
        perm = torch.sort(keys, dim=1, descending=True).indices
        errors_sorted = errors.gather(1, perm)
        if point_weights is not None:
            errors_sorted = errors_sorted * point_weights[perm]
        losses = (errors_sorted * lovasz_grad(fg.gather(1, perm))).sum(1)
        if weights is not None and point_weights is None:
            losses = losses * weights[classes]
        return losses.mean()
