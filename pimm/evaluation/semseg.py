"""SemSegEvaluator: per-point semantic segmentation scores (IoU, accuracy,
precision, F1).

Every batch adds its ``(K, K)`` confusion matrix (rows = target class,
columns = predicted class) to one int64 accumulator on the trainer's device.
Counts add exactly, so summing them over batches and then over ranks gives
the same matrix as evaluating the whole split at once; the scores are only
derived from the summed matrix in :meth:`SemSegEvaluator.compute`.

The number of classes, their names and the ignore label may be left out: they
then come from ``data.num_classes`` / ``data.names`` / ``data.ignore_index``
(upstream pimm's convention, see :mod:`pimm.evaluation.common`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.common import ClassesFromData, check_classes, resolve_class_names
from pimm.evaluation.metrics import confusion_matrix, segmentation_scores
from pimm.evaluation.voting import FragmentVoting
from pimm.utils.errors import ConfigError
from pimm.utils.domains import MAX_SIZE, Count, Int, Key, Names, Seq

__all__ = ["SemSegEvaluator", "resolve_class_names", "format_score"]

#: Output key upstream pimm's models may use instead of ``seg_logits``.
_ALT_LOGITS_KEY = "sem_logits"


def format_score(value: float) -> str:
    """A score for a text table; undefined scores show as ``nan``."""
    return "   nan" if math.isnan(value) else f"{value:.4f}"


def _mean(values: list[float], keep: list[bool]) -> float:
    """Mean of the defined (non-nan) values of the kept classes."""
    chosen = [v for v, k in zip(values, keep) if k and not math.isnan(v)]
    return sum(chosen) / len(chosen) if chosen else math.nan


def _precision_f1(conf: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-class precision (nan for a class never predicted) and F1 (nan for a
    class absent from both target and prediction)."""
    conf = conf.detach().to("cpu", torch.float64)
    hit, in_pred, in_target = conf.diagonal(), conf.sum(dim=0), conf.sum(dim=1)
    precision = [h / p if p > 0 else math.nan for h, p in zip(hit.tolist(), in_pred.tolist())]
    f1 = [2 * h / (p + t) if p + t > 0 else math.nan
          for h, p, t in zip(hit.tolist(), in_pred.tolist(), in_target.tolist())]
    return precision, f1


