"""``MAEEvaluator``: the validation losses of masked point modelling (PoLAr-MAE).

A pre-training run has no labels to score; what tells it is learning is the
reconstruction loss on events it never trained on. The model computes its own
losses (a random set of tokens hidden, under the evaluation's forked RNG, so
training's random streams are untouched); this hook averages them over the
validation batches and publishes ``val/loss``, ``val/coord_loss`` (Chamfer),
``val/feat_loss`` (energy) and ``val/mask_ratio``, with upstream's
``neg_val_loss`` (higher is better) as the metric that selects the best model.
"""

from __future__ import annotations

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Bool, Count, PosInt

__all__ = ["MAEEvaluator"]

_KEYS = (("loss", "loss"), ("coord_loss", "chamfer_loss"), ("feat_loss", "energy_loss"), ("mask_ratio", "mask_ratio"))


@HOOKS.register_module()
class MAEEvaluator(EvaluatorBase):
    """Average reconstruction losses over ``data.val`` (upstream's arguments).

    Args:
        every_n_steps: evaluate every N steps; 0 (upstream's default) or None:
            at epoch ends.
        max_batches: score at most this many validation batches (None: all).
        log_pointclouds: upstream logs reconstructions to W&B; accepted, and
            nothing is drawn (pimm's displays are for labelled events).
    """

    metric_name = "neg_val_loss"
    greater_is_better = True
    domains = dict(every_n_steps=Count | None, max_batches=PosInt | None, log_pointclouds=Bool)

    def __init__(self, every_n_steps: int | None = 0, max_batches: int | None = None, log_pointclouds: bool = True):
        super().__init__(every_n_steps=every_n_steps or None, log_images=0)
        self.max_batches, self.log_pointclouds = max_batches, bool(log_pointclouds)
        self._sums = self._seen = None

    def reset(self):
        # loss, coord_loss, feat_loss, mask_ratio summed over batches, then the batch count
        self._sums = torch.zeros(len(_KEYS) + 1, dtype=torch.float64, device=self.trainer.device)
        self._seen = 0

    def forward_batch(self, batch, model):
        self._seen += 1
        if self.max_batches is not None and self._seen > self.max_batches:
            return batch, {}  # past the cap: the model is not run
        return super().forward_batch(batch, model)

    def process(self, input_dict, output_dict):
        if "loss" not in output_dict:
            return
        values = [output_dict.get(key, output_dict["loss"].new_zeros(())).detach().double().reshape(())
                  for _, key in _KEYS]
        self._sums += torch.stack(values + [values[0].new_ones(())])

    def accumulators(self):
        return {"sums": self._sums}

    def compute(self, totals):
        sums = totals["sums"].tolist()
        batches = max(sums[-1], 1.0)
        metrics = {name: value / batches for (name, _), value in zip(_KEYS, sums)}
        metrics["neg_val_loss"] = -metrics["loss"]
        return metrics
