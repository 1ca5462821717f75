"""Models that travel: :func:`save_pretrained` writes a self-describing export
folder, :func:`from_pretrained` builds a model from one (or from any other
weight source) in evaluation mode.

An export folder holds:

* ``model.safetensors``: the model's state dict (no pickle, no pimm needed to read);
* ``config.json``: the training config (``model`` is what builds the model),
  with every absolute path redacted (``"<redacted>"``) and the keys that would
  load other weights (``weight``, ``resume``, ``pretrained``...) set to null;
* ``README.md``: a model card (yours, or a generated one saying how to load it).

:func:`from_pretrained` takes every form of :mod:`pimm.engines.state.weight_source`
(a ``.pth`` / ``.safetensors`` file, an export folder, a run directory, a
checkpoint folder, ``hf://org/name[@rev][/file]``) and finds the model config
beside the weights (``config.json``, ``model_config.json``,
``resolved_config.json`` or a run's ``config.py``) unless given one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from pimm.engines.registries import MODELS
from pimm.engines.state.weight_source import read_state_dict, resolve_weight_source
from pimm.engines.state.weight_file import strip_wrapper_prefixes
from pimm.utils.config_dict import to_plain
from pimm.utils.errors import CheckpointError, ConfigError, UserError

__all__ = ["from_pretrained", "save_pretrained", "EXPORT_WEIGHTS", "EXPORT_CONFIG", "EXPORT_CARD"]

EXPORT_WEIGHTS = "model.safetensors"
EXPORT_CONFIG = "config.json"
EXPORT_CARD = "README.md"
#: Files that hold a config beside weights, in the order they are looked for.
CONFIG_FILES = ("config.json", "config.py", "resolved_config.json", "model_config.json", "training_config.json")
#: Keys whose value would load weights when a model is rebuilt: nulled in an export.
_LOAD_KEYS = frozenset({"weight", "resume", "pretrained", "load_from", "ckpt", "ckpt_path", "checkpoint",
                        "init_cfg"})
REDACTED = "<redacted>"


# -- configs ----------------------------------------------------------------
def _plain(value: Any) -> Any:
    value = to_plain(value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def redact_config(value: Any, key: str | None = None) -> Any:
    """``value`` with absolute paths (and ``~/...``) replaced by ``"<redacted>"``
    and weight-loading keys nulled, so a published config leaks no site layout
    and a rebuilt model loads nothing else."""
    if isinstance(value, str):
        if key in _LOAD_KEYS and (value.startswith(("/", "~", "hf://")) or os.path.isabs(value)):
            return None
        return REDACTED if value.startswith(("/", "~")) or os.path.isabs(value) else value
    if isinstance(value, dict):
        return {k: (None if k in _LOAD_KEYS and v is True else redact_config(v, k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_config(v) for v in value]
    return value


def _read_config_file(path: Path) -> dict:
    if path.suffix == ".py":
        from pimm.utils.config import Config

        return _plain(Config.fromfile(path))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    _import_custom(data, path)
    return data


def _import_custom(config: dict, source: Path) -> None:
    """Import the ``custom_imports`` a JSON config names (a .py config does it itself)."""
    from pimm.utils.config_imports import IMPORTS_KEY, as_names, import_modules

    if config.get(IMPORTS_KEY):
        import_modules(as_names(config[IMPORTS_KEY], IMPORTS_KEY, str(source)), str(source))


def _model_config(config: Mapping, source: str) -> dict:
    """The ``model`` entry of a full config, or the config itself when it is a model's."""
    if isinstance(config.get("model"), Mapping):
        return dict(config["model"])
    if "type" in config:
        return dict(config)
    raise ConfigError(f"{source}: the config has no 'model' entry; pass model_config=dict(type=...)")


def find_config(folder: Path | None) -> tuple[dict, Path] | None:
    """The first config file of :data:`CONFIG_FILES` in ``folder``, read."""
    if folder is None:
        return None
    for name in CONFIG_FILES:
        if (folder / name).is_file():
            return _read_config_file(folder / name), folder / name
    return None


