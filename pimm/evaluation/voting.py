"""Test-time voting: scoring a model on every original point of a test event
from its fragments (``test_mode=True`` data sets, :mod:`pimm.datasets.fragments`).

A batch of test items (``{"test_events": [...]}``) is turned into the
full-resolution batch and output an evaluator scores as if the model had seen
each event whole:

* **semantic classes** -- every fragment's logits become class probabilities
  (softmax) that are added to the transformed rows it holds (``index``); the
  mean over the fragments and augmentations that held a row is its vote, and
  every original point takes the vote of its row (``inverse``);
* **instances** -- instance ids of different fragments are unrelated, so each
  fragment's instances are matched to the instances voted so far by their
  overlap on shared rows (a fragment instance joins the voted instance that
  holds most of its shared rows, when that is more than half of them; else
  it is a new one); every row then takes the instance most fragments gave
  it, and every original point its row's instance.

The scored batch holds ``coord`` (the original points), every ``origin_<key>``
of the item under ``<key>`` (``segment``, ``instance``, ...), and ``offset``.
A transformed row no fragment held (a ``crop`` that leaves points out) gets
uniform probabilities and no instance; a warning counts them.

:class:`FragmentVoting` is the evaluator mixin that does this in
:meth:`~pimm.engines.hooks.evaluator.EvaluatorBase.forward_batch`; batches
that are not test items pass through unchanged.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from pimm.utils.errors import ConfigError

__all__ = ["FragmentVoting", "vote_test_batch", "InstanceVotes", "is_test_batch"]

logger = logging.getLogger("pimm")

_ALT_LOGITS = {"seg_logits": "sem_logits"}  # upstream models may name the semantic logits so


def is_test_batch(batch) -> bool:
    """Whether ``batch`` is a collated batch of test items."""
    return isinstance(batch, dict) and "test_events" in batch


class InstanceVotes:
    """Instance ids voted over the fragments of one event of ``rows`` transformed rows."""

    def __init__(self, rows: int):
        self.rows = rows
        self.next_id = 0
        self._votes: list[np.ndarray] = []  # (k, 2) arrays of (row, voted id)

    def labels(self) -> np.ndarray:
        """Each row's most voted instance (the first voted on a tie), -1 if none."""
        out = np.full(self.rows, -1, dtype=np.int64)
        if not self._votes:
            return out
        votes = np.concatenate(self._votes)
        pairs, counts = np.unique(votes[:, 0] * max(self.next_id, 1) + votes[:, 1], return_counts=True)
        row, vid = pairs // max(self.next_id, 1), pairs % max(self.next_id, 1)
        order = np.lexsort((vid, -counts, row))  # per row: most votes first, then the smallest (earliest) id
        first = np.r_[True, row[order][1:] != row[order][:-1]]
        out[row[order][first]] = vid[order][first]
        return out

    def add(self, rows: np.ndarray, ids: np.ndarray) -> None:
        """One fragment's instance ids (-1: unassigned) on the transformed ``rows`` it holds."""
        rows, ids = np.asarray(rows, dtype=np.int64), np.asarray(ids, dtype=np.int64)
        valid = ids >= 0
        rows, ids = rows[valid], ids[valid]
        if not len(ids):
            return
        frag_ids, local = np.unique(ids, return_inverse=True)
        mapped = np.full(len(frag_ids), -1, dtype=np.int64)
        current = self.labels()[rows] if self._votes else np.full(len(rows), -1)
        shared = current >= 0
        if shared.any():
            width = int(current.max()) + 1
            pairs, counts = np.unique(local[shared] * width + current[shared], return_counts=True)
            frag, voted = pairs // width, pairs % width
            on_shared = np.bincount(local[shared], minlength=len(frag_ids))
            order = np.lexsort((voted, -counts, frag))
            best = np.r_[True, frag[order][1:] != frag[order][:-1]]
            for f, v, c in zip(frag[order][best], voted[order][best], counts[order][best]):
                if 2 * c > on_shared[f]:
                    mapped[f] = v
        new = mapped < 0
        mapped[new] = self.next_id + np.arange(int(new.sum()))
        self.next_id += int(new.sum())
        self._votes.append(np.stack([rows, mapped[local]], axis=1))


def _logits(output: dict, key: str) -> torch.Tensor | None:
    if key in output:
        return output[key]
    alt = _ALT_LOGITS.get(key)
    return output.get(alt) if alt else None


