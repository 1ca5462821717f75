"""ClsEvaluator: accuracy, per-class accuracy and confusion matrix of a classifier.

Like the segmentation evaluators, ``num_classes`` and ``class_names`` may be
left out and are then read from ``data.num_classes`` / ``data.names``
(:mod:`pimm.evaluation.common`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.evaluation.common import ClassesFromData, check_classes
from pimm.evaluation.metrics import classification_scores, confusion_matrix
from pimm.utils.domains import MAX_SIZE, Count, Int, Key, Names

__all__ = ["ClsEvaluator"]


@HOOKS.register_module()
class ClsEvaluator(ClassesFromData, EvaluatorBase):
    """Reads ``output[logits_key]`` (B, K) and ``input[target_key]`` (B,).
    ``num_classes`` / ``class_names`` default to ``data.num_classes`` /
    ``data.names``. The best checkpoint follows ``acc``."""

    metric_name = "acc"

    domains = dict(num_classes=Int(1, MAX_SIZE) | None, class_names=Names | None, logits_key=Key, target_key=Key,
                   every_n_steps=Count | None, image_key=Key, log_images=Int(0, 64))

    def __init__(self, num_classes: int | None = None, class_names: Sequence[str] | None = None,
                 logits_key: str = "cls_logits", target_key: str = "label", every_n_steps: int | None = None,
                 image_key: str = "img", log_images: int = 2):
        super().__init__(every_n_steps=None if every_n_steps == 0 else every_n_steps, log_images=log_images)
        self.image_key = image_key
        self.num_classes, self.class_names = check_classes(type(self).__name__, num_classes, class_names)
        # Every label counts in classification; -1 only tells the shared
        # resolver that nothing needs to be taken from data.ignore_index.
        self.ignore_index = -1
        self.logits_key, self.target_key = logits_key, target_key
        self._conf = None

    def reset(self):
        self.require_classes()
        self._conf = torch.zeros(self.num_classes, self.num_classes, dtype=torch.int64, device=self.trainer.device)

    def process(self, input_dict, output_dict):
        if self.logits_key not in output_dict:
            raise KeyError(f"ClsEvaluator: the model output has no {self.logits_key!r} "
                           f"(keys: {sorted(output_dict)}); set logits_key")
        pred = output_dict[self.logits_key].argmax(dim=1)
        self._conf += confusion_matrix(pred, input_dict[self.target_key].reshape(-1), self.num_classes)

    def accumulators(self):
        return {"confusion": self._conf}

    def display(self, input_dict, output_dict, limit):
        """Image inputs (``(B, C, H, W)``, e.g. Cherenkov rings) with true and predicted class."""
        images = input_dict.get(self.image_key)
        if not isinstance(images, torch.Tensor) or images.dim() != 4:
            return []
        from pimm.evaluation.displays import render_ring_event

        probs = output_dict[self.logits_key].float().softmax(dim=1)
        labels = input_dict[self.target_key].reshape(-1)
        return [render_ring_event(images[i], int(labels[i]), int(probs[i].argmax()), self.class_names,
                                  probability=float(probs[i].max())) for i in range(min(limit, len(images)))]

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
