"""The config that travels with weights: read as data, chosen, and cleaned for
publishing.

What lies beside weights is data. A config found there is read only from JSON
(:data:`CONFIG_READ_NAMES`, upstream's names and order); its
``custom_imports`` are never imported, and a ``config.py`` found there is
never run: the user is told how to opt in (name the file with
``config_path=`` / ``--config``). A ``config.py`` runs only when the user names
it, or names a run directory (:func:`is_run_directory`) to a command that
works on runs (``pimm export RUN``, ``pimm test RUN``, ``--resume``); see
docs/security.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Mapping

from pimm.utils.config_dict import to_plain
from pimm.utils.errors import ConfigError
from pimm.utils.redaction import redact_paths, redact_secrets

__all__ = ["CONFIG_NAME", "CONFIG_READ_NAMES", "RUN_RECORDS", "LOAD_KEYS", "is_run_directory", "plain",
           "read_config_file", "find_config", "model_config_of", "select_model_config", "config_for_publishing",
           "unimported_custom_imports"]

#: The config file an export writes.
CONFIG_NAME = "config.json"
#: Config files read beside weights, in this order (upstream's): an export's,
#: upstream's legacy name, and a pimm run's records.
CONFIG_READ_NAMES = ("config.json", "training_config.json", "resolved_config.json", "model_config.json")
#: Records that ``pimm train`` writes beside a run's ``config.py`` when the run starts.
RUN_RECORDS = ("attempts.jsonl", "run_metadata.json")
#: Keys whose value would load other weights when the model is rebuilt: nulled in an export.
LOAD_KEYS = frozenset({"weight", "resume", "pretrained", "load_from", "ckpt", "ckpt_path", "checkpoint",
                       "init_cfg"})
_IMPORTS_KEY = "custom_imports"


def is_run_directory(folder: str | Path) -> bool:
    """Whether ``folder`` is a run directory that ``pimm train`` made: its
    ``config.py`` with the records a run writes beside it (:data:`RUN_RECORDS`)."""
    folder = Path(folder)
    return (folder / "config.py").is_file() and any((folder / name).is_file() for name in RUN_RECORDS)


def plain(value: Any) -> Any:
    """``value`` (a Config, ConfigDict, dict, list, ...) as JSON-able dicts and
    lists, without private (``_``-prefixed) keys such as ``_base_``."""
    value = to_plain(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def read_config_file(path: str | Path) -> dict:
    """A config file the user named: JSON is read as data; a ``.py`` file is run
    (the user chose it: ``config_path=``, ``--config``, or a run directory)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config {str(path)!r}: no such file")
    if path.suffix == ".py":
        from pimm.utils.config import Config

        return plain(Config.fromfile(str(path)))
    return _read_json(path)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: cannot be read as JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def find_config(folder: Path | None, opt_in: str = "config_path=") -> tuple[dict, Path] | None:
    """The first JSON config of :data:`CONFIG_READ_NAMES` in ``folder``, read as
    data; None when there is none. A ``config.py`` alone there is a
    ConfigError saying how to opt in to running it (``opt_in``: the argument
    that names a config file)."""
    if folder is None:
        return None
    for name in CONFIG_READ_NAMES:
        if (folder / name).is_file():
            return _read_json(folder / name), folder / name
    script = folder / "config.py"
    if script.is_file():
        value = f"'{script}'" if opt_in.endswith("=") else str(script)
        raise ConfigError(f"{folder} holds a config.py but no {CONFIG_NAME}: a config.py is code, and pimm never "
                          f"runs one found beside weights; if you trust it, pass {opt_in}{value} (that runs it), "
                          "or give the model config as data (model_config=dict(type=...))")
    return None


def model_config_of(config: Mapping, source: str) -> dict:
    """The ``model`` entry of a full config, or the config itself when it is a
    model's (it has a ``type``: upstream's released exports)."""
    if isinstance(config.get("model"), Mapping) and config["model"]:
        return dict(config["model"])
    if "type" in config:
        return {k: v for k, v in config.items() if k != _IMPORTS_KEY}
    raise ConfigError(f"{source}: the config has no 'model' entry and no 'type'; pass model_config=dict(type=...)")


def _find_type(value: Any, model_type: str) -> dict | None:
    if isinstance(value, Mapping):
        if value.get("type") == model_type:
            return dict(value)
        values = value.values()
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return None
    return next((found for v in values if (found := _find_type(v, model_type)) is not None), None)


def select_model_config(source_config: Mapping, model_type: str | None) -> dict:
    """Upstream's ``model_type``: the first config (the model's own, then nested
    ones, depth first) whose ``type`` is ``model_type``; when none is, the
    model config with its ``type`` replaced."""
    config = dict(source_config)
    if model_type is None or config.get("type") == model_type:
        return config
    nested = _find_type(config, model_type)
    return nested if nested is not None else {**config, "type": model_type}


def unimported_custom_imports(config: Mapping) -> list[str]:
    """The ``custom_imports`` a config names that are not imported in this
    process (pimm never imports them from data: the user does, if they trust them)."""
    names = config.get(_IMPORTS_KEY) or []
    names = [names] if isinstance(names, str) else names
    return [str(n) for n in names if isinstance(n, str) and n not in sys.modules] if isinstance(names, list) else []


_WORD = re.compile(r"[A-Za-z0-9_-]*")


def _loads_weights(key: Any, value: Any) -> bool:
    """Whether ``key: value`` would load other weights: a load key that is true
    or names a location (any string but a bare word such as PushToHub's
    ``checkpoint="model_best"``: relative paths and ``hf://`` names too)."""
    return key in LOAD_KEYS and (value is True or (isinstance(value, str) and not _WORD.fullmatch(value)))


def _null_load_keys(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: None if _loads_weights(key, item) else _null_load_keys(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_null_load_keys(v) for v in value]
    return value


def config_for_publishing(config: Any) -> dict:
    """``config`` as an export writes it: plain data; every key that would load
    other weights (:data:`LOAD_KEYS`: ``weight``, ``pretrained``, ``resume``...)
    null when it is true or names a location (relative paths and ``hf://``
    names too); every
    secret (``token``, ``api_key``, ``password``, ``NAME_KEY=...`` in a command
    line) and every path (absolute, ``~/``, ``file://``, inside command lines,
    as dict keys) replaced by ``"<redacted>"``."""
    return redact_paths(redact_secrets(_null_load_keys(plain(config))))

