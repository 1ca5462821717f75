"""Registry-built dicts in a config: which class each becomes, which keys it takes.

SPEC: inside a ``dict(type=...)`` every parameter of that type's constructor
is a defined key, listed in the config or not. Deciding that for a key the
config does not list needs the class the ``type`` names, and this module
finds it without importing the engine (``pimm.utils`` sits below it): every
live :class:`~pimm.utils.registry.Registry` is known to
:func:`pimm.utils.registry.registries` by its name ("hook", "model", ...).

Which registry a dict is built from follows from where it sits (its *slot*,
see ``SLOTS``): ``hooks.<i>`` from the hook registry, ``model`` from the
model registry, and so on. A dict elsewhere (``model.backbone``, a loss in
``model.criteria``) is looked up by its type name in every live registry; a
name found in several (as different classes) accepts the parameters of any
of them. When nothing can be resolved (the registry is not imported, or the
name is in none at an unknown position) the dict is treated as plain data.

Not every parameter is a config key: some are filled in by the builder
(``BUILDER_ARGS``: an optimizer's ``params``, a scheduler's ``optimizer`` and
``total_steps``, a trainer's ``cfg``); some keys are taken by the builder
although the constructor has no such parameter (``BUILDER_KEYS``: a hook's
``priority``). A constructor taking ``**kwargs`` accepts any key.
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from .errors import ConfigError, RegistryError
from .registry import Parameters, Registry, generation, parameters_of, registries

__all__ = ["SLOTS", "BUILDER_ARGS", "BUILDER_KEYS", "Resolved", "slot_registry", "resolve", "resolve_section",
           "check_registry_dicts"]

# (path pattern, registry name): ``*`` is any one key, ``#`` a list index.
# The first pattern that matches a path wins.
SLOTS: tuple[tuple[str, str], ...] = (
    ("train", "trainer"),
    ("train.collate_fn", "collate function"),
    ("train.val_collate_fn", "collate function"),
    ("hooks.#", "hook"),
    ("default_hooks.*", "hook"),
    ("model", "model"),
    ("optimizer", "optimizer"),
    ("scheduler", "scheduler"),
    ("data.*", "dataset"),
    ("data.*.#", "dataset"),  # a list of data sets (MultiDatasetTrainer)
    ("data.*.transform", "transform"),
    ("data.*.transform.#", "transform"),
    ("data.*.#.transform", "transform"),
    ("data.*.#.transform.#", "transform"),
)

# Constructor parameters the engine fills in: never config keys.
BUILDER_ARGS: dict[str, tuple[str, ...]] = {
    "trainer": ("cfg", "mode"),
    "optimizer": ("params",),
    "scheduler": ("optimizer", "total_steps"),
    "collate function": ("batch",),
}
# Keys the builder takes itself, beside the constructor's parameters.
BUILDER_KEYS: dict[str, tuple[str, ...]] = {
    "hook": ("priority",),
    "optimizer": ("no_weight_decay",),  # build_optimizer's group split (WeightDecayExclusion sets it)
}

_INDEX = re.compile(r"-?\d+")


def _matches(pattern: str, path: str) -> bool:
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(
        w == h or w == "*" or (w == "#" and _INDEX.fullmatch(h)) for w, h in zip(want, have)
    )


@functools.lru_cache(maxsize=8192)
def slot_registry(path: str) -> str | None:
    """The registry name a dict at ``path`` (list indices as numbers) is built from."""
    return next((name for pattern, name in SLOTS if _matches(pattern, path)), None)


@dataclass(frozen=True)
class Resolved:
    """The class(es) a registry-built dict becomes and the keys it takes."""

    what: str  # "hook CheckpointSaver", for messages
    params: Parameters  # settable keys (builder-filled ones removed, builder keys added)
    filled: tuple[str, ...]  # parameters the builder fills in

    def nearest(self, key: str, present: Any = ()) -> str | None:
        among = [*self.params.names, *(k for k in present if isinstance(k, str) and k != "type")]
        among = [k for k in among if k != key and k not in self.filled]
        close = difflib.get_close_matches(key, list(dict.fromkeys(among)), n=1, cutoff=0.6)
        return close[0] if close else None


def _settable(cls: Callable, registry: str | None) -> tuple[Parameters, tuple[str, ...]]:
    params = parameters_of(cls)
    filled = tuple(n for n in BUILDER_ARGS.get(registry, ()) if n in params.names)
    names = tuple(n for n in params.names if n not in filled) + BUILDER_KEYS.get(registry, ())
    return Parameters(names, params.open), filled


def _type_name(type_value: Any) -> str:
    return type_value if isinstance(type_value, str) else getattr(type_value, "__name__", repr(type_value))


def resolve(node: Any, path: str) -> Resolved | None:
    """What the dict ``node`` at ``path`` is built as, or None when that
    cannot be told. A ``type`` name unknown to the registry of its slot
    raises that registry's error (naming the closest registered names)."""
    if not isinstance(node, dict) or "type" not in node:
        return None
    type_value, slot = node["type"], slot_registry(path)
    if not isinstance(type_value, str):
        if not callable(type_value):
            return None
        params, filled = _settable(type_value, slot)
        return Resolved(f"{slot or 'type'} {_type_name(type_value)}", params, filled)
    return _resolve_name(type_value, slot)


