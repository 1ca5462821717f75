""":func:`from_pretrained`: a model built from its config and loaded from its
weights, in evaluation mode, from any weight source (upstream pimm's function,
its arguments and their meaning)."""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

import torch

from pimm.engines.registries import MODELS
from pimm.engines.state.weight_source import EXPORT_WEIGHT_NAMES, read_state_dict
from pimm.export.checkpoint import clean_state_dict, filter_state_dict_by_prefix, misfit, remap_state_dict_keys
from pimm.export.configs import (CONFIG_READ_NAMES, find_config, model_config_of, plain, read_config_file,
                                 select_model_config, unimported_custom_imports)
from pimm.export.hub import resolve_pretrained
from pimm.utils.errors import CheckpointError, ConfigError, UserError

__all__ = ["from_pretrained", "check_device", "build_model"]


def check_device(device: Any, what: str) -> torch.device | None:
    """``device`` as a torch.device (None stays None); one error line for a
    name torch does not know or a device this machine does not have."""
    if device is None:
        return None
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{what}: device={device!r} is not a device name (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{what}: device={str(device)!r} but CUDA is not available on this machine; use "
                          "device='cpu' (pimm's models run on the CPU too)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{what}: device={str(device)!r} but this machine has {torch.cuda.device_count()} CUDA "
                          "device(s)")
    return device


def build_model(model_cfg: Mapping, model_cls: type | None, config: Mapping | None, what: str) -> torch.nn.Module:
    """The model of ``model_cfg`` (through the registry, or ``model_cls`` built
    from its arguments); an unregistered type that the config's unimported
    ``custom_imports`` would register says how to import them."""
    import pimm.models  # noqa: F401  (registers pimm's models)

    if model_cls is not None:
        arguments = {k: v for k, v in model_cfg.items() if k != "type"}
        try:
            return model_cls(**arguments)
        except TypeError as err:
            raise ConfigError(f"{what}: {model_cls.__name__}({', '.join(arguments)}) failed: {err}") from None
    pending = unimported_custom_imports(config or {})
    if pending and model_cfg["type"] not in MODELS:
        raise ConfigError(f"{what}: model type {model_cfg['type']!r} is not registered, and the config names "
                          f"custom_imports={pending}, which pimm never imports from weights or an export (they "
                          f"are data): if you trust them, import them yourself (import {pending[0]}) first, or "
                          "name the run's config.py (config_path=, pimm export --config), which runs it")
    return MODELS.build(dict(model_cfg))


