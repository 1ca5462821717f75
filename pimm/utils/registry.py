"""Name -> class registries, and building objects from ``dict(type=...)``.

Every pluggable piece of pimm (trainers, hooks, models, datasets, transforms,
optimizers, schedulers) lives in a :class:`Registry`, so a config can name it
by string and a user can add their own with ``@REGISTRY.register_module()``.

Every live registry is also known to this module (:func:`registries`), so
code below the engine (the ``--options`` editor) can resolve a ``type`` name
to its class without importing the packages that create the registries.

The keys of a ``dict(type=...)`` are checked against the constructor's
signature before it is called (:func:`parameters_of`), so a misspelt
parameter is one line naming the nearest real one rather than Python's
``unexpected keyword argument``.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import RegistryError, UserError

__all__ = ["Registry", "build_from_cfg", "registries", "parameters_of", "Parameters"]

_LIVE: list[weakref.ref] = []  # every Registry ever made, in creation order
_GENERATION = [0]  # bumped by every registration, removal, new or dead registry: caches key on it


def _bump(_ref=None) -> None:
    _GENERATION[0] += 1


def generation() -> int:
    """A number that changes whenever anything is registered (for caches)."""
    return _GENERATION[0]


def registries(name: str | None = None) -> list["Registry"]:
    """The live registries (those named ``name``), oldest first."""
    _LIVE[:] = [ref for ref in _LIVE if ref() is not None]
    found = [ref() for ref in _LIVE]
    return [r for r in found if r is not None and (name is None or r.name == name)]


@dataclass(frozen=True)
class Parameters:
    """The keyword arguments a constructor takes: ``names`` in signature
    order; ``open`` when it also takes ``**kwargs`` (or has no signature to
    read), so any name may be right."""

    names: tuple[str, ...]
    open: bool

    def accepts(self, name: str) -> bool:
        return self.open or name in self.names

    def nearest(self, name: str, among: Iterable[str] | None = None) -> str | None:
        close = difflib.get_close_matches(name, list(self.names if among is None else among), n=1, cutoff=0.6)
        return close[0] if close else None


def _signature_parameters(target: Callable) -> Parameters:
    try:  # a config is checked often (each --options entry, then whole): signatures are read once
        return _signature_cached(target)
    except TypeError:  # an unhashable callable
        return _read_signature(target)


@functools.lru_cache(maxsize=4096)
def _signature_cached(target: Callable) -> Parameters:
    return _read_signature(target)


def _read_signature(target: Callable) -> Parameters:
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # builtins without a readable signature
        return Parameters((), True)
    names = tuple(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    return Parameters(names, any(p.kind is p.VAR_KEYWORD for p in params))


def parameters_of(obj: Callable) -> Parameters:
    """Keyword parameters of a class's constructor (without ``self``) or of a function."""
    return _signature_parameters(obj)


def _forwarded_parameters(obj: Callable) -> tuple[str, ...]:
    """Parameters of a class and of the parents its ``**kwargs`` usually
    reach (``super().__init__(**kwargs)``): only used to suggest a name."""
    if not inspect.isclass(obj):
        return parameters_of(obj).names
    names: list[str] = []
    for klass in obj.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        own = _signature_parameters(klass.__init__)
        names += [n for n in own.names[1:] if n not in names]  # [1:]: self
        if not own.open:
            break
    return tuple(names)


class BuildError(RuntimeError):
    """A registered constructor failed for a reason other than its arguments."""


