"""Model weight files: reading them into a model, and writing ``model/*.pth``.

Two reading modes, for two jobs:

* ``strict=True`` (``tools/test.py``): every model tensor must come from the
  file with its shape; anything missing or mismatched is a
  :class:`~pimm.utils.errors.CheckpointError` listing them, because scoring a
  partly loaded model and crediting the score to the file would be a lie.
* ``strict=False`` (warm start, ``weight=`` in training): copy what matches,
  report how many tensors loaded and which were skipped, and fail only when
  nothing matches.

A model file (``model_last.pth``, ``model_best.pth``) is a plain dict that
loads with ``torch.load(path, weights_only=True)`` without pimm: the weights
under ``state_dict`` (no ``module.`` prefix), ``epoch``, ``global_step`` and,
for the best, ``metric`` / ``metric_name``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pimm.engines.state.renamed_weights import upgrade_model_state
from pimm.engines.state.weight_file import read_weights, strip_wrapper_prefixes
from pimm.engines.state.weight_source import read_state_dict, resolve_weight_source
from pimm.utils import comm
from pimm.utils.errors import CheckpointError

__all__ = ["load_weights", "read_weights", "strip_wrapper_prefixes"]

def _short(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def load_weights(model: torch.nn.Module, path: str | Path, key_map: list | tuple = (), logger=None,
                 strict: bool = False, allow_unexpected: bool = True) -> dict:
    """Copy tensors from ``path`` into ``model``; returns a report
    ``{"loaded", "missing", "unexpected", "mismatched"}``.

    ``key_map`` is a list of ``(old_prefix, new_prefix)`` pairs applied to the
    file's keys (the ``module.`` prefix of DDP and the ``_orig_mod.`` prefix
    of a ``torch.compile`` wrapper, as saved by other tools, are always stripped).
    ``strict`` with ``allow_unexpected=False`` also refuses file tensors the
    model has no place for (``CheckpointLoader(strict=True)``: every tensor used).
    ``path`` is any form :mod:`pimm.engines.state.weight_source` resolves (a
    .pth or .safetensors file, a run, checkpoint or export folder, hf://...)."""
    state = read_state_dict(resolve_weight_source(path))
    path = str(path)
    renamed = {}
    for key, tensor in state.items():
        key = strip_wrapper_prefixes(key)
        for old, new in key_map:
            if key.startswith(old):
                key = new + key[len(old):]
                break
        renamed[key] = tensor
    renamed, _ = upgrade_model_state(model, renamed)  # a file in the model's older parameter names
    own = model.state_dict()
    mismatched = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in renamed.items()
                  if k in own and own[k].shape != v.shape]
    mismatched_keys = {m.split(" ")[0] for m in mismatched}
    usable = {k: v for k, v in renamed.items() if k in own and k not in mismatched_keys}
    missing = [k for k in own if k not in usable]
    unexpected = [k for k in renamed if k not in own]
    name = type(model).__name__
    left_over = [] if allow_unexpected else unexpected
    if strict and (missing or mismatched or left_over):
        absent = [k for k in missing if k not in mismatched_keys]
        parts = ([f"not in the file: {_short(absent)}"] if absent else []) + \
                ([f"shape mismatch: {_short(mismatched)}"] if mismatched else []) + \
                ([f"not in the model: {_short(left_over)}"] if left_over else [])
        hint = ("evaluate it with the config it was trained with" if allow_unexpected else
                "rename keys with CheckpointLoader(keywords=..., replacement=...) or load with strict=False")
        raise CheckpointError(f"weight={str(path)!r} does not fit {name} ({'; '.join(parts)}); {hint}")
    if not usable:
        raise CheckpointError(
            f"weight={str(path)!r} shares no parameter with {name} (file keys look like {list(renamed)[:3]}, "
            f"model keys like {list(own)[:3]}); set key_map on CheckpointLoader to rename prefixes"
        )
    if any(hasattr(v, "full_tensor") for v in own.values()):  # FSDP: each rank keeps its shard of the file's tensors
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, usable, options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        model.load_state_dict(usable, strict=False)
    if logger is not None and comm.is_main_process():
        logger.info(f"Loaded {len(usable)}/{len(own)} model tensors from {path}")
        if missing:
            logger.warning(f"Kept at initialisation (not loaded): {_short(missing)}")
        if unexpected:
            logger.warning(f"In the file but not in the model (ignored): {_short(unexpected)}")
        if mismatched:
            logger.warning(f"Shape-mismatched (skipped): {_short(mismatched)}")
    return {"loaded": len(usable), "missing": missing, "unexpected": unexpected, "mismatched": mismatched}
