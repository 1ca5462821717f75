"""Instance proposals scored against true instances: the matching, and ProposalEvaluator.

A proposal is a direction (an angle in the event's plane, radians) and a class;
it matches a true track when their directions differ by less than the angular
tolerance and, unless ``use_class=False``, their classes agree. Proposals and
tracks are matched one to one (a maximum matching), and an event scores
``F1 = 2 tp / (proposals + tracks)`` (1 for an event with neither).

The same functions give the GRPO reward of the track-proposal policy
(:mod:`pimm.models.grpo.track_policy`) and the evaluator's held-out score, so
``val/f1`` is the reward of the greedy policy.
"""

from __future__ import annotations

import math

import torch

from pimm.engines.hooks.evaluator import EvaluatorBase
from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError
from pimm.utils.domains import Count, Key, Real

__all__ = ["angle_difference", "count_matches", "match_proposals", "f1_scores", "ProposalEvaluator"]


def angle_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Absolute difference of angles in radians, in [0, pi]."""
    return torch.remainder(a - b + math.pi, 2.0 * math.pi).sub(math.pi).abs()


def _max_matching(candidates: list[list[int]], num_true: int) -> int:
    """Size of a maximum bipartite matching (Kuhn's augmenting paths);
    ``candidates[p]`` lists the true indices proposal ``p`` may match."""
    owner = [-1] * num_true

    def augment(p: int, seen: list[bool]) -> bool:
        for t in candidates[p]:
            if not seen[t]:
                seen[t] = True
                if owner[t] < 0 or augment(owner[t], seen):
                    owner[t] = p
                    return True
        return False

    return sum(augment(p, [False] * num_true) for p in range(len(candidates)))


def count_matches(match: torch.Tensor) -> torch.Tensor:
    """``(E,)`` sizes of maximum one-to-one matchings from ``(E, P, K)`` candidate
    pairs. When no proposal has two candidates (tracks further apart than twice
    the tolerance) the count is the number of tracks with a candidate, computed
    in one vectorised step; other rows are solved exactly, one by one."""
    match = match.bool()
    tp = match.any(1).sum(1)
    ambiguous = (match.sum(2) > 1).any(1)
    if bool(ambiguous.any()):
        tp = tp.clone()
        for row in ambiguous.nonzero().flatten().tolist():
            pairs = match[row]
            candidates = [pairs[p].nonzero().flatten().tolist() for p in range(pairs.shape[0])]
            tp[row] = _max_matching(candidates, pairs.shape[1])
    return tp


def match_proposals(pred_angle: torch.Tensor, pred_class: torch.Tensor, pred_valid: torch.Tensor,
                    true_angle: torch.Tensor, true_class: torch.Tensor, true_valid: torch.Tensor,
                    tolerance: float, use_class: bool = True) -> torch.Tensor:
    """True positives ``(E,)`` per event from padded ``(E, P)`` proposals and
    ``(E, K)`` true tracks (``*_valid`` marks the real entries)."""
    close = angle_difference(pred_angle[:, :, None], true_angle[:, None, :]) < tolerance
    match = close & pred_valid.bool()[:, :, None] & true_valid.bool()[:, None, :]
    if use_class:
        match &= pred_class[:, :, None] == true_class[:, None, :]
    return count_matches(match)


def f1_scores(tp: torch.Tensor, num_pred: torch.Tensor, num_true: torch.Tensor) -> torch.Tensor:
    """Per-event F1 ``2 tp / (num_pred + num_true)``; 1 where both are 0."""
    denominator = (num_pred + num_true).double()
    return torch.where(denominator > 0, 2.0 * tp.double() / denominator.clamp(min=1.0),
                       torch.ones_like(denominator))


@HOOKS.register_module()
class ProposalEvaluator(EvaluatorBase):
    """Held-out score of a proposal model's (greedy) proposals.

    The model's evaluation output must hold ``proposal_angle``,
    ``proposal_class`` and ``proposal_valid`` ``(B, P)``; the batch, the true
    ``track_angle`` and ``track_class`` ``(B, K)`` (class -1 = no track).

    Logged: ``f1`` (mean per-event F1, the reward's definition; selects the
    best checkpoint), ``precision`` and ``recall`` (over all events' counts),
    ``direction_f1`` (mean per-event F1 ignoring the class) and
    ``proposals_per_event``.

    Args:
        angle_tolerance_deg: a proposal matches a track within this angle.
    """

    metric_name = "f1"

    domains = dict(angle_tolerance_deg=Real(0, 180, lo_open=True), every_n_steps=Count | None, prefix=Key)

    def __init__(self, angle_tolerance_deg: float = 10.0, every_n_steps: int | None = None, prefix: str = "val"):
        super().__init__(every_n_steps=every_n_steps, prefix=prefix)
        if isinstance(angle_tolerance_deg, bool) or not isinstance(angle_tolerance_deg, (int, float)) \
                or not 0 < angle_tolerance_deg <= 180:
            raise ConfigError(f"ProposalEvaluator: angle_tolerance_deg={angle_tolerance_deg!r} must be in (0, 180]")
        self.tolerance = math.radians(angle_tolerance_deg)
        self._sums: dict[str, torch.Tensor] = {}

    def reset(self) -> None:
        self._sums = {}

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach().double().sum()
        self._sums[name] = self._sums[name] + value if name in self._sums else value

    def process(self, input_dict: dict, output_dict: dict) -> None:
        missing = [k for k in ("proposal_angle", "proposal_class", "proposal_valid") if k not in output_dict]
        missing += [k for k in ("track_angle", "track_class") if k not in input_dict]
        if missing:
            raise ConfigError(f"ProposalEvaluator needs {', '.join(missing)} in the model output / batch; "
                              "use it with a proposal model and a data set with true tracks")
        pred = (output_dict["proposal_angle"], output_dict["proposal_class"], output_dict["proposal_valid"])
        true_class = input_dict["track_class"]
        true = (input_dict["track_angle"], true_class, true_class >= 0)
        num_pred, num_true = pred[2].sum(1), true[2].sum(1)
        tp = match_proposals(*pred, *true, self.tolerance)
        tp_direction = match_proposals(*pred, *true, self.tolerance, use_class=False)
        self._add("f1_sum", f1_scores(tp, num_pred, num_true))
        self._add("direction_f1_sum", f1_scores(tp_direction, num_pred, num_true))
        self._add("events", torch.ones_like(num_pred))
        self._add("tp", tp)
        self._add("pred", num_pred)
        self._add("true", num_true)

    def accumulators(self) -> dict[str, torch.Tensor]:
        names = ("f1_sum", "direction_f1_sum", "events", "tp", "pred", "true")
        zero = torch.zeros((), dtype=torch.float64, device=self.trainer.device)
        return {name: self._sums.get(name, zero).clone() for name in names}

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        events = float(totals["events"])
        tp, pred, true = float(totals["tp"]), float(totals["pred"]), float(totals["true"])
        nan = float("nan")
        return {
            "f1": float(totals["f1_sum"]) / events if events else nan,
            "direction_f1": float(totals["direction_f1_sum"]) / events if events else nan,
            "precision": tp / pred if pred else nan,
            "recall": tp / true if true else nan,
            "proposals_per_event": pred / events if events else nan,
        }