def from_pretrained(pretrained_model_name_or_path: str | os.PathLike, *, model_config: Mapping | None = None,
                    source_model_config: Mapping | None = None, model_type: str | None = None,
                    model_cls: type | None = None, config_path: str | os.PathLike | None = None,
                    cache_dir: str | os.PathLike | None = None, revision: str | None = None,
                    device: str | torch.device | None = None, strict: bool = True, prefix: str | None = None,
                    remove_prefix: bool = True, key_mapping: Mapping[str, str] | None = None,
                    keep_unmapped_keys: bool = False,
                    filter_fn: Callable[[dict, torch.nn.Module], dict] | None = None,
                    return_metadata: bool = False, **model_kwargs: Any):
    """The model stored at ``pretrained_model_name_or_path``, built, loaded and
    in evaluation mode (docs/pretrained.md).

    Where from: a ``.pth`` / ``.safetensors`` / ``.bin`` file, an export
    folder, a run directory, a checkpoint folder, ``hf://Org/Name[@rev][/file]``
    or a bare ``Org/Name`` (:mod:`pimm.export.hub` says the order); ``revision``
    and ``cache_dir`` apply to Hub models.

    What to build: ``model_config`` (or ``source_model_config``, the same
    thing under the name upstream's metadata gives it), else the file
    ``config_path`` (a ``.py`` file is run: you named it), else the JSON config
    beside the weights (never a ``config.py``, never its ``custom_imports``).
    ``model_type`` picks the first nested config of that type (upstream's
    meaning: ``model_type="PT-v3m2"`` takes a segmentor's backbone), or
    replaces the type; ``model_cls`` builds that class instead of the
    registry's; ``model_kwargs`` override entries last.

    Which weights: ``prefix`` keeps the keys under it (removed unless
    ``remove_prefix=False``); ``key_mapping`` renames (exact key first, then
    the first matching prefix; unmatched keys dropped unless
    ``keep_unmapped_keys``); ``filter_fn(state_dict, model)`` last. ``strict``:
    every model tensor from the weights and none left over (shapes must agree
    either way). ``device``: where the model goes (None: stays on the CPU).
    ``return_metadata``: also return a dict with ``model_config``,
    ``source_model_config``, ``path`` (the export folder, or the weight file),
    ``weights`` (the file read), ``config`` (``{}``),
    ``config_file``, ``missing_keys``, ``unexpected_keys`` and, when
    ``strict=False``, ``incompatible_keys``."""
    origin = os.fspath(pretrained_model_name_or_path)
    what = f"from_pretrained({origin!r})"
    target = check_device(device, what)
    if model_config is not None and source_model_config is not None:
        raise ConfigError(f"{what}: give model_config or source_model_config, not both (they mean the same)")
    source = resolve_pretrained(origin, revision=revision, cache_dir=cache_dir)
    given = model_config if model_config is not None else source_model_config
    config, config_file = None, None
    if given is not None:
        if not isinstance(given, Mapping):
            raise ConfigError(f"{what}: model_config must be a dict(type=...), got {type(given).__name__}")
        source_cfg = plain(dict(given))
    else:
        if config_path is not None:
            config_file = config_path
            config = read_config_file(config_path)
        else:
            found = find_config(source.folder)
            if found is None:
                where = f" in {source.folder}" if source.folder is not None else ""
                raise ConfigError(f"{what}: no model config{where} (looked for {', '.join(CONFIG_READ_NAMES)}); pass "
                                  "model_config=dict(type=...) or config_path=...")
            config, config_file = found
        source_cfg = model_config_of(config, str(config_file))
    model_cfg = select_model_config(source_cfg, model_type)
    model_cfg.update(model_kwargs)
    if "type" not in model_cfg and model_cls is None:
        raise ConfigError(f"{what}: the model config {model_cfg!r} has no 'type'")
    model = build_model(model_cfg, model_cls, config, what)

    state = clean_state_dict(read_state_dict(source))
    if prefix is not None:
        state = filter_state_dict_by_prefix(state, prefix, remove_prefix)
        if not state:
            raise CheckpointError(f"{what}: no weight name starts with prefix={prefix!r}")
    if key_mapping is not None:
        state = remap_state_dict_keys(state, key_mapping, keep_unmapped=keep_unmapped_keys)
        if not state:
            raise CheckpointError(f"{what}: key_mapping={dict(key_mapping)!r} matches no weight name")
    if filter_fn is not None:
        state = filter_fn(state, model)
        if not isinstance(state, Mapping):
            raise UserError(f"{what}: filter_fn returned {type(state).__name__}, not a state dict")
    if not state:
        raise CheckpointError(f"{what}: no weights left to load (after prefix / key_mapping / filter_fn)")
    problem, missing, unexpected = misfit(model.state_dict(), state, strict)
    if problem:
        raise CheckpointError(f"{what}: the weights do not fit {type(model).__name__} ({problem}); check the model "
                              "config, or select weights with prefix= / key_mapping=, or strict=False to load what "
                              "fits")
    incompatible = model.load_state_dict(dict(state), strict=False)
    if target is not None:
        model.to(target)
    model.eval()
    if not return_metadata:
        return model
    exported = source.folder is not None and source.path.name in EXPORT_WEIGHT_NAMES
    metadata = {"model_config": model_cfg, "source_model_config": source_cfg,
                "path": str(source.folder if exported else source.path), "weights": str(source.path), "config": {},
                "config_file": str(config_file) if config_file is not None else None,
                "missing_keys": missing, "unexpected_keys": unexpected}
    if not strict:
        metadata["incompatible_keys"] = {"missing_keys": list(incompatible.missing_keys),
                                         "unexpected_keys": list(incompatible.unexpected_keys)}
    return model, metadata
