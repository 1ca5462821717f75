"""Checking a resolved config against the declared argument domains.

Every ``dict(type=...)`` in the config (at a slot or nested, e.g.
``model.backbone`` or a loss in ``model.criteria``) is resolved to its class
as :mod:`pimm.utils.config_slots` does; each key it sets is checked against
that class's domain (:mod:`pimm.utils.domains`), then the class's rules run
on its arguments with the defaults filled in (a ``ConfigRule`` also sees the
whole config: a model's relation to its data). An options section a class
declares (``config_sections``: ``model.grpo`` holds ``GRPOObjective``'s
arguments) is checked the same way. The launcher calls
:func:`check_config_domains` once the config is complete (file, ``--options``)
and before any hook, model or run directory is made.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterator

from .config_slots import BUILDER_ARGS, _classes, slot_registry
from .domains import Bool, ConfigRule, Domain, Int, OneOf, Real, Rule, Text, as_domain, show
from .errors import ConfigError
from .registry import generation, registries

__all__ = ["domains_of", "undeclared", "check_config_domains", "arguments_of", "ask_class", "answers_with",
           "BUILDER_KEY_DOMAINS"]

# Keys the builder takes itself (config_slots.BUILDER_KEYS), with their domains.
BUILDER_KEY_DOMAINS: dict[str, dict[str, Domain]] = {
    "hook": {"priority": OneOf(Text("a priority name like 'HIGH'"), Int(0, 100))},
}


def _own_parameters(target: Callable) -> list[inspect.Parameter]:
    try:
        params = inspect.signature(target).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _parameters(cls: Callable) -> dict[str, inspect.Parameter]:
    """The constructor's parameters and, while it forwards ``**kwargs``, its parents'."""
    out: dict[str, inspect.Parameter] = {}
    if not inspect.isclass(cls):
        return {p.name: p for p in _own_parameters(cls)}
    for klass in cls.__mro__:
        if klass is object or "__init__" not in vars(klass):
            continue
        try:
            params = list(inspect.signature(klass.__init__).parameters.values())[1:]
        except (TypeError, ValueError):
            break
        for p in params:
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                out.setdefault(p.name, p)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return out


def domains_of(cls: Callable) -> tuple[dict[str, Domain], tuple[Rule, ...]]:
    """See :func:`_domains_of` (cached until the next registration)."""
    try:
        return _domains_cached(cls, generation())
    except TypeError:  # an unhashable callable
        return _domains_of(cls)


@functools.lru_cache(maxsize=1024)
def _domains_cached(cls: Callable, _generation: int) -> tuple[dict[str, Domain], tuple[Rule, ...]]:
    return _domains_of(cls)


def _domains_of(cls: Callable) -> tuple[dict[str, Domain], tuple[Rule, ...]]:
    """The declared domains and rules of ``cls``: its ``domains``/``domain_rules``
    along the MRO (a subclass declares only its own arguments), those given to
    ``register_module(domains=...)``, and a bool for every argument whose
    default is True/False."""
    declared: dict[str, Any] = {}
    rules: list[Rule] = []
    chain = reversed(cls.__mro__) if inspect.isclass(cls) else [cls]
    for klass in chain:
        own = vars(klass) if inspect.isclass(klass) else getattr(klass, "__dict__", {})
        declared.update(own.get("domains") or {})
        rules += list(own.get("domain_rules") or ())
    for registry in registries():
        extra, extra_rules = registry.declared_domains(cls)
        declared.update(extra)
        rules += [r for r in extra_rules if r not in rules]
    out = {name: as_domain(spec) for name, spec in declared.items()}
    for name, p in _parameters(cls).items():
        if name not in out and isinstance(p.default, bool):
            out[name] = Bool
    return out, tuple(rules)


def undeclared(cls: Callable, registry: str) -> list[str]:
    """Arguments of ``cls`` a config can set that have no declared domain."""
    domains, _ = domains_of(cls)
    filled = BUILDER_ARGS.get(registry, ())
    names = [p.name for p in _own_parameters(cls)]
    return [n for n in names if n not in filled and n not in domains]


def _label(node: Any, index: int, siblings: list) -> str:
    name = node.get("type") if isinstance(node, dict) else None
    if isinstance(name, str) and sum(isinstance(s, dict) and s.get("type") == name for s in siblings) == 1:
        return name
    return str(index)


def _children(node: Any, shown: str) -> Iterator[tuple[str, str, Any]]:
    """(index path, shown path, child): the shown path names list entries by type."""
    if isinstance(node, dict):
        for key, child in node.items():
            yield str(key), f"{shown}.{key}" if shown else str(key), child
    elif isinstance(node, (list, tuple)):
        items = list(node)
        for i, child in enumerate(items):
            yield str(i), f"{shown}.{_label(child, i, items)}" if shown else str(i), child


def arguments_of(cls: Callable, node: dict) -> dict:
    """The arguments ``cls`` is built with from the config dict ``node``: its
    keys (``type`` aside) over the constructor's defaults."""
    args = {n: p.default for n, p in _parameters(cls).items() if p.default is not inspect.Parameter.empty}
    args.update((k, v) for k, v in node.items() if k != "type")
    return args