# -- loading ----------------------------------------------------------------
def _select(state: dict, prefix: str | None, remove_prefix: bool, key_mapping: Mapping[str, str] | None,
            keep_unmapped_keys: bool, origin: str) -> dict:
    state = {strip_wrapper_prefixes(k): v for k, v in state.items()}
    if prefix:
        state = {(k[len(prefix):] if remove_prefix else k): v for k, v in state.items() if k.startswith(prefix)}
        if not state:
            raise CheckpointError(f"{origin}: no weight name starts with prefix={prefix!r}")
    if key_mapping:
        mapped = {}
        for key, tensor in state.items():
            old = max((o for o in key_mapping if key.startswith(o)), key=len, default=None)
            if old is not None:
                mapped[key_mapping[old] + key[len(old):]] = tensor
            elif keep_unmapped_keys:
                mapped[key] = tensor
        if not mapped:
            raise CheckpointError(f"{origin}: key_mapping={dict(key_mapping)!r} matches no weight name (names look "
                                  f"like {list(state)[:3]})")
        state = mapped
    return state


def _short(keys: list[str], limit: int = 6) -> str:
    return ", ".join(keys[:limit]) + (f" ... ({len(keys)} in all)" if len(keys) > limit else "")


def from_pretrained(pretrained: str | os.PathLike, *, model_config: Mapping | None = None,
                    config_path: str | os.PathLike | None = None, prefix: str | None = None,
                    remove_prefix: bool = True, key_mapping: Mapping[str, str] | None = None,
                    keep_unmapped_keys: bool = False, strict: bool = True, device: str | torch.device = "cpu",
                    return_metadata: bool = False, **model_kwargs):
    """The model stored at ``pretrained``, built and loaded, in evaluation mode.

    ``pretrained``: a ``.pth`` / ``.safetensors`` file, an export folder
    (:func:`save_pretrained`), a run directory (``model/model_best.pth``, else
    ``model_last.pth``), a checkpoint folder, or ``hf://org/name[@rev][/file]``.
    ``model_config`` (a ``dict(type=...)``) or ``config_path`` (a ``.py`` or
    ``.json`` config) say what to build; otherwise the config beside the weights
    (export folder, the run around them) does. ``model_kwargs`` override entries
    of the model config. ``prefix`` keeps only the weights under it (removed
    unless ``remove_prefix=False``); ``key_mapping={old_prefix: new_prefix}``
    renames weights (the longest matching prefix wins; unmatched ones are
    dropped unless ``keep_unmapped_keys``). ``strict``: every model tensor from
    the file and none left over (``False``: load what fits; the metadata lists
    the rest). ``return_metadata``: return ``(model, metadata)``."""
    import pimm.models  # noqa: F401  (registers the models)

    source = resolve_weight_source(pretrained)
    origin = str(pretrained)
    if model_config is not None:
        config_file, model_cfg = None, _plain(dict(model_config))
    elif config_path is not None:
        config_file = Path(config_path)
        if not config_file.is_file():
            raise ConfigError(f"config_path={str(config_path)!r}: no such file")
        model_cfg = _model_config(_read_config_file(config_file), str(config_file))
    else:
        found = find_config(source.folder)
        if found is None:
            where = f" in {source.folder}" if source.folder is not None else ""
            raise ConfigError(f"from_pretrained({origin!r}): no model config{where} (looked for "
                              f"{', '.join(CONFIG_FILES)}); pass model_config=dict(type=...) or config_path=...")
        config, config_file = found
        model_cfg = _model_config(config, str(config_file))
    model_cfg.update(model_kwargs)
    if "type" not in model_cfg:
        raise ConfigError(f"from_pretrained({origin!r}): the model config {model_cfg!r} has no 'type'")
    model = MODELS.build(model_cfg)
    state = _select(read_state_dict(source), prefix, remove_prefix, key_mapping, keep_unmapped_keys, origin)
    own = model.state_dict()
    mismatched = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items()
                  if k in own and hasattr(v, "shape") and tuple(own[k].shape) != tuple(v.shape)]
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    name = type(model).__name__
    if mismatched or (strict and (missing or unexpected)):
        parts = ([f"not in the weights: {_short(missing)}"] if missing and strict else []) + \
                ([f"not in the model: {_short(unexpected)}"] if unexpected and strict else []) + \
                ([f"shape mismatch: {_short(mismatched)}"] if mismatched else [])
        raise CheckpointError(f"from_pretrained({origin!r}): the weights do not fit {name} ({'; '.join(parts)}); "
                              "check the model config, or select weights with prefix= / key_mapping=, or "
                              "strict=False to load what fits")
    if not any(k in own for k in state):
        raise CheckpointError(f"from_pretrained({origin!r}): no weight fits {name} (weights look like "
                              f"{list(state)[:3]}, the model's like {list(own)[:3]})")
    model.load_state_dict(state, strict=False)
    model.to(device).eval()
    if return_metadata:
        return model, {"model_config": model_cfg, "weights": str(source.path), "config_file":
                       str(config_file) if config_file else None, "missing_keys": missing,
                       "unexpected_keys": unexpected}
    return model


