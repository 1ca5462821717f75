"""pimm's GRPO rollout format: a ``trajectories`` dict of per-trajectory tensors
(``docs/grpo.md``), split into exact micro-batches of whole trajectories whose
losses the policy normalises by whole-rollout totals counted over all ranks."""

from __future__ import annotations

import math

import torch

from pimm.engines.observe.metrics import reduce_op_by_suffix
from pimm.utils import comm
from pimm.utils.errors import UserError

__all__ = ["PimmFormat", "split_rollout", "combine_micro_batch_metrics", "reward_health"]


# -- metrics --------------------------------------------------------------------------
def combine_micro_batch_metrics(outputs: list[dict]) -> dict[str, torch.Tensor]:
    """One update's scalars from its micro-batches' outputs: each micro-batch
    reports its additive share (see docs/grpo.md), so values are summed;
    ``*_min`` / ``*_max`` keys take the min / max. Non-scalar outputs are ignored."""
    combined: dict[str, torch.Tensor] = {}
    for output in outputs:
        for key, value in output.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                continue
            value = value.detach().reshape(())
            if key not in combined:
                combined[key] = value
            elif key.endswith("_min"):
                combined[key] = torch.minimum(combined[key], value)
            elif key.endswith("_max"):
                combined[key] = torch.maximum(combined[key], value)
            else:
                combined[key] = combined[key] + value
    return combined


# -- rollouts ---------------------------------------------------------------------------
def split_rollout(rollout: dict, size: int | None) -> list[dict]:
    """Micro-batches of at most ``size`` whole trajectories (in order). Only the
    per-trajectory tensors (``rollout["trajectories"]``) are sliced; everything
    else (context, totals) is shared."""
    trajectories = rollout["trajectories"]
    count = len(next(iter(trajectories.values())))
    if size is None or size >= count:
        return [rollout]
    return [{**rollout, "trajectories": {k: v[start:start + size] for k, v in trajectories.items()}}
            for start in range(0, count, size)]


def _check_rollout(rollout, model_name: str) -> None:
    where = f"{model_name}.sample_grpo_batch"
    if not isinstance(rollout, dict) or not isinstance(rollout.get("trajectories"), dict):
        raise UserError(f"{where} must return a dict with a 'trajectories' dict of per-trajectory tensors "
                        "(see docs/grpo.md)")
    trajectories = rollout["trajectories"]
    mask = trajectories.get("action_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise UserError(f"{where}: trajectories['action_mask'] must be a (trajectories, steps) tensor")
    lengths = {k: v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else None for k, v in trajectories.items()}
    wrong = [f"{k} ({n})" for k, n in lengths.items() if n != mask.shape[0]]
    if wrong:
        raise UserError(f"{where}: every trajectories entry must be a tensor with one row per trajectory "
                        f"({mask.shape[0]}); not so for {', '.join(wrong)}")


def _global_totals(action_mask: torch.Tensor) -> dict:
    """Trajectories, active steps and the longest trajectory over all ranks."""
    mask = action_mask.bool()
    counts = torch.tensor([float(mask.shape[0]), float(mask.sum())], dtype=torch.float64)
    longest = torch.tensor(float(mask.sum(1).max()) if mask.numel() else 0.0, dtype=torch.float64)
    comm.all_reduce(counts, op="sum")
    comm.all_reduce(longest, op="max")
    return {"trajectories": counts[0].item(), "steps": counts[1].item(), "max_length": longest.item(),
            "world_size": comm.get_world_size()}


def reward_health(trajectories: dict) -> tuple[float, float, float] | None:
    """(finite rewards, groups, groups whose finite rewards differ), summed over
    ranks; None when the rollout has no ``rewards`` / ``event_index``."""
    rewards, groups = trajectories.get("rewards"), trajectories.get("event_index")
    if not isinstance(rewards, torch.Tensor) or not isinstance(groups, torch.Tensor) or rewards.dim() != 1:
        return None
    rewards, groups = rewards.detach().double().cpu(), groups.detach().long().cpu()
    finite = torch.isfinite(rewards)
    spread = 0
    if groups.numel():
        _, groups = torch.unique(groups, return_inverse=True)
        count = int(groups.max()) + 1
        high = torch.full((count,), -math.inf, dtype=torch.float64).scatter_reduce(
            0, groups[finite], rewards[finite], "amax")
        low = torch.full((count,), math.inf, dtype=torch.float64).scatter_reduce(
            0, groups[finite], rewards[finite], "amin")
        spread = int((high > low).sum())
        total = count
    else:
        total = 0
    counts = torch.tensor([float(finite.sum()), float(total), float(spread)], dtype=torch.float64)
    comm.all_reduce(counts, op="sum")
    return counts[0].item(), counts[1].item(), counts[2].item()


class PimmFormat:
    """GRPOTrainer's rules for pimm's rollout format (a ``trajectories`` dict of
    per-trajectory tensors, ``docs/grpo.md``): exact micro-batches normalised by
    whole-rollout totals, additive metrics, ``<key>_first/_last/_mean``."""

    name = "pimm"
    reduce_op = staticmethod(reduce_op_by_suffix)

    def prepare(self, rollout: dict, model_name: str) -> None:
        """Check the rollout and attach ``rollout["totals"]`` (over all ranks)."""
        _check_rollout(rollout, model_name)
        rollout["totals"] = _global_totals(rollout["trajectories"]["action_mask"])

    def chunks(self, rollout: dict, size: int | None) -> list[tuple[dict, None]]:
        """Micro-batches of whole trajectories; the policy's own normalisers make them exact (no weight)."""
        return [(micro, None) for micro in split_rollout(rollout, size)]

    def combine(self, outputs: list[tuple[dict, None]], model, rollout: dict) -> dict:
        """One update's scalars (:func:`combine_micro_batch_metrics`)."""
        return combine_micro_batch_metrics([output for output, _ in outputs])

    def rollout_metrics(self, rollout: dict) -> dict:
        """The rollout's own metrics (reward, lengths), published with every update."""
        return rollout.get("metrics", {})

    @staticmethod
    def summarize_updates(history: list[dict]) -> dict:
        """``<key>_first`` / ``_last`` / ``_mean`` over a rollout's (2+) updates, for
        the mean-reduced keys."""
        if len(history) < 2:
            return {}
        summary = {}
        for key in history[-1]:
            if reduce_op_by_suffix(key) != "mean":
                continue
            values = [h[key] for h in history if key in h]
            summary[f"{key}_first"], summary[f"{key}_last"] = values[0], values[-1]
            summary[f"{key}_mean"] = torch.stack(values).mean()
        return summary

    @staticmethod
    def batch_stats(rollout: dict) -> dict:
        """Trajectories and actions (active steps) of this rank's rollout."""
        mask = rollout["trajectories"]["action_mask"]
        return {"trajectories": int(mask.shape[0]), "actions": int(mask.sum())}