def ask_class(node: Any, path: str, question: str) -> Any:
    """What the class the dict ``node`` (at ``path``) is built as answers to
    ``question``: its classmethod of that name called with the node's
    arguments, defaults filled in. None when the type is unknown or does not
    answer. How a type tells others about its config (the classes a model
    predicts, the keys a transform hands on) without them knowing the type."""
    found = _classes(node, path)
    answer = getattr(found[0][1], question, None) if found else None
    return answer(arguments_of(found[0][1], node)) if callable(answer) else None


def answers_with(argument: str) -> classmethod:
    """A class's answer to an :func:`ask_class` question that is one of its own
    arguments, e.g. ``output_classes = answers_with("num_classes")``."""
    return classmethod(lambda cls, args: args.get(argument))


def _check_arguments(cls: Callable, node: dict, shown: str, registry: str | None, cfg: dict) -> None:
    domains, rules = domains_of(cls)
    domains = {**BUILDER_KEY_DOMAINS.get(registry or "", {}), **domains}
    for key, value in node.items():
        if key == "type":
            continue
        domain = domains.get(key)
        if domain is not None:
            domain(f"{shown}.{key}", value)
    if rules:
        args = arguments_of(cls, node)
        for rule in rules:
            if not all(name in args for name in getattr(rule, "names", (rule.key,))):
                continue
            if isinstance(rule, ConfigRule):
                rule.check_config(args, cfg, f"{shown}.")
            else:
                rule.check(args, f"{shown}.")


def _walk(node: Any, path: str, shown: str, cfg: dict) -> None:
    if isinstance(node, dict) and "type" in node:
        if not isinstance(node["type"], str) and not callable(node["type"]):
            what = slot_registry(path) or "registered type"
            raise ConfigError(f"{shown}.type={show(node['type'])} is invalid: it takes the name of a {what} "
                              "(or the class itself)")
        found = _classes(node, path)
        if found:
            registry, cls = found[0]
            _check_arguments(cls, node, shown, registry, cfg)
            for key, section in (getattr(cls, "config_sections", None) or {}).items():
                if isinstance(node.get(key), dict):
                    _check_arguments(section, node[key], f"{shown}.{key}", None, cfg)
    for index, child_shown, child in _children(node, shown):
        if isinstance(child, (dict, list, tuple)):
            _walk(child, f"{path}.{index}" if path else index, child_shown, cfg)


# A ``param_dicts`` entry: which parameters (``keyword``), a factor on the base lr, and the optimizer's own options.
PARAM_GROUP_DOMAINS: dict[str, Domain] = {"keyword": Text("a substring of parameter names"),
                                          "lr_scale": Real(0, 1e6)}


def _check_param_dicts(cfg: dict) -> None:
    """Each ``param_dicts`` entry's options take the optimizer's domains (one optimizer;
    with several, ``param_dicts`` is keyed by part and each part's optimizer builds its own)."""
    entries, optimizer = cfg.get("param_dicts"), cfg.get("optimizer")
    if not isinstance(entries, (list, tuple)) or not isinstance(optimizer, dict):
        return
    found = _classes(optimizer, "optimizer")
    domains = {**(domains_of(found[0][1])[0] if found else {}), **PARAM_GROUP_DOMAINS}
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ConfigError(f"param_dicts.{index}={show(entry)} is invalid: it takes a dict like "
                              "dict(keyword='bias', weight_decay=0.0)")
        for key, value in entry.items():
            if key in domains:
                domains[key](f"param_dicts.{index}.{key}", value)


def check_config_domains(cfg: dict) -> None:
    """Check every registry-built dict of ``cfg`` against its declared domains;
    the first bad value raises a one-line ConfigError naming the key."""
    for key, value in cfg.items():
        if isinstance(value, (dict, list, tuple)) and not str(key).startswith("_"):
            _walk(value, str(key), str(key), cfg)
    _check_param_dicts(cfg)
