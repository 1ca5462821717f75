"""ClsEvaluator: accuracy, per-class accuracy and confusion matrix of a classifier."""

from __future__ import annotations

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.metrics import classification_scores, confusion_matrix

__all__ = ["ClsEvaluator"]


@HOOKS.register_module()
class ClsEvaluator(EvaluatorBase):
    """Reads ``output[logits_key]`` (B, K) and ``input[target_key]`` (B,).
    The best checkpoint follows ``acc``."""

    metric_name = "acc"

    def __init__(self, num_classes: int, class_names=None, logits_key: str = "cls_logits",
                 target_key: str = "label", every_n_steps: int | None = None):
        super().__init__(every_n_steps=every_n_steps)
        if class_names is not None and len(class_names) != num_classes:
            raise ValueError(f"class_names has {len(class_names)} names for num_classes={num_classes}")
        self.num_classes = num_classes
        self.class_names = list(class_names) if class_names else [str(i) for i in range(num_classes)]
        self.logits_key, self.target_key = logits_key, target_key
        self._conf = None

    def reset(self):
        self._conf = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.trainer.device)

    def process(self, input_dict, output_dict):
        if self.logits_key not in output_dict:
            raise KeyError(f"ClsEvaluator: the model output has no {self.logits_key!r} "
                           f"(keys: {sorted(output_dict)}); set logits_key")
        pred = output_dict[self.logits_key].argmax(dim=1)
        self._conf += confusion_matrix(pred, input_dict[self.target_key].reshape(-1), self.num_classes)

    def accumulators(self):
        return {"confusion": self._conf}

    def compute(self, totals):
        scores = classification_scores(totals["confusion"])
        metrics = {"acc": scores["acc"], "mAcc": scores["mAcc"]}
        for name, value in zip(self.class_names, scores["class_acc"]):
            metrics[f"acc_{name}"] = value
        metrics["confusion"] = scores["confusion"]
        return metrics

    def report(self, metrics):
        width = max(5, *(len(n) for n in self.class_names)) + 2
        lines = ["class".ljust(width) + "acc     " + "  predicted as: " + " ".join(n[:8].rjust(8) for n in self.class_names)]
        for name, row in zip(self.class_names, metrics["confusion"]):
            acc = metrics[f"acc_{name}"]
            lines.append(name.ljust(width) + f"{acc:.4f}  " + " " * 15 + " ".join(str(v).rjust(8) for v in row))
        return "\n".join(lines)