class _UntilRegistration(dict):
    """A memo keyed by (type name, slot), emptied whenever anything is registered
    or removed (:func:`pimm.utils.registry.generation`). A config is checked
    after each ``--options`` entry and then whole, and its dicts repeat a few
    types: each is looked up in the registries once."""

    def __init__(self):
        super().__init__()
        self.generation = -1

    def current(self) -> "_UntilRegistration":
        if self.generation != generation():
            self.clear()
            self.generation = generation()
        return self


_RESOLVED = _UntilRegistration()  # (name, slot) -> Resolved | None
_CLASSES = _UntilRegistration()  # (name, slot) -> ((registry name, class), ...)


def _resolve_name(name: str, slot: str | None) -> Resolved | None:
    cache = _RESOLVED.current()
    if (name, slot) not in cache:
        cache[name, slot] = _resolve_registered(name, slot)  # an unknown name raises: never kept
    return cache[name, slot]


def _resolve_registered(name: str, slot: str | None) -> Resolved | None:
    own: list[Registry] = registries(slot) if slot else []
    if own and all(r.find(name) is None for r in own):
        own[0].get(name)  # raises the registry's closest-name error
    classes = _registered(name, slot)
    if not classes:
        return None
    parts = [_settable(cls, reg) for reg, cls in classes]
    names = tuple(dict.fromkeys(n for p, _ in parts for n in p.names))
    filled = tuple(dict.fromkeys(n for _, f in parts for n in f))
    kinds = "/".join(dict.fromkeys(reg for reg, _ in classes))
    return Resolved(f"{kinds} {name}", Parameters(names, any(p.open for p, _ in parts)), filled)


def _registered(name: str, slot: str | None) -> tuple[tuple[str, Callable], ...]:
    """The distinct (registry name, class) pairs ``name`` names: in the slot's
    registries, else (unknown position, or none of them has it) in every one."""
    cache = _CLASSES.current()
    if (name, slot) not in cache:
        own: list[Registry] = registries(slot) if slot else []
        found = [(r.name, r.find(name)) for r in own if r.find(name) is not None]
        if not found:
            found = [(r.name, r.find(name)) for r in registries() if r.find(name) is not None]
        cache[name, slot] = tuple({id(cls): (reg, cls) for reg, cls in found}.values())
    return cache[name, slot]


def _classes(node: Any, path: str) -> list[tuple[str, Callable]]:
    """The (registry name, class) pairs the dict ``node`` at ``path`` may be
    built as; [] when that cannot be told (no error for unknown names)."""
    if not isinstance(node, dict) or "type" not in node:
        return []
    type_value, slot = node["type"], slot_registry(path)
    if not isinstance(type_value, str):
        return [(slot or "type", type_value)] if callable(type_value) else []
    return list(_registered(type_value, slot))


