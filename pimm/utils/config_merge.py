"""Applying a whole ``--options`` command line to a config: every token
parsed first, each applied in order (``hooks_override`` where it stands),
the modules the options add imported, then every registry-built dict an
option changed checked against its type. The grammar and the single edit are
:mod:`pimm.utils.config_options`; ``hooks_override`` is
:mod:`pimm.utils.hooks_override`.
"""

from __future__ import annotations

from typing import Any, Iterable

from .config_imports import IMPORTS_KEY, as_names, import_modules
from .config_options import apply_option, parse_options
from .config_slots import check_registry_dicts
from .errors import ConfigError, RegistryError
from .hooks_override import KEY as OVERRIDE, apply_overrides

__all__ = ["merge_options", "import_custom_modules"]


def merge_options(cfg: dict, tokens: Iterable[str] | None) -> None:
    """Apply ``--options`` tokens in order, all parsed before any is applied.
    A registry-built dict whose ``type`` an option changed (or that an
    option set whole) is then checked against its new type: the type must
    be registered and every key it keeps must be a parameter of it.
    ``hooks_override`` is applied where it stands (never kept as a key for a
    later load to apply); a key a config file alone may hold (``_base_``,
    any top-level ``_name``) is refused."""
    changed: list[tuple[str, str]] = []
    parsed = parse_options(tokens)
    for key, value, is_new in parsed:
        head = key.split(".")[0]
        if head.startswith("_"):
            what = ("inheritance is a config file's (write a file with _base_ = [...] and pass it)"
                    if head == "_base_" else "names starting with '_' are a config file's private helpers")
            raise ConfigError(f"--options {'+' if is_new else ''}{key}: {what}; it cannot be set from the command "
                              "line")
    for key, value, is_new in parsed:
        if key.split(".")[0] == OVERRIDE:
            shown = f"--options {'+' if is_new else ''}{key}"
            for path in apply_overrides(cfg, _nested(key, value), source=shown):
                changed.append((key, path))
            continue
        for path in apply_option(cfg, key, value, is_new):
            if not is_new:
                changed.append((key, path.rpartition(".")[0] if path.endswith(".type") else path))
    import_custom_modules(cfg)  # a type registered by a module the options add must be known below
    for key, within in changed:
        try:
            check_registry_dicts(cfg, within, context=f"--options {key}: ")
        except ConfigError as err:
            if key.endswith(".type") and not isinstance(err, RegistryError):
                # Keys of the old type stay when only ``type`` changes.
                err.args = (f"{err}; to switch type, give the whole dict: {within}=\"{{'type': ..., ...}}\"",)
            raise


def _nested(key: str, value: Any) -> Any:
    """``hooks_override.A.b=v`` -> ``{"A": {"b": v}}`` (``hooks_override=v`` -> ``v``)."""
    for segment in reversed(key.split(".")[1:]):
        value = {segment: value}
    return value


def import_custom_modules(cfg: dict) -> None:
    """Import the modules of ``cfg["custom_imports"]`` (those an option added
    included), so the classes they register exist before types are checked."""
    if cfg.get(IMPORTS_KEY) is not None:
        cfg[IMPORTS_KEY] = as_names(cfg[IMPORTS_KEY], IMPORTS_KEY, "--options")
        import_modules(cfg[IMPORTS_KEY], "--options")
