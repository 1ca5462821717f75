"""InsSegEvaluator: instance segmentation of point clouds (ARI and matched F1).

Two views of the same prediction, both computed per event (the batch is split
by ``offset``):

* **ARI** -- the adjusted Rand index between the true and predicted instance
  partitions of an event's points (points with true instance -1 are left out;
  predicted -1, "unassigned", counts as one more cluster). The reported
  ``ARI`` is the mean over events; an event with no labelled point has no
  ARI and is skipped.
* **Matching** -- predicted and true instances are matched one-to-one at IoU
  above ``iou_threshold``; tp/fp/fn totals give ``precision``, ``recall`` and
  ``F1``. With the model's semantic logits, each instance also gets a class
  (the majority label of its points: true labels for true instances, argmax of
  the logits for predicted ones), only same-class instances may match, and
  the counts are kept per class too.

All sums are int64/float64 tensors on the trainer's device, so they add over
batches and ranks exactly; the scores are derived once, in ``compute``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.common import check_model_classes
from pimm.evaluation.metrics import adjusted_rand_index, match_instances, match_instances_per_class
from pimm.evaluation.semseg import format_score, resolve_class_names
from pimm.evaluation.voting import FragmentVoting
from pimm.utils.errors import ConfigError
from pimm.utils.domains import MAX_SIZE, Count, Int, Key, Names, Prob

__all__ = ["InsSegEvaluator", "detection_scores"]


def detection_scores(tp: float, fp: float, fn: float) -> tuple[float, float, float]:
    """``(precision, recall, F1)`` from match counts; nan where a ratio is 0/0
    (e.g. precision of a class that was never predicted)."""
    def ratio(num: float, den: float) -> float:
        return num / den if den > 0 else math.nan
    return ratio(tp, tp + fp), ratio(tp, tp + fn), ratio(2 * tp, 2 * tp + fp + fn)


def event_ids(offset: torch.Tensor, num_points: int) -> tuple[torch.Tensor, list[int]]:
    """Event index of every point, and the end offsets as a Python list.

    ``offset`` must be non-decreasing and end at ``num_points``; anything else
    would silently assign points to the wrong event, so it is an error."""
    ends = offset.reshape(-1).tolist()
    if not ends or ends[-1] != num_points or any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"offset must be non-decreasing cumulative event ends with offset[-1] == N={num_points}, "
                         f"got {ends}")
    offset = offset.reshape(-1).to(torch.long)
    sizes = torch.diff(offset, prepend=offset.new_zeros(1))
    # output_size avoids a device sync to learn the result length.
    events = torch.repeat_interleave(torch.arange(len(ends), device=offset.device), sizes, output_size=num_points)
    return events, ends


@HOOKS.register_module()
class InsSegEvaluator(FragmentVoting, EvaluatorBase):
    """Instance segmentation of point clouds.

    Reads ``output[pred_key]`` (N,) predicted instance ids (-1 = unassigned),
    ``input[instance_key]`` (N,) true ids (-1 = ignore) and ``input["offset"]``.
    Ids only need to be unique within an event: they are keyed by event before
    matching, so equal ids in two events never form one instance. When
    ``output[logits_key]`` (N, K) is present, ``input[target_key]`` gives the
    true semantic labels (``ignore_index`` points do not vote on a class) and
    the per-class counts are filled.

    :meth:`compute` returns ``ARI``, ``precision``, ``recall``, ``F1`` (all
    classes together) and, when any batch had logits, ``F1_<name>``,
    ``precision_<name>``, ``recall_<name>`` per class (nan where undefined) and
    their mean ``mF1``; plus ``counts`` / ``class_counts`` (tp, fp, fn; not
    logged as scalars). The best checkpoint follows ``ARI``.

    On a ``test_mode`` data set (test fragments) the fragments' instances and
    class probabilities are voted and scored on every original point
    (:mod:`pimm.evaluation.voting`).
    """

    metric_name = "ARI"

    domains = dict(num_classes=Int(1, MAX_SIZE), ignore_index=Int(-1, MAX_SIZE), class_names=Names | None,
                   iou_threshold=Prob, pred_key=Key, logits_key=Key | None, target_key=Key, instance_key=Key,
                   every_n_steps=Count | None)

    def __init__(self, num_classes: int, ignore_index: int = -1, class_names: Sequence[str] | None = None,
                 iou_threshold: float = 0.5, pred_key: str = "instance_pred", logits_key: str | None = "seg_logits",
                 target_key: str = "segment", instance_key: str = "instance", every_n_steps: int | None = None):
        super().__init__(every_n_steps=every_n_steps)
        name = type(self).__name__
        self.class_names = resolve_class_names(name, num_classes, class_names)
        if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, (int, float)) \
                or not 0.0 <= iou_threshold < 1.0:
            raise ConfigError(f"{name}: iou_threshold must be a number in [0, 1), got {iou_threshold!r}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index
        self.iou_threshold = float(iou_threshold)
        self.pred_key, self.logits_key = pred_key, logits_key
        self.target_key, self.instance_key = target_key, instance_key
        self._ari_sum = self._ari_events = self._counts = self._class_counts = self._classed_events = None

    logits_required = False  # the semantic logits are optional here

    def modify_config(self, cfg) -> None:
        super().modify_config(cfg)
        if self.logits_key is not None:  # the per-class counts read the model's logits
            check_model_classes(type(self).__name__, self.num_classes, f"its num_classes={self.num_classes}",
                                cfg.get("model"))

    def vote_keys(self) -> tuple[str | None, str | None]:
        return self.logits_key, self.pred_key

    def reset(self) -> None:
        device = self.trainer.device
        self._ari_sum = torch.zeros((), dtype=torch.float64, device=device)
        self._ari_events = torch.zeros((), dtype=torch.int64, device=device)
        self._counts = torch.zeros(3, dtype=torch.int64, device=device)  # tp, fp, fn
        self._class_counts = torch.zeros(3, self.num_classes, dtype=torch.int64, device=device)
        self._classed_events = torch.zeros((), dtype=torch.int64, device=device)

    def process(self, input_dict: dict, output_dict: dict) -> None:
        if self.pred_key not in output_dict:
            raise KeyError(f"InsSegEvaluator: the model output has no {self.pred_key!r} "
                           f"(keys: {sorted(output_dict)}); set pred_key")
        for key in (self.instance_key, "offset"):
            if key not in input_dict:
                raise KeyError(f"InsSegEvaluator: the batch has no {key!r} (keys: {sorted(input_dict)})")
        gt = input_dict[self.instance_key].reshape(-1).long()
        pred = output_dict[self.pred_key].reshape(-1).long().to(gt.device)
        if gt.shape != pred.shape:
            raise ValueError(f"InsSegEvaluator: {self.pred_key!r} has {pred.numel()} points but "
                             f"{self.instance_key!r} has {gt.numel()}")
        events, ends = event_ids(input_dict["offset"].to(gt.device), gt.numel())
        # Key every id by its event (id * B + event is one-to-one for ids >= 0),
        # so one matching call serves the whole batch without merging events.
        num_events = len(ends)
        gt_key = torch.where(gt >= 0, gt * num_events + events, -1)
        pred_key = torch.where(pred >= 0, pred * num_events + events, -1)

        device = self._counts.device
        self._counts += torch.tensor(match_instances(gt_key, pred_key, self.iou_threshold), device=device)

        if self.logits_key is not None and self.logits_key in output_dict:
            logits = output_dict[self.logits_key]
            if logits.dim() != 2 or logits.shape[1] != self.num_classes:
                raise ValueError(f"InsSegEvaluator: {self.logits_key!r} must be (N, {self.num_classes}), "
                                 f"got {tuple(logits.shape)}")
            if self.target_key not in input_dict:
                raise KeyError(f"InsSegEvaluator: the batch has no {self.target_key!r} for per-class matching "
                               f"(keys: {sorted(input_dict)}); set target_key, or logits_key=None")
            tp, fp, fn = match_instances_per_class(
                gt_key, pred_key, input_dict[self.target_key].reshape(-1).to(gt.device),
                logits.argmax(dim=1).to(gt.device), self.num_classes, self.iou_threshold, self.ignore_index)
            self._class_counts += torch.stack([tp, fp, fn]).to(device)
            self._classed_events += num_events

        # ARI does not decompose over events, so it needs one call per event.
        start = 0
        for end in ends:
            ari = adjusted_rand_index(gt_key[start:end], pred_key[start:end])
            start = end
            if not math.isnan(ari):
                self._ari_sum += ari
                self._ari_events += 1

    def accumulators(self) -> dict[str, torch.Tensor]:
        return {"ari_sum": self._ari_sum, "ari_events": self._ari_events, "counts": self._counts,
                "class_counts": self._class_counts, "classed_events": self._classed_events}

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        ari_events = int(totals["ari_events"])
        metrics: dict = {"ARI": float(totals["ari_sum"]) / ari_events if ari_events else math.nan}
        counts = totals["counts"].detach().cpu().tolist()
        metrics["precision"], metrics["recall"], metrics["F1"] = detection_scores(*counts)
        metrics["counts"] = dict(zip(("tp", "fp", "fn"), counts))
        if int(totals["classed_events"]) > 0:
            class_counts = totals["class_counts"].detach().cpu().t().tolist()  # (K, 3)
            f1s = []
            for name, (tp, fp, fn) in zip(self.class_names, class_counts):
                precision, recall, f1 = detection_scores(tp, fp, fn)
                metrics[f"precision_{name}"], metrics[f"recall_{name}"], metrics[f"F1_{name}"] = precision, recall, f1
                f1s.append(f1)
            defined = [f for f in f1s if not math.isnan(f)]
            metrics["mF1"] = sum(defined) / len(defined) if defined else math.nan
            metrics["class_counts"] = {name: dict(zip(("tp", "fp", "fn"), c))
                                       for name, c in zip(self.class_names, class_counts)}
        return metrics

    def report(self, metrics: dict) -> str:
        width = max(len("class"), max(len(n) for n in self.class_names)) + 2
        header = "class".ljust(width) + "  prec  recall      F1        tp       fp       fn"

        def row(label: str, precision: float, recall: float, f1: float, c: dict) -> str:
            return (label.ljust(width) + f"{format_score(precision)}  {format_score(recall)}  {format_score(f1)}  "
                    f"{c['tp']:8d} {c['fp']:8d} {c['fn']:8d}")

        lines = [f"ARI {format_score(metrics['ARI'])}  (IoU threshold {self.iou_threshold:g})", header]
        if "class_counts" in metrics:
            for name in self.class_names:
                lines.append(row(name, metrics[f"precision_{name}"], metrics[f"recall_{name}"],
                                 metrics[f"F1_{name}"], metrics["class_counts"][name]))
        else:
            lines.append("(no semantic logits: class-agnostic matching only)")
        lines.append(row("all", metrics["precision"], metrics["recall"], metrics["F1"], metrics["counts"]))
        return "\n".join(lines)
