"""ConfigDict: the dict type every loaded config is made of.

Its own module so that the loader (``config``) and the ``--options`` editor
(``config_options``) can both use it without importing each other.
"""

from __future__ import annotations

import copy
import difflib
from typing import Any

__all__ = ["ConfigDict", "to_config_value", "to_plain"]


def to_config_value(value: Any) -> Any:
    """Deep-convert dicts, also inside lists and tuples, to ConfigDict."""
    if isinstance(value, ConfigDict):
        return value
    if isinstance(value, dict):
        return ConfigDict(value)
    if type(value) is list:
        return [to_config_value(v) for v in value]
    if type(value) is tuple:
        return tuple(to_config_value(v) for v in value)
    return value


def _rebuild(cls: type, items: dict) -> "ConfigDict":
    """A ConfigDict of ``cls`` holding ``items`` as they are (already converted)."""
    rebuilt = dict.__new__(cls)
    dict.update(rebuilt, items)
    return rebuilt


def to_plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(to_plain(v) for v in value)
    return value


class ConfigDict(dict):
    """A dict whose (nested) keys can also be read and written as attributes.

    Keys that collide with dict methods (``items``, ``keys``, ``update``, ...)
    must be accessed with ``cfg["items"]``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, to_config_value(value))

    def update(self, *args: Any, **kwargs: Any) -> None:  # dict.update bypasses __setitem__
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> "ConfigDict":
        self.update(other)
        return self

    def __getattr__(self, name: str) -> Any:
        # Dunder lookups (pickle, copy) must see a plain AttributeError.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            pass
        close = difflib.get_close_matches(name, [k for k in self if isinstance(k, str)], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise AttributeError(f"config has no key {name!r}{hint}")

    def __setattr__(self, name: str, value: Any) -> None:
        if hasattr(type(self), name):
            raise AttributeError(f"{name!r} is a {type(self).__name__} attribute; set the key with cfg[{name!r}] = ...")
        self[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self[name]
        except KeyError:
            raise AttributeError(f"config has no key {name!r}") from None

    def __dir__(self) -> list[str]:
        return [*super().__dir__(), *(k for k in self if isinstance(k, str) and k.isidentifier())]

    def __reduce_ex__(self, protocol: int):
        # Pickle, copy and deepcopy rebuild the dict from its items without
        # converting each again through __setitem__ (they are converted
        # already): a deep copy of a whole config takes a third of the time.
        return _rebuild, (type(self), dict(self)), (self.__dict__ or None)

    def copy(self) -> "ConfigDict":
        return copy.copy(self)

    def to_dict(self) -> dict:
        """Plain nested dicts and lists (tuples stay tuples)."""
        return to_plain(self)
