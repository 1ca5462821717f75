"""State dicts out of weight files, and the reshaping an export or a warm start
needs (upstream pimm's ``pimm.export.checkpoint`` functions, with their names,
arguments and meaning).

Every file is read as data (``torch.load(weights_only=True)``, safetensors):
the ``weights_only`` argument of upstream's signatures is accepted and changes
nothing, because a weight file never runs code here (docs/security.md).
Problems are one :class:`~pimm.utils.errors.CheckpointError` line naming the
file, never torch's multi-line ``load_state_dict`` report.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping

import torch

from pimm.engines.state.weight_file import strip_wrapper_prefixes
from pimm.engines.state.weight_source import read_state_dict, resolve_weight_source
from pimm.utils.errors import CheckpointError

__all__ = ["clean_state_dict", "filter_state_dict_by_prefix", "remap_state_dict_keys",
           "load_state_dict_from_checkpoint", "load_checkpoint_metadata", "load_pretrained", "misfit"]

_logger = logging.getLogger(__name__)

#: Entries of a training checkpoint that are states, not metadata.
_STATE_KEYS = ("state_dict", "state_dict_ema", "model_ema", "model", "optimizer", "scheduler", "scaler")


def clean_state_dict(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` without the ``module.`` (DDP) and ``_orig_mod.``
    (``torch.compile``) prefixes of a wrapped model's keys."""
    return {strip_wrapper_prefixes(key): value for key, value in state_dict.items()}


def filter_state_dict_by_prefix(state_dict: Mapping[str, Any], prefix: str, remove_prefix: bool = True) -> dict:
    """The entries whose key starts with ``prefix`` (the prefix removed unless
    ``remove_prefix=False``)."""
    return {(key[len(prefix):] if remove_prefix else key): value for key, value in state_dict.items()
            if key.startswith(prefix)}


def remap_state_dict_keys(state_dict: Mapping[str, Any], key_mapping: Mapping[str, str], *,
                          keep_unmapped: bool = True) -> dict:
    """Keys renamed by ``key_mapping``: an exact key match first, else the first
    mapping entry (in its order) whose source is a prefix of the key; keys no
    entry matches are kept unless ``keep_unmapped=False``."""
    out = {}
    for key, value in state_dict.items():
        if key in key_mapping:
            out[key_mapping[key]] = value
            continue
        source = next((s for s in key_mapping if s and key.startswith(s)), None)
        if source is not None:
            out[key_mapping[source] + key[len(source):]] = value
        elif keep_unmapped:
            out[key] = value
    return out


def _on(state: dict, device: str | torch.device | None) -> dict:
    if device is None or torch.device(device).type == "cpu":
        return state
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def load_state_dict_from_checkpoint(checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu",
                                    weights_only: bool = False) -> dict:
    """The model state dict in ``checkpoint_path`` (a bare state dict, or one
    under ``state_dict`` / ``model``; a ``.safetensors`` file; or any other
    weight source ``weight=`` takes), wrapper prefixes removed, on ``device``."""
    del weights_only  # always read as data (module docstring)
    return _on(clean_state_dict(read_state_dict(resolve_weight_source(checkpoint_path))), device)


def load_checkpoint_metadata(checkpoint_path: str | os.PathLike, device: str | torch.device = "cpu",
                             weights_only: bool = False) -> dict:
    """Everything in a ``.pth`` checkpoint except its states (``epoch``,
    ``global_step``, ``metric``, ...); ``{}`` for a ``.safetensors`` file or a
    file that is a bare state dict."""
    del weights_only, device
    from pimm.engines.state.safe_load import UnsafeCheckpointError, load_state_file

    path = os.fspath(checkpoint_path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    if path.endswith(".safetensors"):
        return {}
    try:
        payload = load_state_file(path)
    except UnsafeCheckpointError as err:
        raise CheckpointError(f"{path} refused: it refers to {err.global_name}, and a checkpoint may hold only "
                              "data; nothing in it was loaded or run") from None
    except Exception as err:  # a damaged or foreign file
        raise CheckpointError(f"{path} cannot be read as a torch checkpoint ({type(err).__name__}: "
                              f"{str(err).splitlines()[0] if str(err) else ''})") from None
    if not isinstance(payload, dict):
        return {}
    return {key: value for key, value in payload.items() if key not in _STATE_KEYS}


def _short(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def misfit(own: Mapping[str, Any], state: Mapping[str, Any], strict: bool) -> tuple[str | None, list, list]:
    """How ``state`` fails to fit a model whose state dict is ``own``: a
    description (None when it fits), the model's keys missing from ``state``
    and the keys of ``state`` the model does not have. Shapes must always
    agree; ``strict`` also forbids missing and left-over keys."""
    missing = [key for key in own if key not in state]
    unexpected = [key for key in state if key not in own]
    shapes = [f"{key} {tuple(value.shape)} vs model {tuple(own[key].shape)}" for key, value in state.items()
              if key in own and hasattr(value, "shape") and hasattr(own[key], "shape")
              and tuple(own[key].shape) != tuple(value.shape)]
    parts = ([f"not in the weights: {_short(missing)}"] if strict and missing else []) + \
            ([f"not in the model: {_short(unexpected)}"] if strict and unexpected else []) + \
            ([f"shape mismatch: {_short(shapes)}"] if shapes else [])
    if not parts and state and not any(key in own for key in state):
        parts = [f"no weight name fits (weights look like {list(state)[:3]}, the model's like {list(own)[:3]})"]
    return ("; ".join(parts) or None), missing, unexpected


def load_pretrained(model: torch.nn.Module, checkpoint_path: str | os.PathLike, prefix: str | None = None,
                    remove_prefix: bool = True, key_mapping: Mapping[str, str] | None = None, strict: bool = True,
                    device: str | torch.device = "cpu",
                    filter_fn: Callable[[dict, torch.nn.Module], dict] | None = None):
    """Load the weights of ``checkpoint_path`` into ``model``: ``prefix``
    selects (and removes, unless ``remove_prefix=False``) a part of them,
    ``key_mapping`` renames (:func:`remap_state_dict_keys`, unmapped keys kept),
    ``filter_fn(state_dict, model)`` has the last word. Returns the missing and
    unexpected keys (``torch``'s named tuple) when ``strict=False``, else None;
    a prefix nothing starts with is a warning and loads nothing (upstream's
    behaviour)."""
    state = load_state_dict_from_checkpoint(checkpoint_path, device=device)
    if prefix is not None:
        state = filter_state_dict_by_prefix(state, prefix, remove_prefix)
        if not state:
            _logger.warning(f"load_pretrained: no key of {checkpoint_path} starts with prefix {prefix!r}; nothing "
                            "was loaded")
            return None
    if key_mapping is not None:
        state = remap_state_dict_keys(state, key_mapping)
    if filter_fn is not None:
        state = filter_fn(state, model)
    problem, _, _ = misfit(model.state_dict(), state, strict)
    if problem:
        raise CheckpointError(f"load_pretrained({os.fspath(checkpoint_path)!r}): the weights do not fit "
                              f"{type(model).__name__} ({problem})")
    incompatible = model.load_state_dict(state, strict=strict)
    if strict:
        return None
    for name, keys in (("missing", incompatible.missing_keys), ("unexpected", incompatible.unexpected_keys)):
        if keys:
            _logger.warning(f"load_pretrained: {len(keys)} {name} keys: {_short(list(keys), 5)}")
    return incompatible
