"""OOM back-off: redo a step whose forward/backward ran out of GPU memory with
its batches split into smaller parts, accumulating gradients so the update
matches the unsplit one.

Turned on by a trainer option (off by default)::

    train = dict(type="DefaultTrainer", oom_backoff=dict(max_splits=2))

When ``torch.OutOfMemoryError`` escapes a step's forward or backward,
:meth:`OOMBackoff.redo_step` releases the failed attempt (the frames of its
traceback, which hold the activations, and every gradient accumulated so far
in the step), then redoes all of the step's micro-batches split into 2 parts,
then 4, ... up to ``2 ** max_splits``, before giving up with a clear error.
Part ``i`` of a batch contributes ``loss_i * n_i / n`` (``n_i`` the part's
share of the batch as its splitter counts it), so for a loss that is a mean
over those units the accumulated gradient equals the unsplit batch's, up to
float rounding. It is not equal for batch-dependent layers (BatchNorm in
training mode sees smaller batches) or losses that do not decompose over the
batch (Lovasz, a mean over a subset such as ``ignore_index``-filtered
points); random layers draw other numbers.

Splitting: a batch is split by the first of

* ``collate_fn.split_batch`` (the loader's collate function, or the function
  behind a ``functools.partial``),
* the training data set's ``split_batch`` method,
* :func:`split_by_leading_dim`: a dict whose tensors (and lists) share their
  leading dimension, split along it (image batches from the default collate).

``split_batch(batch, parts) -> [(part, weight), ...]``: at most ``parts``
non-empty parts in batch order, each with its weight (the number of samples,
points, ... that the loss averages over). pimm's point-cloud collate
functions split by whole events (``pimm.datasets.collate.split_point_batch``).

Single process only: under DDP one rank cannot redo its step alone (the
others are already in the gradient all-reduce, and DDP synchronises buffers
in every forward), so the option is turned off there with a warning.

The normal path costs nothing: the step's ``try`` is free in Python 3.11
when nothing is raised, and the only other work is keeping a reference to
each of the step's batches, so they can be redone.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

from pimm.utils.errors import ConfigError, UserError

__all__ = ["OOMBackoff", "split_by_leading_dim", "find_splitter"]

Splitter = Callable[[Any, int], list]


def split_by_leading_dim(batch, parts: int) -> list[tuple[dict, int]]:
    """Split a dict batch along the leading dimension that its tensors (and
    lists, tuples) share; 0-d tensors and other values go to every part.
    Weights are sample counts."""
    if not isinstance(batch, dict):
        raise ValueError(f"the default splitter takes dict batches, got {type(batch).__name__}")
    sizes = {key: len(value) for key, value in batch.items()
             if (isinstance(value, torch.Tensor) and value.ndim > 0) or isinstance(value, (list, tuple))}
    if not sizes:
        raise ValueError("the batch holds no tensor or list with a leading (batch) dimension")
    size = next(iter(sizes.values()))
    if any(n != size for n in sizes.values()):
        shown = ", ".join(f"{k}: {n}" for k, n in list(sizes.items())[:6])
        raise ValueError(f"its entries do not share a leading dimension ({shown}): a batch of variable-size "
                         "samples needs its own split_batch")
    bounds = torch.linspace(0, size, min(parts, size) + 1).round().long().tolist()
    out = []
    for start, end in zip(bounds, bounds[1:]):
        part = {key: value[start:end] if key in sizes else value for key, value in batch.items()}
        out.append((part, end - start))
    return out


def find_splitter(loader) -> Splitter:
    """The splitter for ``loader``'s batches (see the module docstring)."""
    collate = getattr(loader, "collate_fn", None)
    for owner in (collate, getattr(collate, "func", None), getattr(loader, "dataset", None)):
        split = getattr(owner, "split_batch", None) if owner is not None else None
        if callable(split):
            return split
    return split_by_leading_dim