@HOOKS.register_module()
class SemSegEvaluator(FragmentVoting, ClassesFromData, EvaluatorBase):
    """Semantic segmentation of point clouds.

    Reads ``output[logits_key]`` (N, K) -- ``sem_logits`` is accepted when the
    default ``seg_logits`` is absent -- and ``input[target_key]`` ((N,) or
    (N, 1)); points whose target is ``ignore_index`` are left out.

    Args:
        num_classes, class_names, ignore_index: ``None`` takes them from
            ``data.num_classes``, ``data.names``, ``data.ignore_index`` (else -1).
        every_n_steps: evaluate every that many optimizer steps; ``None`` or
            ``0`` (upstream's spelling) after every epoch.
        write_cls_iou: log the per-class scores as scalars (``True``) or keep
            them only in the returned ``per_class`` table (``False``).
        macro_ignore_class_ids: classes left out of the means (``mIoU``,
            ``mAcc``, ``mPrecision``, ``mRecall``, ``mF1``); they still have
            per-class scores.
        per_instance_metrics: upstream's majority-vote instance metrics are
            not implemented; ``True`` is a ``ConfigError`` (use
            ``InsSegEvaluator``).

    :meth:`compute` returns ``mIoU``, ``mAcc``, ``allAcc``, ``mPrecision``,
    ``mRecall`` (= ``mAcc``), ``mF1`` and, per class, ``iou_<name>``,
    ``acc_<name>``, ``precision_<name>``, ``f1_<name>`` (nan where undefined:
    IoU and F1 for a class absent from target and prediction, accuracy for one
    absent from the target, precision for one never predicted; means skip
    nan), plus ``points`` (per-class target counts) and ``confusion``. The
    best checkpoint follows ``mIoU``; after each scheduled or final evaluation
    of the trained weights it is also published as upstream's evaluators do,
    in ``trainer.comm_info`` (``current_metric_value``, ``current_metric_name``
    ``"mIoU"``, ``current_metric_greater_is_better`` True), for hooks written
    against upstream.

    On a ``test_mode`` data set (test fragments) the fragments' class
    probabilities are voted and scored on every original point
    (:mod:`pimm.evaluation.voting`).
    """

    metric_name = "mIoU"

    domains = dict(num_classes=Int(1, MAX_SIZE) | None, ignore_index=Int(-1, MAX_SIZE) | None,
                   class_names=Names | None, logits_key=Key, target_key=Key, every_n_steps=Count | None,
                   macro_ignore_class_ids=Seq(Int(0, MAX_SIZE)) | None, log_images=Int(0, 64))

    def __init__(self, num_classes: int | None = None, ignore_index: int | None = None,
                 class_names: Sequence[str] | None = None, logits_key: str = "seg_logits",
                 target_key: str = "segment", every_n_steps: int | None = None, write_cls_iou: bool = True,
                 macro_ignore_class_ids: Sequence[int] | None = None, per_instance_metrics: bool = False,
                 log_images: int = 2):
        name = type(self).__name__
        if per_instance_metrics:
            raise ConfigError(f"{name}: per_instance_metrics=True (upstream's majority-vote instance metrics) "
                              "is not supported; evaluate instances with InsSegEvaluator")
        super().__init__(every_n_steps=None if every_n_steps == 0 else every_n_steps, log_images=log_images)
        self.num_classes, self.class_names = check_classes(name, num_classes, class_names)
        self.ignore_index = ignore_index
        self.logits_key, self.target_key = logits_key, target_key
        self.write_cls_iou = bool(write_cls_iou)
        ids = list(macro_ignore_class_ids or ())
        if any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
            raise ConfigError(f"{name}: macro_ignore_class_ids must be class indices, got {macro_ignore_class_ids!r}")
        self.macro_ignore_class_ids = tuple(sorted(set(ids)))
        self._conf: torch.Tensor | None = None
        if self.num_classes is not None:
            self._check_macro_ids()

    def resolve_classes(self, data) -> None:
        super().resolve_classes(data)
        self._check_macro_ids()

    def _check_macro_ids(self) -> None:
        bad = [i for i in self.macro_ignore_class_ids if not 0 <= i < self.num_classes]
        if bad:
            raise ConfigError(f"{type(self).__name__}: macro_ignore_class_ids {bad} are not classes "
                              f"0..{self.num_classes - 1}")

    def reset(self) -> None:
        self.require_classes()
        self._conf = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.trainer.device)

    def _logits(self, output_dict: dict) -> torch.Tensor:
        if self.logits_key in output_dict:
            return output_dict[self.logits_key]
        if self.logits_key == "seg_logits" and _ALT_LOGITS_KEY in output_dict:
            return output_dict[_ALT_LOGITS_KEY]
        raise KeyError(f"SemSegEvaluator: the model output has no {self.logits_key!r} "
                       f"(keys: {sorted(output_dict)}); set logits_key")

    def process(self, input_dict: dict, output_dict: dict) -> None:
        logits = self._logits(output_dict)
        if self.target_key not in input_dict:
            raise KeyError(f"SemSegEvaluator: the batch has no {self.target_key!r} "
                           f"(keys: {sorted(input_dict)}); set target_key")
        if logits.dim() != 2 or logits.shape[1] != self.num_classes:
            raise ValueError(f"SemSegEvaluator: {self.logits_key!r} must be (N, {self.num_classes}), "
                             f"got {tuple(logits.shape)}")
        pred = logits.argmax(dim=1)
        target = input_dict[self.target_key].reshape(-1)
        self._conf += confusion_matrix(pred, target, self.num_classes, self.ignore_index).to(self._conf.device)

    def accumulators(self) -> dict[str, torch.Tensor]:
        return {"confusion": self._conf}

    def display(self, input_dict: dict, output_dict: dict, limit: int) -> list:
        """True vs predicted classes of the batch's first events (projections)."""
        if "coord" not in input_dict or "offset" not in input_dict:
            return []
        from pimm.evaluation.displays import event_slice, render_point_event

        pred = self._logits(output_dict).argmax(dim=1)
        target = input_dict[self.target_key].reshape(-1)
        offset = input_dict["offset"]
        return [render_point_event(input_dict["coord"][event_slice(offset, i)], target[event_slice(offset, i)],
                                   pred[event_slice(offset, i)], self.class_names)
                for i in range(min(limit, len(offset)))]

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        conf = totals["confusion"]
        scores = segmentation_scores(conf)
        precision, f1 = _precision_f1(conf)
        keep = [i not in self.macro_ignore_class_ids for i in range(self.num_classes)]
        if not any(keep):  # every class left out: the means cover all of them
            keep = [True] * self.num_classes
        metrics = {
            "mIoU": _mean(scores["iou"], keep), "mAcc": _mean(scores["acc"], keep), "allAcc": scores["allAcc"],
            "mPrecision": _mean(precision, keep), "mRecall": _mean(scores["acc"], keep), "mF1": _mean(f1, keep),
        }
        per_class = {}
        for i, name in enumerate(self.class_names):
            per_class[f"iou_{name}"] = scores["iou"][i]
            per_class[f"acc_{name}"] = scores["acc"][i]
            per_class[f"precision_{name}"] = precision[i]
            per_class[f"f1_{name}"] = f1[i]
        if self.write_cls_iou:
            metrics.update(per_class)
        else:
            metrics["per_class"] = per_class  # a dict: reported, not logged as scalars
        conf = conf.detach().cpu()
        metrics["points"] = conf.sum(dim=1).tolist()
        metrics["confusion"] = conf.tolist()
        return metrics

    def after_val(self, metrics: dict, run) -> None:
        if self not in run.evaluators or run.kind == "on_demand" or not run.of_trained_weights:
            return
        value = metrics.get(f"{run.prefix}/{self.metric_name}")
        if isinstance(value, float) and math.isfinite(value):
            info = self.trainer.comm_info
            info["current_metric_value"], info["current_metric_name"] = value, self.metric_name
            info["current_metric_greater_is_better"] = self.greater_is_better

    def report(self, metrics: dict) -> str:
        per_class = metrics.get("per_class", metrics)
        width = max(len("class"), max(len(n) for n in self.class_names)) + 2
        lines = ["class".ljust(width) + "   IoU     acc   #points"]
        for i, (name, points) in enumerate(zip(self.class_names, metrics["points"])):
            mark = "  *" if i in self.macro_ignore_class_ids else ""
            lines.append(name.ljust(width) + f"{format_score(per_class[f'iou_{name}'])}  "
                         f"{format_score(per_class[f'acc_{name}'])}  {points:8d}{mark}")
        lines.append("mean".ljust(width) + f"{format_score(metrics['mIoU'])}  {format_score(metrics['mAcc'])}  "
                     f"{sum(metrics['points']):8d}")
        lines.append(f"allAcc {format_score(metrics['allAcc'])}  mPrecision {format_score(metrics['mPrecision'])}  "
                     f"mF1 {format_score(metrics['mF1'])}")
        if self.macro_ignore_class_ids:
            lines.append("* left out of the means (macro_ignore_class_ids)")
        return "\n".join(lines)
