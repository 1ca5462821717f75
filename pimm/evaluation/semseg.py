"""SemSegEvaluator: per-point semantic segmentation scores (IoU, accuracy).

Every batch adds its ``(K, K)`` confusion matrix (rows = target class,
columns = predicted class) to one int64 accumulator on the trainer's device.
Counts add exactly, so summing them over batches and then over ranks gives
the same matrix as evaluating the whole split at once; the scores are only
derived from the summed matrix in :meth:`SemSegEvaluator.compute`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.metrics import confusion_matrix, segmentation_scores
from pimm.utils.errors import ConfigError

__all__ = ["SemSegEvaluator", "resolve_class_names"]


def resolve_class_names(evaluator: str, num_classes, class_names: Sequence[str] | None) -> list[str]:
    """Validate ``num_classes`` / ``class_names`` from a config and return one
    name per class (``"0"``, ``"1"``, ... when no names are given)."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes <= 0:
        raise ConfigError(f"{evaluator}: num_classes must be a positive integer, got {num_classes!r}")
    if class_names is None:
        return [str(i) for i in range(num_classes)]
    if isinstance(class_names, str):
        raise ConfigError(f"{evaluator}: class_names must be a list of names, got the string {class_names!r}")
    names = [str(n) for n in class_names]
    if len(names) != num_classes:
        raise ConfigError(f"{evaluator}: class_names has {len(names)} names for num_classes={num_classes}; "
                          f"give one name per class")
    if len(set(names)) != len(names):
        # Names become metric keys (iou_<name>); duplicates would overwrite each other.
        raise ConfigError(f"{evaluator}: class_names must be unique, got {names}")
    return names


def format_score(value: float) -> str:
    """A score for a text table; undefined scores show as ``nan``."""
    return "   nan" if math.isnan(value) else f"{value:.4f}"


@HOOKS.register_module()
class SemSegEvaluator(EvaluatorBase):
    """Semantic segmentation of point clouds.

    Reads ``output[logits_key]`` (N, K) and ``input[target_key]`` (N,); points
    whose target is ``ignore_index`` are left out. :meth:`compute` returns

    * ``mIoU``, ``mAcc``, ``allAcc`` (floats; means skip undefined classes),
    * ``iou_<name>`` / ``acc_<name>`` per class: IoU is nan for a class absent
      from both target and prediction, accuracy (recall) nan for a class absent
      from the target,
    * ``points`` (per-class target point counts) and ``confusion`` (nested
      lists, rows = target), which are not logged as scalars.

    The best checkpoint follows ``mIoU``.
    """

    metric_name = "mIoU"

    def __init__(self, num_classes: int, ignore_index: int = -1, class_names: Sequence[str] | None = None,
                 logits_key: str = "seg_logits", target_key: str = "segment", every_n_steps: int | None = None):
        super().__init__(every_n_steps=every_n_steps)
        self.class_names = resolve_class_names(type(self).__name__, num_classes, class_names)
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.logits_key, self.target_key = logits_key, target_key
        self._conf: torch.Tensor | None = None

    def reset(self) -> None:
        self._conf = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.trainer.device)

    def process(self, input_dict: dict, output_dict: dict) -> None:
        if self.logits_key not in output_dict:
            raise KeyError(f"SemSegEvaluator: the model output has no {self.logits_key!r} "
                           f"(keys: {sorted(output_dict)}); set logits_key")
        if self.target_key not in input_dict:
            raise KeyError(f"SemSegEvaluator: the batch has no {self.target_key!r} "
                           f"(keys: {sorted(input_dict)}); set target_key")
        logits = output_dict[self.logits_key]
        if logits.dim() != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(f"SemSegEvaluator: {self.logits_key!r} must be (N, {self.num_classes}), "
                             f"got {tuple(logits.shape)}")
        pred = logits.argmax(dim=1)
        target = input_dict[self.target_key].reshape(-1)
        self._conf += confusion_matrix(pred, target, self.num_classes, self.ignore_index).to(self._conf.device)

    def accumulators(self) -> dict[str, torch.Tensor]:
        return {"confusion": self._conf}

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        conf = totals["confusion"]
        scores = segmentation_scores(conf)
        metrics = {"mIoU": scores["mIoU"], "mAcc": scores["mAcc"], "allAcc": scores["allAcc"]}
        for name, iou, acc in zip(self.class_names, scores["iou"], scores["acc"]):
            metrics[f"iou_{name}"] = iou
            metrics[f"acc_{name}"] = acc
        conf = conf.detach().cpu()
        metrics["points"] = conf.sum(dim=1).tolist()
        metrics["confusion"] = conf.tolist()
        return metrics

    def report(self, metrics: dict) -> str:
        width = max(len("class"), max(len(n) for n in self.class_names)) + 2
        lines = ["class".ljust(width) + "   IoU     acc   #points"]
        for name, points in zip(self.class_names, metrics["points"]):
            lines.append(name.ljust(width) + f"{format_score(metrics[f'iou_{name}'])}  "
                         f"{format_score(metrics[f'acc_{name}'])}  {points:8d}")
        lines.append("mean".ljust(width) + f"{format_score(metrics['mIoU'])}  {format_score(metrics['mAcc'])}  "
                     f"{sum(metrics['points']):8d}")
        lines.append(f"allAcc {format_score(metrics['allAcc'])}")
        return "\n".join(lines)
