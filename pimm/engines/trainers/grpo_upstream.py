"""Upstream pimm's GRPO rollout format, trained with upstream's semantics.

A policy written for upstream pimm returns from ``sample_grpo_batch`` a dict
of *events*::

    {"events": [{"trajectories": [obj, ...],   # each obj has a .metrics dict
                 "advantages": [...],           # one per trajectory
                 "step_advantages": [...],      # optional, one row per trajectory
                 "reward_std": ..., "rloo_score_mean": ..., "rloo_score_std": ...,  # optional
                 ...},                          # the model's own keys
                ...],
     "metric_count": int, "metric_sums": {name: float},
     "reward_stds": [...], "rloo_score_means": [...], "rloo_score_stds": [...],  # optional, one per event
     ...}

and its ``grpo_loss_from_batch`` returns the loss of (a chunk of) it,
averaged over the chunk's own trajectories. :class:`UpstreamFormat` gives
GRPOTrainer upstream's rules for such a rollout, so the policy trains
unmodified:

* with ``trajectory_microbatch_size`` set, every event is cut into slices of
  that many trajectories (advantages and step advantages cut alike); a chunk
  is a shallow copy of the rollout holding one sliced event, with
  ``metric_count`` = its trajectories, ``metric_sums`` summed from their
  ``.metrics`` and the per-event lists cut to that event. Each chunk's loss
  is weighted by ``metric_count / total`` before its backward pass. Without a
  micro-batch size the whole rollout is one unweighted call;
* chunk outputs combine by key: ``_min`` in the name -> min, ``_max`` or
  ``abs_max`` -> max, other tensors -> the weighted sum, other values from
  the first chunk; then ``model._rollout_metric_tensors(rollout)`` is merged
  (micro-batched updates only, as upstream);
* over the updates of one rollout: ``<key>_update0``, ``<key>_last`` and
  ``<key>_mean_update`` for the ``rl_*`` keys of :data:`TRACKED_KEYS`;
* across ranks: ``_min`` in the name -> min, ``_max`` / ``abs_max`` -> max,
  others the mean.

Where pimm departs from upstream on purpose (the loss runs through the DDP
wrapper so gradients are all-reduced; AMP, clipping and the scheduler are
the engine's OptimStep; sampling is under ``no_grad`` and, by default, in
eval mode) is listed in ``docs/migration.md``. The weighting by trajectory
count is exact only for losses that are plain means over trajectories; a
policy normalising by active steps should move to pimm's format
(``docs/grpo.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pimm.utils.errors import UserError

__all__ = ["UpstreamFormat", "is_upstream_rollout", "slice_event", "upstream_chunks", "combine_chunk_outputs",
           "summarize_updates", "upstream_reduce_op", "TRACKED_KEYS"]

#: Keys whose first / last / mean value over a rollout's updates upstream logs.
TRACKED_KEYS = (
    "rl_pg_loss", "rl_kl_loss", "rl_kl", "rl_ratio_geom",
    "rl_log_ratio", "rl_log_ratio_min", "rl_log_ratio_max",
    "rl_stop_log_ratio", "rl_stop_log_ratio_min", "rl_stop_log_ratio_max",
    "rl_class_log_ratio", "rl_class_log_ratio_min", "rl_class_log_ratio_max",
    "rl_kernel_log_ratio", "rl_kernel_log_ratio_min", "rl_kernel_log_ratio_max",
    "rl_kernel_dim_log_ratio", "rl_kernel_dim_log_ratio_min", "rl_kernel_dim_log_ratio_max",
    "rl_clip_frac", "rl_logprob", "rl_advantage_abs_max",
)


def is_upstream_rollout(rollout) -> bool:
    """Whether ``rollout`` is in upstream's event format (pimm's has a ``trajectories`` dict)."""
    return isinstance(rollout, dict) and "events" in rollout and "trajectories" not in rollout


def upstream_reduce_op(key: str) -> str:
    """Upstream's rule for combining a key across chunks and ranks: by substring."""
    if "_min" in key:
        return "min"
    if "_max" in key or "abs_max" in key:
        return "max"
    return "mean"


def _metric_sums(trajectories) -> dict[str, float]:
    sums: dict[str, float] = {}
    for trajectory in trajectories:
        for key, value in trajectory.metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    return sums


def slice_event(event: dict, start: int, end: int) -> dict:
    """A shallow copy of ``event`` keeping trajectories ``[start, end)`` (advantages
    and step advantages cut alike; everything else shared)."""
    sliced = dict(event)
    sliced["trajectories"] = event["trajectories"][start:end]
    if "advantages" in sliced:
        sliced["advantages"] = sliced["advantages"][start:end]
    if sliced.get("step_advantages") is not None:
        sliced["step_advantages"] = sliced["step_advantages"][start:end]
    return sliced


