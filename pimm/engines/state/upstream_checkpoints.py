"""Upstream pimm's checkpoint helpers (``pimm.utils.checkpoints``, an import
alias of this module: :mod:`pimm.utils.module_aliases`), with upstream's names
and signatures over pimm's own weight reading and saving.

What differs, on purpose: every ``.pth`` is read as data
(``torch.load(weights_only=True)``, :mod:`pimm.engines.state.safe_load`),
never with the full unpickler upstream's ``load_weight_state`` uses; a file
is saved through a temporary file and renamed into place, without
upstream's ``.prev`` copy. Upstream's trainer-bound ``CheckpointManager``
and its W&B-resume helpers are not here: pimm's checkpoints are written and
resumed by the trainer itself (:mod:`pimm.engines.state.manager`, docs/checkpoints.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from pimm.engines.state.manager import atomic_torch_save
from pimm.engines.state.safe_load import load_state_file
from pimm.engines.state.weight_source import EXPORT_WEIGHT_NAMES, HF_SCHEME, parse_hf_uri as _parse_hf_uri
from pimm.engines.state.weight_source import resolve_weight_source
from pimm.utils.errors import CheckpointError

__all__ = ["HF_URI_PREFIX", "EXPORT_WEIGHT_NAMES", "is_remote_weight", "parse_hf_uri", "resolve_remote_weight",
           "exported_weights_file", "load_weight_state", "checkpoint_model_state_dict", "atomic_torch_save",
           "save_model_weights_file"]

HF_URI_PREFIX = HF_SCHEME


def is_remote_weight(uri: Any) -> bool:
    """Whether ``uri`` names a Hugging Face Hub model (``hf://...``)."""
    return isinstance(uri, str) and uri.startswith(HF_URI_PREFIX)


def parse_hf_uri(uri: str) -> tuple[str, str | None, str]:
    """``hf://org/name[@revision][/file]`` -> ``(org/name, revision or None, file or "")``."""
    if not is_remote_weight(uri):
        raise ValueError(f"{uri!r} is not an hf:// reference")
    repo, revision, filename = _parse_hf_uri(uri)
    return repo, revision, filename or ""


def resolve_remote_weight(uri: Any) -> Any:
    """The local path of the weights ``hf://...`` names (fetched into the
    Hugging Face cache when not there); anything else is returned as it is."""
    if not is_remote_weight(uri):
        return uri
    return str(resolve_weight_source(uri).path)


def exported_weights_file(path: str | os.PathLike) -> str | None:
    """The weight file of an export folder (``model.safetensors``, else ``model.bin``), or None."""
    for name in EXPORT_WEIGHT_NAMES:
        candidate = Path(path) / name
        if candidate.is_file():
            return str(candidate)
    return None


def _on(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return type(obj)((k, _on(v, device)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on(v, device) for v in obj)
    return obj


def load_weight_state(path: str | os.PathLike, map_location: Any) -> Any:
    """What a weight file holds (a ``.safetensors`` file's tensors, or the
    object a ``.pth`` holds, read as data), its tensors on ``map_location``
    (a device or device name; anything else, such as torch's callable form, keeps them on the CPU)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise CheckpointError(f"{path}: reading .safetensors needs the safetensors package "
                                  "(pip install safetensors)") from None
        state = load_file(str(path), device="cpu")
    else:
        state = load_state_file(path)
    if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
        state = _on(state, torch.device(map_location))
    return state


def checkpoint_model_state_dict(checkpoint: Any) -> Any:
    """The model weights inside a loaded checkpoint: ``checkpoint["model"]["state_dict"]``
    (upstream's layout), ``checkpoint["model"]`` (pimm's ``common.pth``),
    ``checkpoint["state_dict"]`` (a model file); else the checkpoint itself (a bare state dict)."""
    if isinstance(checkpoint, dict):
        model = checkpoint.get("model")
        if isinstance(model, dict) and isinstance(model.get("state_dict"), dict):
            return model["state_dict"]
        if isinstance(model, dict) and model and all(isinstance(v, torch.Tensor) for v in model.values()):
            return model
        if isinstance(checkpoint.get("state_dict"), dict):
            return checkpoint["state_dict"]
    return checkpoint


def save_model_weights_file(payload: Any, filename: str | os.PathLike) -> None:
    """Write the model weights of ``payload`` (see :func:`checkpoint_model_state_dict`)
    as a model file, ``{"state_dict": ...}``, which ``weight=`` and ``torch.load`` read."""
    atomic_torch_save({"state_dict": checkpoint_model_state_dict(payload)}, filename)