# -- saving -----------------------------------------------------------------
def _state_of(model_or_checkpoint: Any) -> tuple[dict, Path | None, str]:
    """The state dict to export, the folder its config may be in, and what it is."""
    if isinstance(model_or_checkpoint, torch.nn.Module):
        module = getattr(model_or_checkpoint, "module", model_or_checkpoint)
        return module.state_dict(), None, type(module).__name__
    if isinstance(model_or_checkpoint, Mapping):
        for key in ("state_dict", "model"):
            if isinstance(model_or_checkpoint.get(key), Mapping):
                return dict(model_or_checkpoint[key]), None, "a checkpoint dict"
        return dict(model_or_checkpoint), None, "a state dict"
    if isinstance(model_or_checkpoint, (str, os.PathLike)):
        source = resolve_weight_source(model_or_checkpoint)
        return read_state_dict(source), source.folder, str(source.path)
    raise UserError(f"save_pretrained: expected a model, a checkpoint dict or a path, got "
                    f"{type(model_or_checkpoint).__name__}")


def _tensors_for_safetensors(state: dict) -> dict:
    """Plain, contiguous CPU tensors, none sharing memory (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue  # e.g. an _extra_state object: not a tensor, not exportable
        tensor = strip_wrapper_prefixes(key), value.detach().to("cpu")
        storage = (tensor[1].untyped_storage().data_ptr(), tensor[1].storage_offset())
        clone = storage in seen or not tensor[1].is_contiguous()
        seen.add(storage)
        out[tensor[0]] = tensor[1].contiguous().clone() if clone else tensor[1]
    return out


def _default_card(model_cfg: dict | None, state: dict, what: str) -> str:
    count = sum(v.numel() for v in state.values() if isinstance(v, torch.Tensor))
    kind = (model_cfg or {}).get("type", "a pimm model")
    return (f"# {kind}\n\nA model exported with pimm from {Path(what).name if os.sep in what else what}: "
            f"{count:,} weights in `{EXPORT_WEIGHTS}`, its training config in `{EXPORT_CONFIG}` "
            "(absolute paths redacted).\n\n```python\nimport pimm\n\nmodel = pimm.from_pretrained(\"path/to/this/folder\")"
            "  # or hf://org/name\n```\n")


def save_pretrained(model_or_checkpoint: Any, save_directory: str | os.PathLike, *, cfg: Any = None,
                    config_path: str | os.PathLike | None = None, training_config: Mapping | None = None,
                    model_card: str | None = None, overwrite: bool = False) -> Path:
    """Write an export folder (see the module docstring) and return its path.

    ``model_or_checkpoint``: an ``nn.Module``, a checkpoint or state dict, or
    any path :func:`from_pretrained` takes (a run directory exports its
    ``model_best.pth``, else ``model_last.pth``). The config is
    ``training_config``, else ``cfg``, else ``config_path``, else the one of the
    run around the weights. ``model_card``: the ``README.md`` text (default: a
    generated card). Files of an earlier export are not replaced unless
    ``overwrite=True``."""
    out = Path(save_directory)
    targets = [out / EXPORT_WEIGHTS, out / EXPORT_CONFIG, out / EXPORT_CARD]
    present = [p.name for p in targets if p.exists()]
    if present and not overwrite:
        raise UserError(f"save_pretrained: {out} already holds {', '.join(present)}; choose another folder or pass "
                        "overwrite=True")
    state, folder, what = _state_of(model_or_checkpoint)
    if training_config is not None:
        config = _plain(dict(training_config))
    elif cfg is not None:
        config = _plain(cfg)
    elif config_path is not None:
        config = _read_config_file(Path(config_path))
    else:
        found = find_config(folder)
        config = found[0] if found is not None else None
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise UserError("save_pretrained needs the safetensors package: pip install safetensors") from None
    tensors = _tensors_for_safetensors(state)
    if not tensors:
        raise CheckpointError(f"save_pretrained: {what} holds no tensors to export")
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / EXPORT_WEIGHTS), metadata={"format": "pt", "exported_by": "pimm"})
    model_cfg = None
    if config is not None:
        config = redact_config(config)
        model_cfg = config.get("model") if isinstance(config.get("model"), dict) else (
            config if "type" in config else None)
        (out / EXPORT_CONFIG).write_text(json.dumps(config, indent=2, default=str) + "\n", encoding="utf-8")
    (out / EXPORT_CARD).write_text(model_card if model_card is not None else _default_card(model_cfg, tensors, what),
                                   encoding="utf-8")
    return out
