"""``InstanceSegmentationEvaluator``: upstream pimm's evaluator of its panoptic
detector (``detector-v5``), with upstream's arguments and metric names.

Each validation batch goes through the model in evaluation mode, then through
the model's ``postprocess`` once per label (with this hook's
``stuff_threshold`` and ``mask_threshold``), and every event's predicted
instances are scored against the label's true ones
(:mod:`pimm.evaluation.instance_metrics`). Logged per label, as
``val/<label>/<name>``: ``ins_det_{precision,recall,f1,mean_iou,fp,fn,
fp_per_gt,fn_per_gt}``, ``ins_cls_macro_{precision,recall,f1}`` and per class
``ins_cls_f1_<class>``, ``ins_pq`` / ``ins_sq`` / ``ins_rq``, ``ins_ari`` (mean
over events of the adjusted Rand index on the points given an instance), and
for each query head of the label whose target is in the batch, on the matched
instances (true value: the mean over the true instance's points, skipping the
head's sentinel; predicted: the painting query's value): ``<head>_mae`` and
``<head>_rmse`` (one value, e.g. log10 momentum), ``<head>_dist`` (a vector,
e.g. the vertex), ``<head>_angle_deg`` (a unit-normalised head, e.g. the
momentum direction) or ``<head>_acc`` (a categorical head, e.g. is_primary).
``<primary_label>/ins_det_f1`` selects the best model (``select_metric=
"val_head_loss"``: the summed query-head losses, lower is better).

Unlike upstream, batches of several events are fine (events are split by
``offset``) and every sum is reduced over ranks, so multi-GPU evaluation
scores all events exactly once.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.utils.config_domains import ask_class
from pimm.utils.domains import Choice, Count, Domain, Key, Names, Prob, Seq, Text
from pimm.utils.errors import ConfigError

from .instance_metrics import adjusted_rand_score, event_counts, scores

__all__ = ["InstanceSegmentationEvaluator"]

class _PerLabel(Domain):
    """One value of ``inner``, a dict of label -> such a value (``"default"``:
    the other labels) or None; a bad entry is named by its label."""

    def __init__(self, inner: Domain):
        self.inner = inner
        self.what = f"{inner.what}, a dict of label -> {inner.what}, or None"

    def accepts(self, value) -> bool:
        return value is None or self.inner.accepts(value) or (
            isinstance(value, dict) and all(Key.accepts(k) and self.inner.accepts(v) for k, v in value.items()))

    def __call__(self, key: str, value):
        if isinstance(value, dict):
            for label, entry in value.items():
                Key(f"{key} (a label)", label)
                self.inner(f"{key}.{label}", entry)
            return value
        return super().__call__(key, value)


def _per_label(value, label, default=None):
    if isinstance(value, dict):
        return value.get(label, value.get("default", default))
    return default if value is None else value


def _flat(t) -> np.ndarray:
    t = t.detach().cpu()
    return (t.squeeze(1) if t.dim() == 2 and t.shape[1] == 1 else t).numpy()


@HOOKS.register_module()
class InstanceSegmentationEvaluator(EvaluatorBase):
    """Panoptic instance metrics of a ``detector-v5``-style model (module doc)."""

    domains = dict(every_n_steps=Count | None, stuff_threshold=Prob, mask_threshold=Prob,
                   class_names=_PerLabel(Names), stuff_classes=_PerLabel(Seq(Count, what="a list of class ids")),
                   iou_thresh=Prob, labels=Key | Seq(Key, min_len=1) | None, prefix=Text("a metric prefix") | None,
                   primary_label=Key | None, instance_key=_PerLabel(Key), segment_key=_PerLabel(Key),
                   segment_fallback_key=_PerLabel(Key), select_metric=Choice("det_f1", "val_head_loss"))

    def __init__(self, every_n_steps: int | None = 0, stuff_threshold: float = 0.5, mask_threshold: float = 0.5,
                 class_names=None, stuff_classes=None, iou_thresh: float = 0.5, require_class_for_match: bool = False,
                 labels: str | Sequence[str] | None = None, prefix: str | None = None,
                 primary_label: str | None = None, set_current_metric: bool = True, instance_key=None,
                 segment_key=None, segment_fallback_key=None, log_ari: bool = True, select_metric: str = "det_f1",
                 log_val_loss: bool = False):
        super().__init__(every_n_steps=every_n_steps or None, prefix="val" if prefix is None else prefix.strip("/"))
        self.stuff_threshold, self.mask_threshold = float(stuff_threshold), float(mask_threshold)
        self.iou_thresh, self.require_class = float(iou_thresh), bool(require_class_for_match)
        self.class_names_cfg, self.stuff_classes = class_names, stuff_classes  # stuff_classes: upstream's, unused
        self.labels = (labels,) if isinstance(labels, str) else (None if labels is None else tuple(labels))
        # With an explicit prefix upstream drops the label from the key.
        self.label_in_key = prefix is None
        self.primary_label = primary_label
        self.instance_key, self.segment_key, self.fallback_key = instance_key, segment_key, segment_fallback_key
        self.log_ari, self.select_metric = bool(log_ari), select_metric
        self.head_loss = bool(log_val_loss) or select_metric == "val_head_loss"
        primary = primary_label or (self.labels[0] if self.labels else None)
        if select_metric == "val_head_loss":
            self.metric_name, self.greater_is_better = "head_loss_total", False
        elif primary is not None:
            self.metric_name = self._key(primary, "ins_det_f1")
        if not set_current_metric:
            self.metric_name = None
        self._model = None
        self._sums: dict[str, torch.Tensor] = {}

    def _key(self, label: str, name: str) -> str:
        return f"{label}/{name}" if self.label_in_key else name

    def modify_config(self, cfg) -> None:
        """The labels and class names against the model's labels, before anything is built."""
        super().modify_config(cfg)
        classes = ask_class(cfg.get("model"), "model", "label_classes")
        if not classes:  # not a detector that declares its labels: _specs() says so when it runs
            return
        owner = type(self).__name__
        for key, asked in (("labels", self.labels or ()), ("primary_label", (self.primary_label,))):
            missing = [label for label in asked if label is not None and label not in classes]
            if missing:
                value = list(asked) if key == "labels" else asked[0]
                raise ConfigError(f"{owner}: {key}={value!r} is invalid: {missing} are not labels of the model "
                                  f"(model.label_configs has {', '.join(classes)})")
        # Names given per label are checked; one plain list is upstream's tester form, naming the classes of
        # the model's eval label whatever other labels it has.
        per_label = self.class_names_cfg if isinstance(self.class_names_cfg, dict) else {}
        for label in self.labels or tuple(classes):
            names = _per_label(per_label, label)
            if names and isinstance(classes[label], int) and len(names) > classes[label]:
                raise ConfigError(f"{owner}: class_names for {label!r} has {len(names)} names but the model's label "
                                  f"{label!r} has num_classes={classes[label]}: give at most one name per class "
                                  "(classes past the last name, e.g. a stuff class, are not scored)")

    # -- what to score ------------------------------------------------------------
    def _specs(self) -> dict:
        model = self._model if self._model is not None else self.trainer.model
        model = getattr(model, "module", model)
        specs = getattr(model, "label_specs", None)
        if not specs or not hasattr(model, "postprocess"):
            raise ConfigError(f"InstanceSegmentationEvaluator: the model {type(model).__name__} is not a panoptic "
                              "detector (it needs label_specs and postprocess, as detector-v5 has)")
        labels = self.labels or tuple(specs)
        missing = [label for label in labels if label not in specs]
        if missing:
            raise ConfigError(f"InstanceSegmentationEvaluator: labels {missing} are not labels of the model "
                              f"({', '.join(specs)})")
        if self.metric_name is not None and self.select_metric == "det_f1" and self.labels is None:
            self.metric_name = self._key(self.primary_label or labels[0], "ins_det_f1")
        return {label: specs[label] for label in labels}

    def _class_names(self, label: str, spec) -> tuple:
        names = _per_label(self.class_names_cfg, label)
        if names:
            return tuple(str(n) for n in names)
        data = self.trainer.cfg.get("data", {}) if hasattr(self.trainer, "cfg") else {}
        for key in (f"{label}_names", "names" if label == "particle" else None):
            if key and key in data:
                return tuple(str(n) for n in data[key])
        return tuple(str(i) for i in range(spec.num_classes))

    def declare_metrics(self, channel) -> None:
        if self.metric_name is not None and self.labels is None:
            try:
                self._specs()
            except (ConfigError, ReferenceError, AttributeError):
                pass
        super().declare_metrics(channel)

    # -- accumulation ----------------------------------------------------------------
    def reset(self) -> None:
        device = self.trainer.device
        self._sums = {}
        for label, spec in self._specs().items():
            k = len(self._class_names(label, spec))
            self._sums[f"{label}.counts"] = torch.zeros(6, dtype=torch.float64, device=device)
            self._sums[f"{label}.confusion"] = torch.zeros(k, k, dtype=torch.int64, device=device)
            self._sums[f"{label}.ari"] = torch.zeros(2, dtype=torch.float64, device=device)
            for head in spec.query_heads:  # n, abs error / distance, squared error, angle / correct
                self._sums[f"{label}.head.{head.name}"] = torch.zeros(4, dtype=torch.float64, device=device)
                self._sums[f"{label}.loss.{head.name}"] = torch.zeros(2, dtype=torch.float64, device=device)

    def accumulators(self) -> dict[str, torch.Tensor]:
        return self._sums

    def forward_batch(self, batch, model: torch.nn.Module) -> tuple:
        self._model = model
        batch, output = super().forward_batch(batch, model)
        detector = getattr(model, "module", model)
        for label in self._specs():
            output[f"__panoptic__{label}"] = detector.postprocess(output, label=label,
                                                                  stuff_threshold=self.stuff_threshold,
                                                                  mask_threshold=self.mask_threshold)
        return batch, output

    def process(self, input_dict: dict, output_dict: dict) -> None:
        counts = torch.diff(input_dict["offset"].long(), prepend=input_dict["offset"].new_zeros(1)).tolist()
        for label, spec in self._specs().items():
            keys = [_per_label(self.instance_key, label) or spec.instance_key,
                    _per_label(self.segment_key, label) or spec.segment_key]
            if keys[1] not in input_dict and _per_label(self.fallback_key, label) in input_dict:
                keys[1] = _per_label(self.fallback_key, label)
            for key in keys:
                if key not in input_dict:
                    raise KeyError(f"InstanceSegmentationEvaluator: label {label!r} is scored against the batch key "
                                   f"{key!r}, which the validation data does not give (add it to Collect)")
            names = self._class_names(label, spec)
            result = output_dict[f"__panoptic__{label}"]
            gt_inst, gt_cls = _flat(input_dict[keys[0]]), _flat(input_dict[keys[1]])
            pr_inst, pr_cls = _flat(result["instance_labels"]), _flat(result["class_labels"])
            start = 0
            for n in counts:
                part = slice(start, start + n)
                start += n
                c, confusion, matches = event_counts(gt_inst[part], pr_inst[part], gt_cls[part], pr_cls[part],
                                                     len(names), self.iou_thresh, self.require_class)
                self._sums[f"{label}.counts"] += torch.as_tensor(c, device=self._sums[f"{label}.counts"].device)
                self._sums[f"{label}.confusion"] += torch.as_tensor(confusion,
                                                                    device=self._sums[f"{label}.confusion"].device)
                assigned = pr_inst[part] != -1
                if self.log_ari and assigned.any():
                    ari = adjusted_rand_score(gt_inst[part][assigned], pr_inst[part][assigned])
                    if not math.isnan(ari):
                        self._sums[f"{label}.ari"] += torch.tensor([ari, 1.0], dtype=torch.float64,
                                                                   device=self._sums[f"{label}.ari"].device)
                for head in spec.query_heads:
                    target_key = head.target_key or head.name
                    if target_key in input_dict and f"pred_{head.name}" in result:
                        self._score_head(label, head, matches, gt_inst[part], pr_inst[part],
                                         input_dict[target_key][part], result[f"pred_{head.name}"][part])
            if self.head_loss:
                for head in spec.query_heads:
                    value = output_dict.get(f"{label}_{head.name}")
                    if isinstance(value, torch.Tensor) and bool(torch.isfinite(value)):
                        self._sums[f"{label}.loss.{head.name}"] += torch.stack(
                            [value.detach().double(), value.new_tensor(1.0, dtype=torch.float64)])

    def _score_head(self, label, head, matches, gt_inst, pr_inst, target, predicted) -> None:
        target = target.detach().cpu().double().reshape(len(gt_inst), -1)
        predicted = predicted.detach().cpu().double().reshape(len(pr_inst), -1)
        gt_t, pr_t = torch.as_tensor(gt_inst), torch.as_tensor(pr_inst)
        sums = torch.zeros(4, dtype=torch.float64)
        for p, g, _ in matches:
            truth = target[gt_t == g]
            if head.sentinel is not None and bool((truth == head.sentinel).all(dim=1).all()):
                continue
            guess = predicted[pr_t == p][0]
            if head.kind == "categorical":
                truth_class = int(torch.mode(truth[:, 0].long()).values)
                sums += torch.tensor([1.0, 0.0, 0.0, float(int(guess.argmax()) == truth_class)], dtype=torch.float64)
                continue
            truth = truth.mean(dim=0)
            error = guess - truth
            angle = 0.0
            if head.unit_normalize:
                cosine = torch.dot(guess, truth) / (guess.norm() * truth.norm()).clamp_min(1e-12)
                angle = math.degrees(math.acos(float(cosine.clamp(-1.0, 1.0))))
            sums += torch.tensor([1.0, float(error.norm()), float((error ** 2).sum()), angle], dtype=torch.float64)
        acc = self._sums[f"{label}.head.{head.name}"]
        acc += sums.to(acc.device)

    # -- results ------------------------------------------------------------------
    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        metrics: dict = {}
        head_loss_total, any_head_loss = 0.0, False
        for label, spec in self._specs().items():
            names = self._class_names(label, spec)
            result = scores(totals[f"{label}.counts"].cpu().numpy(), totals[f"{label}.confusion"].cpu().numpy(),
                            names)
            ari_sum, ari_n = totals[f"{label}.ari"].tolist()
            if self.log_ari:
                result["ins_ari"] = ari_sum / ari_n if ari_n else math.nan
            for head in spec.query_heads:
                n, dist, sq, extra = totals[f"{label}.head.{head.name}"].tolist()
                if n == 0:
                    continue
                if head.kind == "categorical":
                    result[f"{head.name}_acc"] = extra / n
                elif head.kind == "continuous" and head.dim == 1:
                    result[f"{head.name}_mae"], result[f"{head.name}_rmse"] = dist / n, math.sqrt(sq / n)
                else:
                    result[f"{head.name}_dist"] = dist / n
                    if head.unit_normalize:
                        result[f"{head.name}_angle_deg"] = extra / n
                loss_sum, loss_n = totals[f"{label}.loss.{head.name}"].tolist()
                if self.head_loss and loss_n:
                    result[f"head_loss_{head.name}"] = loss_sum / loss_n
                    head_loss_total, any_head_loss = head_loss_total + loss_sum / loss_n, True
            metrics.update({self._key(label, k): v for k, v in result.items()})
        if any_head_loss:
            metrics["head_loss_total"] = head_loss_total
        return metrics

    def report(self, metrics: dict) -> str:
        lines = []
        for label in self._specs():
            def get(name):
                return metrics.get(self._key(label, name), math.nan)
            lines.append(f"[{label}] Detection P={get('ins_det_precision'):.3f} R={get('ins_det_recall'):.3f} "
                         f"F1={get('ins_det_f1'):.3f} IoU={get('ins_det_mean_iou'):.3f}  FP={get('ins_det_fp'):.0f} "
                         f"FN={get('ins_det_fn'):.0f}")
            lines.append(f"[{label}] Classification macro P={get('ins_cls_macro_precision'):.3f} "
                         f"R={get('ins_cls_macro_recall'):.3f} F1={get('ins_cls_macro_f1'):.3f}  "
                         f"PQ={get('ins_pq'):.3f} SQ={get('ins_sq'):.3f} RQ={get('ins_rq'):.3f}  "
                         f"ARI={get('ins_ari'):.3f}")
            extra = [f"{k.split('/')[-1]}={v:.4g}" for k, v in metrics.items()
                     if k.startswith(self._key(label, "")) and k.rsplit("_", 1)[-1] in ("mae", "rmse", "dist", "deg",
                                                                                        "acc")]
            if extra:
                lines.append(f"[{label}] Query heads (matched instances): " + " ".join(extra))
        return "\n".join(lines)