class Registry:
    """A named mapping from type names to classes (or factory functions)."""

    def __init__(self, name: str):
        self.name = name
        self._modules: dict[str, Callable] = {}
        self._hints: dict[str, str] = {}
        self._domains: dict[int, tuple[dict, tuple]] = {}  # id(module) -> (domains, rules), see register_module
        _LIVE.append(weakref.ref(self, _bump))  # a registry that dies changes what registries() finds
        _bump()

    def add_hint(self, name: str, hint: str) -> None:
        """What to use instead of ``name``, a type users know from elsewhere
        (e.g. upstream pimm) that is not registered here."""
        self._hints[name] = hint

    def __repr__(self) -> str:
        return f"Registry(name={self.name!r}, items={sorted(self._modules)})"

    def __len__(self) -> int:
        return len(self._modules)

    def __contains__(self, name: str) -> bool:
        return name in self._modules

    def keys(self) -> list[str]:
        return sorted(self._modules)

    def find(self, name: str) -> Callable | None:
        """The class registered as ``name``, or None."""
        return self._modules.get(name)

    def _add(self, module: Callable, names: Iterable[str], force: bool) -> None:
        if not callable(module):
            raise TypeError(f"{self.name}: can only register classes or functions, got {module!r}")
        names = list(names)
        for name in names:  # check every alias first: a failed call registers nothing
            existing = self._modules.get(name)
            if existing is not None and existing is not module and not force:
                raise KeyError(
                    f"{name!r} is already registered in {self.name} "
                    f"(by {existing.__module__}.{existing.__qualname__}); pass force=True to replace it"
                )
        for name in names:
            self._modules[name] = module
        _bump()

    def remove(self, name: str) -> Callable:
        """Unregister ``name`` (a plug-in unloaded, a test's temporary class); returns what it named."""
        if name not in self._modules:
            raise KeyError(f"{name!r} is not registered in {self.name}; nothing to remove")
        module = self._modules.pop(name)
        _bump()
        return module

    def register_module(
        self,
        name: str | Iterable[str] | None = None,
        force: bool = False,
        module: Callable | None = None,
        domains: dict | None = None,
        rules: tuple = (),
    ):
        """Register ``module`` under its own name, or ``name`` (a string or a list of
        aliases). Use as ``@REG.register_module()``, ``@REG.register_module("Alias")``
        or ``REG.register_module(module=cls)``. ``domains``/``rules``: the
        argument domains (:mod:`pimm.utils.domains`) of a class pimm does not
        own or of a function, which cannot carry a ``domains`` attribute."""
        if callable(name) and module is None and not isinstance(name, str):
            # Bare ``@REG.register_module`` without parentheses.
            module, name = name, None

        def names_for(obj: Callable) -> list[str]:
            if name is None:
                return [obj.__name__]
            if isinstance(name, str):
                return [name]
            return list(name)

        def add(obj: Callable) -> Callable:
            self._add(obj, names_for(obj), force)
            if domains is not None or rules:
                self._domains[id(obj)] = (dict(domains or {}), tuple(rules))
                _bump()
            return obj

        if module is not None:
            return add(module)

        def decorator(obj: Callable) -> Callable:
            return add(obj)

        return decorator

    def declared_domains(self, module: Callable) -> tuple[dict, tuple]:
        """The domains and rules given to ``register_module`` for ``module`` (empty if none)."""
        return self._domains.get(id(module), ({}, ()))

    def get(self, name: str) -> Callable:
        try:
            return self._modules[name]
        except KeyError:
            raise RegistryError(self._unknown_message(name)) from None

    def _unknown_message(self, name: str) -> str:
        if name in self._hints:
            return f"{self.name} type {name!r} is not available in pimm: {self._hints[name]}"
        close = difflib.get_close_matches(str(name), self._modules, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else (
            f"registered: {', '.join(sorted(self._modules)) or '(none)'}"
        )
        return (
            f"unknown {self.name} type {name!r}; {hint} "
            "(a class of your own must be registered and its module listed in custom_imports)"
        )

    def build(self, cfg: Any, default_args: dict | None = None) -> Any:
        return build_from_cfg(cfg, self, default_args)


def _describe_args(args: dict) -> str:
    parts = []
    for key, value in args.items():
        text = repr(value).replace("\n", " ")
        parts.append(f"{key}={text if len(text) <= 60 else text[:57] + '...'}")
    return ", ".join(parts)


def build_from_cfg(cfg: Any, registry: Registry, default_args: dict | None = None) -> Any:
    """Build ``cfg['type'](**rest, **default_args)`` from ``registry``.

    ``default_args`` fill in keys the config does not set. ``type`` may be a
    registered name or a class/function itself."""
    if not isinstance(cfg, dict):
        raise RegistryError(f"{registry.name}: expected a dict(type=...), got {cfg!r}")
    args = dict(cfg)
    if "type" not in args:
        raise RegistryError(f"{registry.name}: config {cfg!r} has no 'type' key")
    for key, value in (default_args or {}).items():
        args.setdefault(key, value)
    obj_type = args.pop("type")
    if isinstance(obj_type, str):
        obj_cls = registry.get(obj_type)
        type_name = obj_type
    elif callable(obj_type):
        obj_cls = obj_type
        type_name = getattr(obj_type, "__name__", repr(obj_type))
    else:
        raise RegistryError(f"{registry.name}: 'type' must be a name or a class, got {obj_type!r}")
    _check_keys(obj_cls, [k for k in cfg if k != "type"], f"{registry.name} {type_name}")

    try:
        return obj_cls(**args)
    except UserError as err:
        # Keep the exception's class (and its exit code); only prefix the context.
        err.args = (f"{registry.name} {type_name}: {err}",)
        raise
    except ValueError as err:
        # Constructors validate their arguments with ValueError: the config's fault.
        raise RegistryError(f"{registry.name} {type_name}({_describe_args(args)}): {err}") from err
    except TypeError as err:
        # A TypeError raised by the call itself (not deeper) means the arguments
        # do not fit the signature: that is the user's config.
        if _is_signature_error(obj_cls, args):
            raise RegistryError(
                f"{registry.name} {type_name}({_describe_args(args)}): {err}"
            ) from err
        # A constructor taking **kwargs passes them on (super().__init__(**kw));
        # the parent rejecting one the config gave is still the config's fault.
        rejected = _UNEXPECTED_KEYWORD.search(str(err))
        if rejected and rejected.group(1) in cfg:
            raise RegistryError(_unknown_keys_message(
                f"{registry.name} {type_name}", [rejected.group(1)], _forwarded_parameters(obj_cls), type_name)) from err
        raise BuildError(f"{registry.name} {type_name}({_describe_args(args)}) failed: {err!r}") from err
    except Exception as err:
        raise BuildError(f"{registry.name} {type_name}({_describe_args(args)}) failed: {err!r}") from err


_UNEXPECTED_KEYWORD = re.compile(r"got an unexpected keyword argument '(\w+)'")


def _unknown_keys_message(what: str, unknown: list[str], names: Iterable[str], type_name: str) -> str:
    names = list(names)
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
        parts.append(f"{key!r} (did you mean {close[0]!r}?)" if close else repr(key))
    noun = "parameter" if len(unknown) == 1 else "parameters"
    return f"{what}: unknown {noun} {', '.join(parts)}; {type_name} takes: {', '.join(names) or '(no parameters)'}"


def _check_keys(obj_cls: Callable, keys: list[str], what: str) -> None:
    """Refuse config keys the constructor cannot take, naming the nearest real ones."""
    params = parameters_of(obj_cls)
    unknown = [k for k in keys if not params.accepts(k)]
    if unknown:
        type_name = getattr(obj_cls, "__name__", what)
        raise RegistryError(_unknown_keys_message(what, unknown, params.names, type_name))


def _is_signature_error(obj_cls: Callable, args: dict) -> bool:
    try:
        target = obj_cls.__init__ if inspect.isclass(obj_cls) else obj_cls
        sig = inspect.signature(target)
        if inspect.isclass(obj_cls):
            sig.bind(None, **args)
        else:
            sig.bind(**args)
    except TypeError:
        return True
    except ValueError:  # builtins without a signature
        return True
    return False