def upstream_chunks(rollout: dict, size: int | None) -> list[tuple[dict, float | None]]:
    """The rollout's chunks with the weight of each one's loss (None: unweighted,
    the whole rollout in one call when ``size`` is None)."""
    if not size:
        return [(rollout, None)]
    chunks = []
    for event in rollout["events"]:
        count = len(event["trajectories"])
        for start in range(0, count, size):
            sliced = slice_event(event, start, min(start + size, count))
            chunk = dict(rollout)
            chunk["events"] = [sliced]
            chunk["metric_count"] = len(sliced["trajectories"])
            chunk["metric_sums"] = _metric_sums(sliced["trajectories"])
            if "reward_stds" in chunk:
                chunk["reward_stds"] = [sliced.get("reward_std", event.get("reward_std"))]
            for many, one in (("rloo_score_means", "rloo_score_mean"), ("rloo_score_stds", "rloo_score_std")):
                if many in chunk and one in sliced:
                    chunk[many] = [sliced[one]]
            chunks.append(chunk)
    total = max(sum(max(0, int(chunk["metric_count"])) for chunk in chunks), 1)
    return [(chunk, max(0, int(chunk["metric_count"])) / total) for chunk in chunks]


def combine_chunk_outputs(outputs: list[tuple[dict, float | None]]) -> dict:
    """One update's outputs from its chunks' ``(output, weight)``: the keys of the
    first chunk; tensors by :func:`upstream_reduce_op` (min, max, else the
    weighted sum), other values from the first chunk."""
    if not outputs:
        raise UserError("GRPOTrainer: the rollout has no trajectories to train on (no events, or empty events)")
    first = outputs[0][0]
    combined = {}
    for key, value in first.items():
        if not isinstance(value, torch.Tensor):
            combined[key] = value
            continue
        values = [(output[key].detach(), weight) for output, weight in outputs if key in output]
        op = upstream_reduce_op(key)
        if op == "min":
            combined[key] = torch.stack([v for v, _ in values]).min()
        elif op == "max":
            combined[key] = torch.stack([v for v, _ in values]).max()
        elif values[0][1] is None:  # the whole rollout in one call
            combined[key] = values[0][0]
        else:
            combined[key] = torch.stack([v * float(w) for v, w in values]).sum()
    return combined


def summarize_updates(history: list[dict]) -> dict:
    """Upstream's ``<key>_update0`` / ``_last`` / ``_mean_update`` over a rollout's
    updates, for the tracked ``rl_*`` keys present in the first and last one."""
    first, last = history[0], history[-1]
    summary = {}
    for key in TRACKED_KEYS:
        if key not in first or key not in last:
            continue
        summary[f"{key}_update0"], summary[f"{key}_last"] = first[key], last[key]
        if isinstance(first[key], torch.Tensor):
            summary[f"{key}_mean_update"] = torch.stack([h[key] for h in history if key in h]).mean()
    return summary


def _check(rollout: dict, where: str) -> None:
    events = rollout["events"]
    if not isinstance(events, Sequence) or isinstance(events, (str, bytes)):
        raise UserError(f"{where}: rollout['events'] must be a list of event dicts (upstream format, see "
                        "docs/migration.md)")
    for index, event in enumerate(events):
        trajectories = event.get("trajectories") if isinstance(event, dict) else None
        if not isinstance(trajectories, Sequence):
            raise UserError(f"{where}: event {index} must be a dict with a 'trajectories' list")
        bad = next((t for t in trajectories if not isinstance(getattr(t, "metrics", None), dict)), None)
        if bad is not None:
            raise UserError(f"{where}: event {index} has a trajectory ({type(bad).__name__}) without a .metrics "
                            "dict")
        advantages = event.get("advantages")
        if advantages is None or len(advantages) != len(trajectories):
            got = "none" if advantages is None else len(advantages)
            raise UserError(f"{where}: event {index} needs 'advantages', one per trajectory ({len(trajectories)}); "
                            f"got {got}")


def _batch_stats(rollout: dict) -> dict:
    """Events, trajectories and (when the trajectories say) actions of a rollout."""
    events = rollout["events"]
    stats = {"events": len(events), "trajectories": sum(len(e["trajectories"]) for e in events)}
    actions = 0
    for event in events:
        for index, trajectory in enumerate(event["trajectories"]):
            taken = getattr(trajectory, "actions", None)
            if taken is None and event.get("step_advantages") is not None:
                taken = event["step_advantages"][index]
            if taken is None or not hasattr(taken, "__len__"):
                return stats
            actions += len(taken)
    stats["actions"] = actions
    return stats


class UpstreamFormat:
    """GRPOTrainer's rules for a rollout in upstream's event format (module doc)."""

    name = "upstream"
    reduce_op = staticmethod(upstream_reduce_op)
    summarize_updates = staticmethod(summarize_updates)
    batch_stats = staticmethod(_batch_stats)

    def prepare(self, rollout: dict, where: str) -> None:
        """Check the rollout's shape (nothing is added to it: the policy sees what it made)."""
        _check(rollout, where)

    def chunks(self, rollout: dict, size: int | None) -> list[tuple[dict, float | None]]:
        """Chunks and their loss weights (:func:`upstream_chunks`)."""
        return upstream_chunks(rollout, size)

    def combine(self, outputs: list[tuple[dict, float | None]], model, rollout: dict) -> dict:
        """One update's outputs; ``_rollout_metric_tensors`` merged when micro-batched."""
        combined = combine_chunk_outputs(outputs)
        if outputs[0][1] is not None and callable(getattr(model, "_rollout_metric_tensors", None)):
            combined.update(model._rollout_metric_tensors(rollout))
        return combined

    def rollout_metrics(self, rollout: dict) -> dict:
        """Per-rollout metrics published next to each update's (none: upstream's come
        through ``_rollout_metric_tensors``)."""
        return {}