@torch.no_grad()
def vote_test_batch(batch: dict, model: torch.nn.Module, trainer, logits_key: str | None,
                    instance_key: str | None = None, logits_required: bool = True) -> tuple[dict, dict]:
    """``(input, output)`` on the original points of every event of a test
    batch (see the module doc): ``output[logits_key]`` the voted class
    probabilities, ``output[instance_key]`` the voted instance ids. A model
    output without ``logits_key`` is a KeyError when ``logits_required``."""
    inputs, outputs, uncovered = [], [], 0
    for event in batch["test_events"]:
        rows = int(event["transformed_points"])
        probs = count = None
        instances = InstanceVotes(rows) if instance_key else None
        for chunk in event["fragments"]:
            chunk = trainer.to_device(chunk)
            with trainer.autocast():
                out = model(chunk)
            if "index" not in chunk:
                raise ConfigError("a test fragment has no 'index' after test_cfg.post_transform; keep it "
                                  "(Collect(keys=(..., 'index')))")
            index = chunk["index"].reshape(-1).long()
            logits = _logits(out, logits_key) if logits_key else None
            if logits is None and logits_key and logits_required:
                raise KeyError(f"the model output has no {logits_key!r} to vote on (keys: {sorted(out)}); "
                               "set the evaluator's logits_key")
            if logits is not None:
                if logits.dim() != 2 or len(logits) != len(index):
                    raise ValueError(f"{logits_key!r} has shape {tuple(logits.shape)} for a fragment batch of "
                                     f"{len(index)} points")
                if probs is None:
                    probs = torch.zeros(rows, logits.shape[1], dtype=torch.float64, device=logits.device)
                    count = torch.zeros(rows, dtype=torch.float64, device=logits.device)
                index = index.to(logits.device)
                probs.index_add_(0, index, torch.softmax(logits.double(), dim=1))
                count.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
            if instances is not None:
                if instance_key not in out:
                    raise KeyError(f"the model output has no {instance_key!r} to vote on (keys: {sorted(out)}); "
                                   "set the evaluator's pred_key")
                ends = chunk["offset"].reshape(-1).tolist()
                ids, held = out[instance_key].reshape(-1).cpu().numpy(), index.cpu().numpy()
                for start, end in zip([0] + ends[:-1], ends):  # each fragment votes on its own
                    instances.add(held[start:end], ids[start:end])
        inverse = event["inverse"].reshape(-1).long()
        full_in = {key[len("origin_"):]: value for key, value in event.items() if key.startswith("origin_")}
        full_out = {}
        if probs is not None:
            missing = count == 0
            uncovered += int(missing.sum())
            probs[missing] = 1.0 / probs.shape[1]
            count[missing] = 1.0
            full_out[logits_key] = (probs / count[:, None]).float()[inverse.to(probs.device)]
        if instances is not None:
            full_out[instance_key] = torch.from_numpy(instances.labels())[inverse]
        inputs.append(full_in)
        outputs.append(full_out)
    if uncovered:
        logger.warning(f"test voting: {uncovered} transformed points were in no fragment (test_cfg.crop?); "
                       "they are scored with uniform class probabilities")
    joined = _join(inputs, trainer)
    joined["offset"] = trainer.to_device(torch.cumsum(torch.tensor([len(e["coord"]) for e in inputs]), dim=0))
    return joined, _join(outputs, trainer)


def _join(parts: list[dict], trainer) -> dict:
    """Concatenate per-event dicts of per-point tensors."""
    out = {}
    for key in parts[0]:
        values = [p[key] for p in parts]
        if all(isinstance(v, torch.Tensor) and v.dim() >= 1 for v in values):
            out[key] = torch.cat([torch.as_tensor(v) for v in values])
        else:
            out[key] = values
    return trainer.to_device(out)


class FragmentVoting:
    """Evaluator mixin: batches of test items are voted (see the module doc)
    before ``process`` sees them. ``vote_keys()`` names the output keys:
    ``(logits_key, instance_key)``, either may be None; ``logits_required``:
    whether a model output without the logits is an error."""

    logits_required = True

    def vote_keys(self) -> tuple[str | None, str | None]:
        return getattr(self, "logits_key", None), None

    def forward_batch(self, batch, model):
        if not is_test_batch(batch):
            return super().forward_batch(batch, model)
        logits_key, instance_key = self.vote_keys()
        return vote_test_batch(batch, model, self.trainer, logits_key, instance_key, self.logits_required)
