"""The ``LOSSES`` registry, the sum of a model's ``criteria``, and the helpers
the losses share (dropping ignored points, per-event splitting, reductions)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pimm.utils.config_domains import arguments_of, ask_class
from pimm.utils.domains import Rule, show
from pimm.utils.errors import ConfigError
from pimm.utils.registry import Registry

__all__ = ["LOSSES", "Criteria", "build_criteria", "CriteriaFitLogits", "drop_ignored", "split_events", "zero_loss",
           "legacy_reduction"]

#: Registry of point-wise losses (``dict(type="LovaszLoss", ...)``).
LOSSES = Registry("loss")

REDUCTIONS = ("mean", "sum", "none")


def drop_ignored(logits: torch.Tensor, target: torch.Tensor, ignore_index: int | None):
    """The rows of ``logits``/``target`` whose target is not ``ignore_index``."""
    if ignore_index is None:
        return logits, target
    keep = target != ignore_index
    return logits[keep], target[keep]


def zero_loss(logits: torch.Tensor) -> torch.Tensor:
    """A zero that keeps the graph alive (a batch whose points are all ignored
    must still give every parameter a gradient, of zero)."""
    return logits.sum() * 0.0


def split_events(offset: torch.Tensor | None, num_points: int, owner: str) -> list[slice]:
    """Row ranges of the events of a point batch from its cumulative ``offset``."""
    if offset is None:
        raise ConfigError(f"{owner}: per_image=True needs the batch's 'offset' (one loss per event); this model "
                          "does not pass it to its criteria: set per_image=False")
    ends = [int(e) for e in offset.reshape(-1).tolist()]
    if not ends or ends[-1] != num_points:
        raise ValueError(f"{owner}: offset {ends[-3:]} does not end at the batch's {num_points} points")
    starts = [0] + ends[:-1]
    return [slice(s, e) for s, e in zip(starts, ends)]


def legacy_reduction(reduction: str, size_average: bool | None, reduce: bool | None) -> str:
    """torch's rule for the deprecated ``size_average``/``reduce`` flags (either
    given: they decide; ``reduce=False`` means per-point losses)."""
    if size_average is not None or reduce is not None:
        size_average = True if size_average is None else bool(size_average)
        reduce = True if reduce is None else bool(reduce)
        reduction = "none" if not reduce else ("mean" if size_average else "sum")
    if reduction not in REDUCTIONS:
        raise ConfigError(f"reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    return reduction


def _takes_offset(loss: nn.Module) -> bool:
    try:
        return "offset" in inspect.signature(loss.forward).parameters
    except (TypeError, ValueError):
        return False


def _misfit(cfg: Any, columns: int | None, where: str, need: int | None) -> ConfigError | None:
    if need is None or columns is None or need == columns:
        return None
    return ConfigError(f"{where}={show(cfg)} is invalid: it scores {need} logit column(s) per target and the model's "
                       f"logits have {columns} (one per class): use a loss for {columns}-column logits (LovaszLoss: "
                       f"mode='multiclass') or give the model num_classes={need}")


class CriteriaFitLogits(Rule):
    """Each loss of a model's ``criteria`` that takes a set number of logit
    columns (its class's ``logit_columns``: ``LovaszLoss(mode="binary")`` one
    score per target) gets as many as the model's head has (``columns`` of the
    model's arguments): checked on the config, before anything is built."""

    def __init__(self, columns: Callable[[dict], int | None] = lambda a: a.get("num_classes")):
        super().__init__(lambda a: True, "criteria", "")
        self.columns = columns

    def check(self, args: dict, where: str) -> None:
        cfgs = args.get("criteria")
        for i, cfg in enumerate(cfgs if isinstance(cfgs, (list, tuple)) else ()):
            error = _misfit(cfg, self.columns(args), f"{where}criteria.{i}", ask_class(cfg, "criteria",
                                                                                       "logit_columns"))
            if error is not None:
                raise error


class Criteria(nn.Module):
    """Sum of several losses built from configs. Losses whose ``forward`` takes
    ``offset`` (per-event losses) get the batch's ``offset``. ``columns``: the
    width of the model's logits, checked against what each loss takes
    (:class:`CriteriaFitLogits`) for a model built outside a config."""

    def __init__(self, cfgs: Sequence[dict] | None, columns: int | None = None):
        super().__init__()
        if not cfgs:
            raise ConfigError("criteria is empty: give at least one loss, e.g. [dict(type='CrossEntropyLoss')]")
        self.losses = nn.ModuleList(LOSSES.build(cfg) for cfg in cfgs)
        for i, (cfg, loss) in enumerate(zip(cfgs, self.losses)):
            ask = getattr(type(loss), "logit_columns", None)
            error = _misfit(cfg, columns, f"criteria.{i}",
                            ask(arguments_of(type(loss), cfg)) if callable(ask) and isinstance(cfg, dict) else None)
            if error is not None:
                raise error
            if getattr(loss, "reduction", "mean") == "none":
                raise ConfigError(f"criteria: {cfg.get('type')} with reduction='none' returns one loss per point, "
                                  "and a model's loss must be one number: use reduction='mean' or 'sum'")
        self._offset_takers = [_takes_offset(loss) for loss in self.losses]

    def forward(self, logits, target, offset: torch.Tensor | None = None):
        """The summed loss; ``(loss, components)`` when a loss returns its own
        diagnostics as ``(value, dict)`` (upstream's instance losses), the
        dicts merged."""
        total, components = 0, None
        for loss, takes_offset in zip(self.losses, self._offset_takers):
            value = loss(logits, target, offset=offset) if takes_offset else loss(logits, target)
            if isinstance(value, tuple):
                value, info = value
                components = {**(components or {}), **info}
            total = total + value
        return total if components is None else (total, components)


def build_criteria(cfgs: Sequence[dict] | None, columns: int | None = None) -> Criteria:
    return Criteria(cfgs, columns)
