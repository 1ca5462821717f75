"""ClusterPolicyEvaluator: a clustering policy against the supervised clustering, on the same events.

Why: the question GRPO fine-tuning of clustering radii
(:class:`~pimm.models.grpo.cluster_policy.ClusterRadiusPolicy`) must answer
is "does the policy beat the supervised model?". Scoring the two in separate
runs invites comparing different events or different network outputs; here
one evaluation pass scores both clusterings of every event, made from the
same frozen network output: ``instance_pred`` (the greedy policy) and
``instance_pred_supervised`` (the configured radii).

Per event it computes the adjusted Rand index of each (the definition of
``InsSegEvaluator``: points with true instance -1 left out) and counts the
events the policy made better or worse; over all events it also counts the
one-to-one IoU matches of both (``F1``, as ``InsSegEvaluator``'s
class-agnostic F1). With ``class_names`` it logs the mean scale the policy
chose for each radius and class (``agree_scale_<name>``, ``merge_scale_<name>``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.common import resolve_class_names
from pimm.evaluation.inseg import detection_scores, event_ids
from pimm.evaluation.metrics import adjusted_rand_index, match_instances
from pimm.utils.errors import ConfigError
from pimm.utils.domains import MAX_SIZE, Count, Int, Key, Names, Prob

__all__ = ["ClusterPolicyEvaluator"]

_SCALE_KEYS = ("agree_scale", "merge_scale")


@HOOKS.register_module()
class ClusterPolicyEvaluator(EvaluatorBase):
    """Greedy clustering policy vs the supervised clustering (see the module docstring).

    Logged: ``ARI`` (the policy; selects the best model), ``ARI_supervised``,
    ``ARI_gain`` (their difference), ``improved_frac`` / ``worse_frac``
    (events whose ARI the policy raised / lowered by more than 1e-6), ``F1``
    and ``F1_supervised`` (one-to-one matches at IoU above ``iou_threshold``),
    and with ``class_names`` the mean chosen scales per class.
    """

    metric_name = "ARI"

    domains = dict(num_classes=Int(1, MAX_SIZE) | None, class_names=Names | None, iou_threshold=Prob,
                   every_n_steps=Count | None, prefix=Key)

    def __init__(self, num_classes: int | None = None, class_names: Sequence[str] | None = None,
                 iou_threshold: float = 0.5, every_n_steps: int | None = None, prefix: str = "val"):
        super().__init__(every_n_steps=every_n_steps, prefix=prefix)
        name = type(self).__name__
        if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, (int, float)) \
                or not 0.0 <= iou_threshold < 1.0:
            raise ConfigError(f"{name}: iou_threshold must be a number in [0, 1), got {iou_threshold!r}")
        self.iou_threshold = float(iou_threshold)
        if class_names is not None or num_classes is not None:
            self.class_names = resolve_class_names(name, num_classes if num_classes is not None else len(class_names),
                                                   class_names)
        else:
            self.class_names = None
        self._sums: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._sums = {}

    def _add(self, name: str, value) -> None:
        value = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
        self._sums[name] = self._sums[name] + value if name in self._sums else value.clone()

    def process(self, input_dict: dict, output_dict: dict) -> None:
        missing = [k for k in ("instance_pred", "instance_pred_supervised") if k not in output_dict]
        missing += [k for k in ("instance", "offset") if k not in input_dict]
        if missing:
            raise ConfigError(f"ClusterPolicyEvaluator needs {', '.join(missing)} in the model output / batch; use "
                              "it with a clustering policy (ClusterRadiusPolicy) on instance-labelled events")
        truth = input_dict["instance"].reshape(-1).long()
        events, ends = event_ids(input_dict["offset"].to(truth.device), truth.numel())
        num_events = len(ends)
        truth_key = torch.where(truth >= 0, truth * num_events + events, -1)
        keyed = {}
        for tag, key in (("", "instance_pred"), ("_supervised", "instance_pred_supervised")):
            pred = output_dict[key].reshape(-1).long().to(truth.device)
            keyed[tag] = torch.where(pred >= 0, pred * num_events + events, -1)
            self._add(f"counts{tag}", match_instances(truth_key, keyed[tag], self.iou_threshold))
        start = 0
        for end in ends:
            policy = adjusted_rand_index(truth_key[start:end], keyed[""][start:end])
            supervised = adjusted_rand_index(truth_key[start:end], keyed["_supervised"][start:end])
            start = end
            if math.isnan(policy) or math.isnan(supervised):
                continue
            self._add("ari_sum", policy)
            self._add("ari_supervised_sum", supervised)
            self._add("improved", float(policy > supervised + 1e-6))
            self._add("worse", float(policy < supervised - 1e-6))
            self._add("events", 1.0)
        if self.class_names is not None:
            for key in _SCALE_KEYS:
                if key in output_dict:
                    self._add(f"{key}_sum", output_dict[key].double().sum(0)[: len(self.class_names)])
            self._add("scale_events", float(num_events))

    def accumulators(self) -> dict[str, torch.Tensor]:
        device = self.trainer.device
        shapes = {"counts": 3, "counts_supervised": 3}
        if self.class_names is not None:
            shapes.update({f"{key}_sum": len(self.class_names) for key in _SCALE_KEYS})
        names = ("ari_sum", "ari_supervised_sum", "improved", "worse", "events", "scale_events")
        out = {name: self._sums.get(name, torch.zeros((), dtype=torch.float64)) for name in names}
        out.update({name: self._sums.get(name, torch.zeros(size, dtype=torch.float64))
                    for name, size in shapes.items()})
        return {name: value.to(device).clone() for name, value in out.items()}

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        events = float(totals["events"])
        nan = math.nan
        ari = float(totals["ari_sum"]) / events if events else nan
        supervised = float(totals["ari_supervised_sum"]) / events if events else nan
        metrics = {"ARI": ari, "ARI_supervised": supervised, "ARI_gain": ari - supervised,
                   "improved_frac": float(totals["improved"]) / events if events else nan,
                   "worse_frac": float(totals["worse"]) / events if events else nan, "events": int(events)}
        metrics["F1"] = detection_scores(*totals["counts"].tolist())[2]
        metrics["F1_supervised"] = detection_scores(*totals["counts_supervised"].tolist())[2]
        scale_events = float(totals["scale_events"])
        if self.class_names is not None and scale_events:
            for key in _SCALE_KEYS:
                for name, value in zip(self.class_names, totals[f"{key}_sum"].tolist()):
                    metrics[f"{key}_{name}"] = value / scale_events
        return metrics

    def report(self, metrics: dict) -> str:
        lines = [f"{'':12}{'ARI':>8}{'F1':>8}",
                 f"{'policy':12}{metrics['ARI']:8.4f}{metrics['F1']:8.4f}",
                 f"{'supervised':12}{metrics['ARI_supervised']:8.4f}{metrics['F1_supervised']:8.4f}",
                 f"ARI gain {metrics['ARI_gain']:+.4f} over {metrics['events']} events: "
                 f"{metrics['improved_frac']:.1%} better, {metrics['worse_frac']:.1%} worse"]
        if self.class_names is not None and f"merge_scale_{self.class_names[0]}" in metrics:
            lines.append("mean scale  " + "  ".join(
                f"{name}: agree {metrics[f'agree_scale_{name}']:.2f} merge {metrics[f'merge_scale_{name}']:.2f}"
                for name in self.class_names))
        return "\n".join(lines)