class OOMBackoff:
    """See the module docstring. ``max_splits``: how often a batch may be
    halved (1: halves; 2: down to quarters; ...)."""

    def __init__(self, splitter: Splitter, max_splits: int = 1, logger=None):
        if isinstance(max_splits, bool) or not isinstance(max_splits, int) or not 1 <= max_splits <= 10:
            raise ConfigError(f"train.oom_backoff.max_splits={max_splits!r} is invalid: it takes an integer in 1..10 "
                              "(how often a batch may be halved)")
        self.splitter = splitter
        self.max_splits = max_splits
        self.logger = logger
        self.retried_steps = 0
        self._most_parts = 1

    @classmethod
    def from_option(cls, option, loader, world_size: int, logger) -> "OOMBackoff | None":
        """``train.oom_backoff``: None/False (off), True (defaults) or a dict of options."""
        if option is None or option is False:
            return None
        if option is True:
            option = {}
        if not isinstance(option, dict):
            raise ConfigError(f"train.oom_backoff={option!r} is invalid: it takes None, True or "
                              "dict(max_splits=N)")
        unknown = sorted(set(option) - {"max_splits"})
        if unknown:
            raise ConfigError(f"train.oom_backoff: unknown option(s) {unknown}; it takes max_splits")
        backoff = cls(find_splitter(loader), logger=logger, **option)
        if world_size > 1:
            logger.warning(f"train.oom_backoff is off: it works in single-process runs only (this run has "
                           f"{world_size} processes, which cannot redo a step on one rank alone)")
            return None
        return backoff

    # -- the retry ----------------------------------------------------------------
    def redo_step(self, trainer, batches: list, error: torch.OutOfMemoryError):
        """Redo the step whose micro-batches so far are ``batches`` (the last one
        failed with ``error``), split ever finer; fetch its remaining micro-batches.
        Returns ``(last batch, its outputs, the step's loss)`` as the plain step does."""
        step = trainer.global_step + 1
        reason = _release(error)
        trainer.optim_step.zero_grad()  # partial gradients of the failed attempt must not count
        _empty_cache()
        finest = 1
        for splits in range(1, self.max_splits + 1):
            parts = 2 ** splits
            try:
                pieces = [self._split(batch, parts) for batch in batches]
                if max(len(p) for p in pieces) <= finest:  # nothing left to split: one sample per part already
                    break
                finest = max(len(p) for p in pieces)
                self._report(step, parts)
                return self._run_split(trainer, batches, pieces, parts)
            except torch.OutOfMemoryError as err:
                reason = _release(err)
            trainer.optim_step.zero_grad()
            _empty_cache()
        tried = f"each batch split into up to {finest} parts" if finest > 1 else "batches of one sample"
        raise torch.OutOfMemoryError(
            f"out of memory at step {step} even with {tried} (train.oom_backoff.max_splits={self.max_splits}): "
            f"lower batch_size, raise max_splits or turn on gradient_checkpointing. Last error: {reason}"
        )

    def _split(self, batch, parts: int) -> list:
        try:
            pieces = self.splitter(batch, parts)
        except (ValueError, TypeError, KeyError) as err:
            name = getattr(self.splitter, "__qualname__", type(self.splitter).__name__)
            raise UserError(f"train.oom_backoff: {name} cannot split this batch ({err}); give the collate function "
                            "or the data set a split_batch(batch, parts) (docs/hooks-control.md)") from None
        if not pieces:
            raise UserError("train.oom_backoff: the splitter returned no parts")
        return pieces

    def _run_split(self, trainer, batches: list, split: list, parts: int):
        """The step over ``batches`` (split as ``split``), then its remaining micro-batches."""
        optim_step = trainer.optim_step
        accum = trainer.grad_accum_steps
        step_loss = None
        for micro in range(accum):
            if micro == len(batches):  # the OOM came before the step's last micro-batch was fetched
                batches.append(trainer.next_batch())
                split.append(self._split(batches[micro], parts))
            pieces = split[micro]
            total = float(sum(weight for _, weight in pieces))
            scalars: dict[str, torch.Tensor] = {}
            for index, (part, weight) in enumerate(pieces):
                share = weight / total / accum
                with optim_step.sync(last=micro == accum - 1 and index == len(pieces) - 1):
                    output = trainer.forward(part)
                    loss = output["loss"] * share
                    optim_step.backward(loss)
                step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
                for key, value in output.items():  # the batch's scalar outputs, as weighted means of the parts'
                    if isinstance(value, torch.Tensor) and value.ndim == 0:
                        scalars[key] = scalars.get(key, 0) + value.detach() * (weight / total)
        self.retried_steps += 1
        trainer.metrics.publish({"train/oom_retries": self.retried_steps}, step=trainer.global_step + 1)
        return part, {**output, **scalars}, step_loss

    def _report(self, step: int, parts: int) -> None:
        if self.logger is None:
            return
        message = (f"Out of memory at step {step}: redoing the step with each batch split into up to {parts} parts "
                   "(train.oom_backoff)")
        if parts > self._most_parts:
            self._most_parts = parts
            self.logger.warning(message)
        else:
            self.logger.info(message)


def _release(error: BaseException) -> str:
    """Free what the failed attempt holds (the locals of the frames in its
    traceback: activations, the graph) and return its first line."""
    traceback.clear_frames(error.__traceback__)
    return (str(error).splitlines() or [type(error).__name__])[0]


def _empty_cache() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
