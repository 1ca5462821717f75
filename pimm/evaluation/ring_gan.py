"""RingGANEvaluator: how far generated ring images are from real ones.

A GAN's losses say little about sample quality, so the evaluator compares
simple physical statistics of the images, one value per image, between the
validation events and as many generated ones:

* ``hits``: pixels with charge above the hit threshold;
* ``charge``: total charge in photo-electrons (``expm1`` of the ``log1p``
  images, see ``CherenkovRingDataset(log_charge=True)``);
* ``radius``: the charge-weighted RMS distance (pixels) of the hits from
  their charge-weighted centre; the azimuth axis is periodic, so the centre's
  column is a circular mean and distances wrap around.

For each statistic it logs the real and generated means
(``<stat>_real``, ``<stat>_fake``) and the gap in units of the real spread,
``|mean_fake - mean_real| / std_real``; ``stat_gap`` (lower is better, the
metric that selects the best model) is their average, with the ratio of the
spreads ``<stat>_std_ratio`` beside it. ``disc_acc`` is the discriminator's
accuracy on real and generated images together (0.5: it cannot tell them
apart). These are a sanity proxy, not a physics validation: matching three
moments does not make every ring right.
"""

from __future__ import annotations

import math

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import MAX_REAL, Count, Key, Real

__all__ = ["RingGANEvaluator", "ring_image_stats"]

STATS = ("hits", "charge", "radius")


def ring_image_stats(img: torch.Tensor, hit_threshold: float) -> torch.Tensor:
    """``(B, 3)``: hits, total charge (PE) and ring radius (pixels) of ``log1p``
    charge images ``(B, C, H, W)`` (channel 0 is the charge)."""
    x = img[:, 0].float().clamp(min=0)
    hit = x > math.log1p(hit_threshold)
    charge = torch.expm1(x) * hit
    height, width = x.shape[-2:]
    weight = charge.sum((1, 2))
    safe = weight.clamp(min=1e-12)
    rows = torch.arange(height, device=x.device, dtype=x.dtype).view(1, height, 1)
    cols = torch.arange(width, device=x.device, dtype=x.dtype).view(1, 1, width)
    z0 = (charge * rows).sum((1, 2)) / safe
    angle = cols * (2 * math.pi / width)
    phi0 = torch.atan2((charge * torch.sin(angle)).sum((1, 2)), (charge * torch.cos(angle)).sum((1, 2)))
    phi0 = phi0 * (width / (2 * math.pi))
    dphi = torch.remainder(cols - phi0.view(-1, 1, 1) + width / 2, width) - width / 2
    dz = rows - z0.view(-1, 1, 1)
    radius = torch.sqrt((charge * (dz ** 2 + dphi ** 2)).sum((1, 2)) / safe) * (weight > 0)
    return torch.stack([hit.sum((1, 2)).to(x.dtype), weight, radius], dim=1)


@HOOKS.register_module()
class RingGANEvaluator(EvaluatorBase):
    """Reads ``input[image_key]`` (real images) and the model's ``fake``,
    ``logits_real`` and ``logits_fake`` (see :class:`~pimm.models.ring_gan.RingGAN`);
    see the module docstring for the metrics."""

    metric_name = "stat_gap"
    greater_is_better = False

    domains = dict(image_key=Key, hit_threshold=Real(0, MAX_REAL), every_n_steps=Count | None)

    def __init__(self, image_key: str = "img", hit_threshold: float = 0.25, every_n_steps: int | None = None):
        super().__init__(every_n_steps=every_n_steps, log_images=0)
        if isinstance(hit_threshold, bool) or not isinstance(hit_threshold, (int, float)) or hit_threshold < 0:
            raise ValueError(f"hit_threshold must be a number >= 0 (PE), got {hit_threshold!r}")
        self.image_key, self.hit_threshold = image_key, float(hit_threshold)
        self._sums = None

    def reset(self):
        # Per statistic and kind (real, fake): count, sum, sum of squares; then D's correct answers.
        self._sums = torch.zeros(2, 3, len(STATS), dtype=torch.float64, device=self.trainer.device)
        self._correct = torch.zeros(2, dtype=torch.float64, device=self.trainer.device)

    def process(self, input_dict, output_dict):
        missing = [k for k in ("fake", "logits_real", "logits_fake") if k not in output_dict]
        if missing:
            raise KeyError(f"RingGANEvaluator: the model output has no {missing[0]!r} (keys: {sorted(output_dict)})")
        for kind, images in enumerate((input_dict[self.image_key], output_dict["fake"])):
            stats = ring_image_stats(images, self.hit_threshold).double()
            self._sums[kind, 0] += stats.shape[0]
            self._sums[kind, 1] += stats.sum(0)
            self._sums[kind, 2] += (stats ** 2).sum(0)
        self._correct[0] += (output_dict["logits_real"] > 0).sum()
        self._correct[1] += (output_dict["logits_fake"] < 0).sum()

    def accumulators(self):
        return {"sums": self._sums, "correct": self._correct}

    def compute(self, totals):
        sums, correct = totals["sums"], totals["correct"]
        count = sums[:, 0].clamp(min=1)
        mean = sums[:, 1] / count
        std = (sums[:, 2] / count - mean ** 2).clamp(min=0).sqrt()
        n_real, n_fake = sums[0, 0, 0].item(), sums[1, 0, 0].item()
        metrics = {"disc_acc": correct.sum().item() / max(1.0, n_real + n_fake),
                   "disc_acc_real": correct[0].item() / max(1.0, n_real),
                   "disc_acc_fake": correct[1].item() / max(1.0, n_fake)}
        gaps = []
        for i, name in enumerate(STATS):
            spread = max(std[0, i].item(), 1e-12)
            gap = abs(mean[1, i].item() - mean[0, i].item()) / spread
            gaps.append(gap)
            metrics.update({f"{name}_real": mean[0, i].item(), f"{name}_fake": mean[1, i].item(),
                            f"{name}_gap": gap, f"{name}_std_ratio": std[1, i].item() / spread})
        metrics["stat_gap"] = sum(gaps) / len(gaps)
        return metrics

    def report(self, metrics):
        rows = [f"{'':8}{'real':>10}{'generated':>11}{'gap/std':>9}"]
        rows += [f"{name:8}{metrics[name + '_real']:10.2f}{metrics[name + '_fake']:11.2f}{metrics[name + '_gap']:9.2f}"
                 for name in STATS]
        return "\n".join(rows + [f"discriminator accuracy {metrics['disc_acc']:.3f} (0.5: cannot tell them apart)"])
