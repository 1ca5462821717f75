# upstream docs/source/extend/add_model.md, "Add a new criterion" (unmodified)
# pimm/models/losses/tversky.py
import torch
import torch.nn as nn
import torch.nn.functional as F

from .builder import LOSSES


@LOSSES.register_module()
class TverskyLoss(nn.Module):
    """Multiclass Tversky loss for per-point class logits."""

    def __init__(
        self,
        alpha=0.3,
        beta=0.7,
        eps=1e-6,
        ignore_index=-1,
        loss_weight=1.0,
    ):
        super().__init__()
        self.alpha = alpha
        self.beta = beta
        self.eps = eps
        self.ignore_index = ignore_index
        self.loss_weight = loss_weight

    def forward(self, pred, target):
        target = target.reshape(-1).long()
        valid = target != self.ignore_index

        # A batch with no labelled points still returns a differentiable zero.
        if not torch.any(valid):
            return pred.sum() * 0.0

        pred = pred[valid]
        target = target[valid]
        probability = pred.softmax(dim=-1)
        truth = F.one_hot(target, num_classes=pred.shape[-1]).to(probability.dtype)

        true_positive = (probability * truth).sum(dim=0)
        false_positive = (probability * (1.0 - truth)).sum(dim=0)
        false_negative = ((1.0 - probability) * truth).sum(dim=0)
        score = (true_positive + self.eps) / (
            true_positive
            + self.alpha * false_positive
            + self.beta * false_negative
            + self.eps
        )
        return self.loss_weight * (1.0 - score.mean())
