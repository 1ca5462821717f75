""":func:`save_pretrained`: an export folder that loads anywhere pimm is installed.

An export folder holds:

* ``model.safetensors`` (or ``model.bin`` with ``safe_serialization=False``):
  the model's tensors;
* ``config.json``: the config (``model`` builds the model) as published:
  secrets and paths redacted, weight-loading keys null
  (:func:`pimm.export.configs.config_for_publishing`);
* ``README.md``: the model card (yours, or a generated one saying how to load it).

Everything is checked before anything is written: the destination (not a run
directory or checkpoint, not a file, no earlier export unless ``overwrite``),
the card, and that the weights fit the config (the model is built from the
published config and every tensor must match by name and shape). The files
are then written under temporary names and renamed into place, with your
umask's permissions.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from pimm.engines.state.manager import MANIFEST
from pimm.engines.state.weight_source import EXPORT_WEIGHT_NAMES, read_state_dict, resolve_weight_source
from pimm.export.checkpoint import clean_state_dict, misfit
from pimm.export.configs import (CONFIG_NAME, RUN_RECORDS, config_for_publishing, find_config, model_config_of,
                                 plain, read_config_file)
from pimm.export.loading import build_model, check_device
from pimm.utils.errors import CheckpointError, ConfigError, UserError
from pimm.utils.redaction import redact_secrets

__all__ = ["save_pretrained", "EXPORT_WEIGHTS", "EXPORT_CONFIG", "EXPORT_CARD", "EXPORT_FILES"]

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = CONFIG_NAME
EXPORT_CARD = "README.md"
#: Every file an export may hold; an overwrite replaces (or removes) them all.
EXPORT_FILES = (*EXPORT_WEIGHT_NAMES, EXPORT_CONFIG, "training_config.json", EXPORT_CARD)


def _run_or_checkpoint(folder: Path) -> str | None:
    """What ``folder`` holds that an export must never land in, or None."""
    for parent in (folder, *folder.parents):
        if (parent / MANIFEST).is_file():
            return f"inside the checkpoint {parent}"
    if (folder / "config.py").is_file() or any((folder / name).is_file() for name in RUN_RECORDS):
        return "a run directory"
    if (folder / "checkpoints").is_dir() or any((folder / "model").glob("*.pth")):
        return "a run directory (it holds checkpoints/ or model/*.pth)"
    if (folder / "model_best.pth").is_file() or (folder / "model_last.pth").is_file():
        return "a run's model/ folder"
    return None


def _destination(save_directory: Any, overwrite: bool, source_folder: Path | None) -> Path:
    if save_directory is None or not os.fspath(save_directory).strip():
        raise UserError("save_pretrained: the export folder is empty (''); give the folder to write, e.g. "
                        "exports/my-model")
    out = Path(os.path.expanduser(os.fspath(save_directory)))
    if out.exists() and not out.is_dir():
        raise UserError(f"save_pretrained: {out} is a file, not a folder; give a new or empty folder for the export")
    if source_folder is not None and out.exists() and out.resolve() == source_folder.resolve():
        raise UserError(f"save_pretrained: {out} is where the weights come from; an export there would shadow its "
                        "own weights for from_pretrained and weight=: choose another folder")
    why = _run_or_checkpoint(out) if out.is_dir() else None
    if why:
        raise UserError(f"save_pretrained: {out} is {why}; an export there would shadow the run's own weights for "
                        "from_pretrained and weight=: choose another folder")
    present = [name for name in EXPORT_FILES if (out / name).exists()]
    if present and not overwrite:
        raise UserError(f"save_pretrained: {out} already holds {', '.join(present)}; choose another folder or pass "
                        "overwrite=True")
    return out


def _state_of(model_or_checkpoint: Any) -> tuple[dict, Path | None, str]:
    """The state dict to export, the folder its config may be in, and what it is."""
    if isinstance(model_or_checkpoint, torch.nn.Module):
        module = getattr(model_or_checkpoint, "module", model_or_checkpoint)
        return module.state_dict(), None, type(module).__name__
    if isinstance(model_or_checkpoint, Mapping):
        model_state = model_or_checkpoint.get("model")
        if isinstance(model_state, Mapping) and isinstance(model_state.get("state_dict"), Mapping):
            return dict(model_state["state_dict"]), None, "a checkpoint dict"
        for key in ("state_dict", "model"):
            if isinstance(model_or_checkpoint.get(key), Mapping):
                return dict(model_or_checkpoint[key]), None, "a checkpoint dict"
        return dict(model_or_checkpoint), None, "a state dict"
    if isinstance(model_or_checkpoint, (str, os.PathLike)):
        source = resolve_weight_source(model_or_checkpoint)
        return read_state_dict(source), source.folder, str(source.path)
    raise UserError(f"save_pretrained: expected a model, a checkpoint dict or a path, got "
                    f"{type(model_or_checkpoint).__name__}")


def _tensors(state: Mapping) -> dict:
    """Plain, contiguous CPU tensors, none sharing memory (safetensors refuses
    shared storage), wrapper prefixes removed."""
    out, seen = {}, set()
    for key, value in clean_state_dict(state).items():
        if not isinstance(value, torch.Tensor):
            continue  # an _extra_state object: not a tensor, not exportable
        tensor = value.detach().to("cpu")
        storage = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        clone = storage in seen or not tensor.is_contiguous()
        seen.add(storage)
        out[key] = tensor.contiguous().clone() if clone else tensor
    return out


def _check_fit(config: dict, tensors: dict, what: str) -> dict:
    """The model config of ``config``, after checking that a model built from it
    takes ``tensors`` strictly (names and shapes): the export must load."""
    model_cfg = model_config_of(config, f"save_pretrained({what!r}): the config")
    if "type" not in model_cfg:
        raise ConfigError(f"save_pretrained({what!r}): the config's model entry has no 'type'")
    try:
        with torch.device("meta"):  # the shapes without the memory
            model = build_model(model_cfg, None, config, f"save_pretrained({what!r})")
    except UserError:
        raise
    except Exception:  # a constructor that needs real tensors (an .item(), a data-dependent init)
        model = build_model(model_cfg, None, config, f"save_pretrained({what!r})")
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    problem, _, _ = misfit(own, tensors, strict=True)
    if problem:
        raise CheckpointError(f"save_pretrained({what!r}): the weights do not fit the config's model "
                              f"{model_cfg['type']} ({problem}); nothing was written: give the config the weights "
                              "were trained with (cfg=, config_path=)")
    return model_cfg


def _default_card(model_cfg: dict | None, tensors: dict, what: str) -> str:
    count = sum(v.numel() for v in tensors.values())
    kind = (model_cfg or {}).get("type", "a pimm model")
    source = Path(what).name if os.sep in what else what
    config_line = (f"its config in `{EXPORT_CONFIG}` (secrets and paths redacted)" if model_cfg is not None else
                   f"no config (pass `model_config=dict(type=...)` to `from_pretrained`)")
    return (f"# {kind}\n\nA model exported with pimm from {source}: {count:,} weights in the weight file, "
            f"{config_line}.\n\n```python\nimport pimm\n\nmodel = pimm.from_pretrained(\"path/to/this/folder\")"
            "  # or \"org/name\" on the Hugging Face Hub\n```\n")


def _serialize(tensors: dict, safe_serialization: bool) -> bytes:
    if safe_serialization:
        try:
            from safetensors.torch import save
        except ImportError:
            raise UserError("save_pretrained needs the safetensors package: pip install safetensors (or "
                            "safe_serialization=False)") from None
        return save(tensors, metadata={"format": "pt", "exported_by": "pimm"})
    buffer = io.BytesIO()
    torch.save(tensors, buffer)  # a dict of tensors: loads with weights_only=True
    return buffer.getvalue()


def _write(out: Path, files: dict[str, bytes], overwrite: bool) -> None:
    """Write ``files`` under temporary names, then rename them into place (new
    files get the umask's permissions); with ``overwrite`` the other files of an
    earlier export go too, so nothing stale outranks the new weights."""
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"save_pretrained: cannot create {out} ({err.strerror or err}); choose a writable "
                        "folder") from None
    staged = []
    try:
        for name, data in files.items():
            temporary = out / f".{name}.pimm-partial"
            temporary.unlink(missing_ok=True)
            with open(temporary, "xb") as handle:
                staged.append(temporary)
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
    except OSError as err:
        for temporary in staged:
            temporary.unlink(missing_ok=True)
        if created:
            out.rmdir()
        raise UserError(f"save_pretrained: cannot write into {out} ({err.strerror or err}); nothing was "
                        "exported") from None
    for name in files:
        os.replace(out / f".{name}.pimm-partial", out / name)
    if overwrite:
        for name in EXPORT_FILES:
            if name not in files and (out / name).is_file():
                (out / name).unlink()


def save_pretrained(model_or_checkpoint: Any, save_directory: str | os.PathLike, *, cfg: Any = None,
                    config_path: str | os.PathLike | None = None, training_config: Mapping | None = None,
                    safe_serialization: bool = True, device: str | torch.device = "cpu",
                    model_card: str | None = None, overwrite: bool = False) -> Path:
    """Write an export folder (module docstring) and return its path.

    ``model_or_checkpoint``: an ``nn.Module``, a checkpoint or state dict, or
    any weight source (a run directory exports its ``model_best.pth``, else
    ``model_last.pth``). The config is ``training_config``, else ``cfg``, else
    ``config_path`` (a ``.py`` file is run: you named it), else the JSON config
    beside the weights (a run's ``resolved_config.json``; never a ``config.py``).
    ``safe_serialization=False`` writes ``model.bin`` (a torch file of plain
    tensors) instead of ``model.safetensors``. ``device``: upstream's argument
    (where tensors are consolidated); pimm consolidates on the CPU and only
    checks that the device exists. ``model_card``: the ``README.md`` text
    (secrets in it are redacted). An earlier export in the folder is replaced
    only with ``overwrite=True``."""
    check_device(device, "save_pretrained")
    if model_card is not None and not isinstance(model_card, str):
        raise UserError(f"save_pretrained: model_card must be the card's text (str), got {type(model_card).__name__}")
    _destination(save_directory, overwrite, None)  # before reading anything large
    state, folder, what = _state_of(model_or_checkpoint)
    out = _destination(save_directory, overwrite, folder)
    if training_config is not None:
        config = plain(dict(training_config))
    elif cfg is not None:
        config = plain(cfg)
    elif config_path is not None:
        config = read_config_file(config_path)
    else:
        found = find_config(folder)
        config = found[0] if found is not None else None
    tensors = _tensors(state)
    if not tensors:
        raise CheckpointError(f"save_pretrained: {what} holds no tensors to export")
    model_cfg = None
    files: dict[str, bytes] = {}
    if config is not None:
        if not isinstance(config, dict):
            raise ConfigError(f"save_pretrained: the config must be a dict, got {type(config).__name__}")
        config = config_for_publishing(config)
        model_cfg = _check_fit(config, tensors, what)
        files[EXPORT_CONFIG] = (json.dumps(config, indent=2, default=str) + "\n").encode("utf-8")
    card = redact_secrets(model_card) if model_card is not None else _default_card(model_cfg, tensors, what)
    files[EXPORT_CARD] = card.encode("utf-8")
    files = {EXPORT_WEIGHT_NAMES[0 if safe_serialization else 1]: _serialize(tensors, safe_serialization), **files}
    _write(out, files, overwrite)
    return out
