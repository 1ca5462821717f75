"""Upstream pimm's warning API (``from pimm.utils.warnings import PimmWarning,
warn_once, ...``): the categories pimm's own warnings can be filtered by, and
helpers that attribute a warning to the caller's code.

``PimmWarning`` is a ``UserWarning`` and ``PimmDeprecationWarning`` a
``FutureWarning`` (shown by default, unlike ``DeprecationWarning``), so
``warnings.filterwarnings("ignore", category=PimmWarning)`` silences exactly
what these helpers emit.
"""

from __future__ import annotations

import functools
import threading
import warnings as _warnings
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["PimmWarning", "PimmDeprecationWarning", "warn", "warn_once", "deprecation_message", "warn_deprecated",
           "deprecated"]


class PimmWarning(UserWarning):
    """The category of pimm's warnings."""


class PimmDeprecationWarning(FutureWarning):
    """A pimm API that a later release removes."""


_Wrapped = TypeVar("_Wrapped", bound=Callable)
_already_warned: set[Hashable] = set()
_already_warned_lock = threading.Lock()


def warn(message: str, category: type[Warning] = PimmWarning, *, stacklevel: int = 2) -> None:
    """``warnings.warn(message, category)``, attributed to the code that calls
    this (``stacklevel=3``: to that code's caller, and so on)."""
    _warnings.warn(message, category, stacklevel=stacklevel)


def warn_once(message: str, category: type[Warning] = PimmWarning, *, key: Hashable | None = None,
              stacklevel: int = 2) -> None:
    """:func:`warn`, but only the first time in this process for ``key``
    (default: the category and message), whatever Python's warning filters say."""
    seen = key if key is not None else (category, message)
    with _already_warned_lock:
        if seen in _already_warned:
            return
        _already_warned.add(seen)
    warn(message, category, stacklevel=stacklevel + 1)


def deprecation_message(feature: str, replacement: str, remove_in: str) -> str:
    """The one sentence pimm says about a deprecated feature."""
    return f"{feature} is deprecated; use {replacement} instead. It will be removed in pimm {remove_in}."


def warn_deprecated(feature: str, replacement: str, remove_in: str, *, stacklevel: int = 2) -> None:
    """A :class:`PimmDeprecationWarning` for ``feature`` (see :func:`deprecation_message`)."""
    warn(deprecation_message(feature, replacement, remove_in), PimmDeprecationWarning, stacklevel=stacklevel + 1)


def deprecated(*, replacement: str, remove_in: str) -> Callable[[_Wrapped], _Wrapped]:
    """Decorate a function or class so that each call (each instantiation)
    warns with :class:`PimmDeprecationWarning`, pointing at the caller."""

    def decorate(obj: _Wrapped) -> _Wrapped:
        message = deprecation_message(obj.__qualname__, replacement, remove_in)
        if isinstance(obj, type):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def __init__(self, *args, **kwargs):
                warn(message, PimmDeprecationWarning, stacklevel=3)
                original_init(self, *args, **kwargs)

            obj.__init__ = __init__
            obj.__deprecated__ = message
            return obj

        @functools.wraps(obj)
        def wrapper(*args, **kwargs):
            warn(message, PimmDeprecationWarning, stacklevel=3)
            return obj(*args, **kwargs)

        wrapper.__deprecated__ = message
        return wrapper

    return decorate