def resolve_section(cfg: dict, path: str) -> Resolved | None:
    """What the plain dict at ``path`` takes when its parent is a registry-built
    dict whose class declares it an options section: ``config_sections =
    {"grpo": GRPOObjective}`` on a model says that ``model.grpo`` holds the
    keyword arguments of ``GRPOObjective`` (its parameters are then defined
    keys, listed or not). None when the parent declares no such section."""
    parent_path, _, key = path.rpartition(".")
    if not parent_path:
        return None
    parent: Any = cfg
    for seg in parent_path.split("."):
        if isinstance(parent, dict) and seg in parent:
            parent = parent[seg]
        elif isinstance(parent, (list, tuple)) and _INDEX.fullmatch(seg) and -len(parent) <= int(seg) < len(parent):
            parent = parent[int(seg)]
        else:
            return None
    sections = [getattr(cls, "config_sections", {}).get(key) for _, cls in _classes(parent, parent_path)]
    sections = [section for section in sections if section is not None]
    if not sections:
        return None
    params = parameters_of(sections[0])
    return Resolved(f"{path} ({sections[0].__name__} options)", params, ())


def _slot_nodes(node: Any, pattern: list[str], path: str = "", within: tuple[str, ...] = ()
                ) -> Iterator[tuple[str, Any]]:
    """The ``(path, node)`` pairs that match ``pattern``; with ``within`` (a path's
    segments) only those at or under that path, without walking the rest."""
    if not pattern:
        yield path, node
        return
    head, rest = pattern[0], pattern[1:]
    if isinstance(node, dict) and head not in ("*", "#") and head in node:
        children = [(head, node[head])]  # a named key: looked up, not scanned
    elif isinstance(node, dict):
        children = [(str(k), v) for k, v in node.items() if head == "*" or str(k) == head]
    elif isinstance(node, (list, tuple)) and head == "#":
        children = [(str(i), v) for i, v in enumerate(node)]
    else:
        return
    if within:
        children = [(key, child) for key, child in children if key == within[0]]
    for key, child in children:
        yield from _slot_nodes(child, rest, f"{path}.{key}" if path else key, within[1:])


def unknown_key_message(resolved: Resolved, key: str, node: dict, shown: str) -> str:
    """``shown`` is the key as the user wrote it (e.g. ``hooks.CheckpointSaver.save_frq``)."""
    if key in resolved.filled:
        return f"{shown}: {key!r} of {resolved.what} is filled in by the engine; it is not a config key"
    near = resolved.nearest(key, node)
    if near is not None:
        stem = shown.rpartition(".")[0]
        suggestion = f"{stem}.{near}" if stem else near
        hint = f"did you mean {suggestion!r}?"
    else:
        hint = f"it takes: {', '.join(resolved.params.names) or '(no parameters)'}"
    return f"{shown}: {resolved.what} has no parameter {key!r} ({hint})"


def check_registry_dicts(cfg: dict, within: str | None = None, context: str = "") -> None:
    """Check every registry-built dict at a slot (or only those at or under
    the path ``within``): its type must be registered and each key must be a
    parameter of the type. ``context`` prefixes the error (e.g. the option).

    Meant to run once the config is complete (after ``--options``), so that
    a misspelt key fails before anything is built, on one process."""
    segments = tuple(within.split(".")) if within else ()
    for pattern, _ in SLOTS:
        for path, node in _slot_nodes(cfg, pattern.split("."), within=segments):
            if within is not None and not (path == within or path.startswith(within + ".")):
                continue
            try:
                resolved = resolve(node, path)
            except RegistryError as err:
                where = "" if within in (path, f"{path}.type") else f"{path}: "
                raise RegistryError(f"{context}{where}{err}") from None
            if resolved is None:
                continue
            for key in node:
                if key == "type" or (resolved.params.accepts(key) and key not in resolved.filled):
                    continue
                raise ConfigError(context + unknown_key_message(resolved, key, node, f"{path}.{key}"))
