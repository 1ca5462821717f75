"""``custom_imports``: the config key naming user modules to import (so the
classes they register exist), and the import itself with its error messages.
Shared by config loading (:mod:`pimm.utils.config`), ``--options``
(:mod:`pimm.utils.config_options`) and JSON model configs, none of which need
to import each other for it."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from .errors import ConfigError

__all__ = ["IMPORTS_KEY", "as_names", "import_modules"]

IMPORTS_KEY = "custom_imports"


def as_names(value: Any, key: str, source: Any) -> list[str]:
    """``value`` (one name or path, or a list of them) as a list of strings;
    anything else is a :class:`ConfigError` naming ``key`` and ``source``."""
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) and str(v) for v in value):
        return [os.fspath(v) for v in value]
    raise ConfigError(f"{source}: {key} must be a string or a list of strings, got {value!r}")


def import_modules(names: list[str], source: Any) -> None:
    """Import each module of ``names``; a failure is one :class:`ConfigError`
    naming the module and ``source`` (the config that asked for it)."""
    for name in names:
        try:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as err:
                # ``python tools/train.py`` puts tools/ first on sys.path, not the
                # directory the user runs from; look there too when the module itself is missing.
                cwd = os.getcwd()
                missing_self = err.name and (name == err.name or name.startswith(err.name + "."))
                if not missing_self or cwd in sys.path or "" in sys.path:
                    raise
                sys.path.append(cwd)
                importlib.invalidate_caches()
                importlib.import_module(name)
        except ImportError as err:
            raise ConfigError(
                f"custom_imports in {source}: cannot import {name!r} ({err}); "
                "make sure the module is on PYTHONPATH or in the current directory"
            ) from err
        except Exception as err:
            raise ConfigError(
                f"custom_imports in {source}: importing {name!r} failed: {type(err).__name__}: {err}"
            ) from err
