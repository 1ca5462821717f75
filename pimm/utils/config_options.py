"""``--options`` overrides: parsing ``key=value`` tokens and applying them to a config.

The grammar (dotted keys, list indices, hook-type selectors, ``+key``,
literal-only values) is documented in ``docs/config.md``. A key the config
does not list is accepted when it is a parameter of the registry-built dict
it goes into (``hooks.CheckpointSaver.save_freq``): see ``config_slots``.
A whole command line is applied by :mod:`pimm.utils.config_merge`.
"""

from __future__ import annotations

import ast
import copy
import math
import difflib
import re
from typing import Any, Iterable

from .config_dict import ConfigDict, to_config_value
from .config_slots import resolve, resolve_section, unknown_key_message
from .errors import ConfigError, RegistryError

__all__ = ["apply_option", "parse_options", "parse_value"]

_OPTION_FORM = "expected key=value, e.g. optimizer.lr=0.01, hooks.2.save_freq=50 or +new_key=1"
_INT = re.compile(r"-?\d+")
_CALL = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_NOT_PYTHON = {"true": "True", "false": "False", "none": "None", "null": "None"}


_WORDS = {"true": True, "false": False, "null": None, "none": None}
# Non-finite floats as YAML and Python's float() spell them: read as floats, so
# that the numeric domains refuse them by name instead of a string slipping through.
_FLOAT_WORDS = {"nan": math.nan, "inf": math.inf, "infinity": math.inf}
_YAML_FLOATS = {".nan": math.nan, ".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf}


class _Habits(ast.NodeTransformer):
    """What YAML / Hydra users type, as literals: ``true``/``false``/``null``
    (also inside lists and dicts) and ``dict(k=v, ...)`` with literal values.
    Only rewrites the syntax tree; nothing is ever run."""

    def visit_Name(self, node):
        if node.id in _WORDS:
            return ast.copy_location(ast.Constant(_WORDS[node.id]), node)
        if node.id.lower() in _FLOAT_WORDS:
            return ast.copy_location(ast.Constant(_FLOAT_WORDS[node.id.lower()]), node)
        return node

    def visit_Call(self, node):
        self.generic_visit(node)
        if (isinstance(node.func, ast.Name) and node.func.id == "dict" and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return ast.copy_location(ast.Dict([ast.Constant(k.arg) for k in node.keywords],
                                              [k.value for k in node.keywords]), node)
        return node


def _literal_with_habits(text: str) -> Any:
    tree = ast.parse(text.strip(), mode="eval")
    return ast.literal_eval(_Habits().visit(tree))


def parse_value(text: str, key: str = "value") -> Any:
    """A Python literal, or the text itself if it is a bare word such as
    ``exp/run1``; never evaluated as code. ``true``/``false``/``null`` and
    ``dict(a=1)`` are read as ``True``/``False``/``None`` and ``{'a': 1}``;
    ``nan``, ``inf``, ``-inf`` (also YAML's ``.nan``, ``.inf``) as floats."""
    if text.strip().lower() in _YAML_FLOATS:
        return _YAML_FLOATS[text.strip().lower()]
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        pass
    try:
        return _literal_with_habits(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as err:
        stripped = text.strip()
        if _CALL.search(stripped):
            reason = "calls like name(...) are not allowed"
        elif stripped and stripped[0] in "[({'\"":
            reason = err.msg if isinstance(err, SyntaxError) else "it is not a valid literal"
        elif stripped.lower() in _NOT_PYTHON:
            raise ConfigError(
                f"bad value in --options {key}={text}: write {_NOT_PYTHON[stripped.lower()]} "
                f"(Python), or {key}='\"{text}\"' for the string"
            ) from None
        else:
            return text
        raise ConfigError(
            f"bad value in --options {key}={text}: {reason}; values are Python literals "
            "(int, float, bool, None, 'str', [list], (tuple,), {'dict': 1}) and are never run as code"
        ) from None


def parse_options(tokens: Iterable[str] | None) -> list[tuple[str, Any, bool]]:
    """``["a.b=1", "+c=x"]`` -> ``[("a.b", 1, False), ("c", "x", True)]``."""
    parsed = []
    for token in tokens or []:
        key, sep, text = str(token).partition("=")
        is_new = key.startswith("+")
        key = key[1:].strip() if is_new else key.strip()
        if sep and key.endswith("+"):  # ``hooks+=[...]``: Hydra/shell habit for appending
            name = key.rstrip("+").strip()
            raise ConfigError(f"bad --options entry {token!r}: to append to the list {name} write "
                              f"+{name}={text} (the '+' goes before the key); {name}={text} replaces it")
        if not sep or not key or "" in key.split("."):
            hint = "" if sep else " (quote values that contain spaces so they stay one word)"
            raise ConfigError(f"bad --options entry {token!r}: {_OPTION_FORM}{hint}")
        parsed.append((key, parse_value(text, key), is_new))
    return parsed


def _type_name(value: Any) -> Any:
    t = value.get("type") if isinstance(value, dict) else None
    return t if isinstance(t, str) or t is None else getattr(t, "__name__", t)


def _config_paths(node: Any, prefix: str = "") -> list[str]:
    """Every dotted path an option could name: keys, list indices and hook types."""
    out: list[str] = []
    if isinstance(node, dict):
        children = [(str(k), v) for k, v in node.items()]
    elif isinstance(node, (list, tuple)):
        children = [(str(i), v) for i, v in enumerate(node)]
        children += [(str(_type_name(v)), v) for v in node if isinstance(_type_name(v), str)]
    else:
        return out
    for name, child in children:
        path = f"{prefix}.{name}" if prefix else name
        out += [path, *_config_paths(child, path)]
    return list(dict.fromkeys(out))


def _default_hook_keys(cfg: dict, key: str) -> list[str]:
    """``hooks.<Type>...`` for a type no entry of the list has, but a named
    default hook has: the ``default_hooks.<name>...`` keys it means (SPEC: a
    type selector reaches a default hook of that type too). ``[key]`` otherwise."""
    segments = key.split(".")
    hooks, defaults = cfg.get("hooks"), cfg.get("default_hooks")
    if (len(segments) < 2 or segments[0] != "hooks" or _INT.fullmatch(segments[1])
            or not isinstance(hooks, (list, tuple)) or not isinstance(defaults, dict)
            or any(_type_name(entry) == segments[1] for entry in hooks)):
        return [key]
    names = [name for name, entry in defaults.items() if _type_name(entry) == segments[1]]
    return [".".join(["default_hooks", str(name), *segments[2:]]) for name in names] or [key]


def _list_indices(node: list | tuple, seg: str, key: str, path: str) -> list[int]:
    if _INT.fullmatch(seg):
        index = int(seg)
        if not -len(node) <= index < len(node):
            raise ConfigError(f"--options {key}: index {index} is out of range for '{path}' (a list of length {len(node)})")
        return [index % len(node)]
    matches = [i for i, v in enumerate(node) if _type_name(v) == seg]
    if not matches:
        present = sorted({str(t) for t in map(_type_name, node) if t is not None})
        raise ConfigError(
            f"--options {key}: no entry of '{path}' has type {seg!r}; "
            f"types present: {', '.join(present) or '(none)'}"
            + (f"; or use an index 0..{len(node) - 1}" if node else f" ('{path}' is empty)")
        )
    return matches


def _join(path: str, seg: str) -> str:
    return f"{path}.{seg}" if path else seg


def _unknown_key(cfg: dict, key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _config_paths(cfg), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    head, _, rest = key.partition(".")
    if head == "default_hooks" and "." not in rest and isinstance(cfg.get(head), dict):
        # Named runtime services: there is no adding one here (any other hook goes in `hooks`).
        return ConfigError(f"unknown config key {key!r}{hint}; default_hooks names: "
                           f"{', '.join(map(str, cfg[head]))} (list any other hook in `hooks`)")
    return ConfigError(f"unknown config key {key!r}{hint}; write +{key}=... to add a new key")


def _check_parameter(cfg: dict, key: str, seg: str, last: bool, missing: list[tuple[dict, str, str]],
                     unresolved_ok: bool = False) -> None:
    """A key the config does not list is still defined when it is a parameter
    of the registry-built dict it goes into (only as the last segment: a
    missing dict on the way is not created without ``+``). ``unresolved_ok``:
    a key of a registry-built dict whose type no live registry knows yet is
    accepted (checked with the whole config once the registries are imported)."""
    if not last:
        raise _unknown_key(cfg, key)
    for node, _, where in missing:
        try:
            resolved = resolve(node, where)
        except RegistryError as err:
            if unresolved_ok:
                continue
            raise RegistryError(f"--options {key}: {err}") from None
        if resolved is None:
            resolved = resolve_section(cfg, where)  # e.g. model.grpo: the objective's options
        if resolved is None:
            if unresolved_ok and isinstance(node, dict) and "type" in node:
                continue
            raise _unknown_key(cfg, key)
        if seg in resolved.filled or not resolved.params.accepts(seg):
            raise ConfigError("--options " + unknown_key_message(resolved, seg, node, key))


def apply_option(cfg: dict, key: str, value: Any, is_new: bool = False, unresolved_ok: bool = False) -> list[str]:
    """Set dotted ``key`` to ``value``. A non-integer segment on a list selects
    every dict entry whose ``type`` equals it; ``hooks.<Type>`` with no such
    entry in the list selects the named default hook(s) of that type
    (``default_hooks.<name>``). Without ``is_new`` the key must
    exist (in at least one selected entry) or be a parameter of the
    registry-built dict it goes into (``unresolved_ok``: or of one whose type
    is not registered yet); with it, missing parents are created as
    dicts, and a list value on a list the config has is appended to it. Each target gets its own copy of ``value``. Returns the paths set,
    with list entries by index (``hooks.4.save_freq``)."""
    return [path for target in _default_hook_keys(cfg, key)
            for path in _apply_one(cfg, target, key, value, is_new, unresolved_ok)]


def _apply_one(cfg: dict, key: str, shown: str, value: Any, is_new: bool, unresolved_ok: bool) -> list[str]:
    segments = key.split(".")
    targets: list[tuple[Any, str, str]] = [(cfg, "", "")]  # node, path as written, path by index
    written: list[str] = []
    for depth, seg in enumerate(segments):
        last = depth == len(segments) - 1
        following: list[tuple[Any, str, str]] = []
        missing: list[tuple[dict, str, str]] = []
        for node, path, where in targets:
            here = _join(path, seg)
            if isinstance(node, dict):
                name = seg if seg in node else int(seg) if _INT.fullmatch(seg) and int(seg) in node else None
                if name is None:
                    missing.append((node, here, where))
                elif last and is_new and isinstance(node[name], list) and isinstance(value, (list, tuple)):
                    # ``+hooks=[dict(type="EMAHook")]``: ``+`` on a list the config has appends to it.
                    start = len(node[name])
                    node[name].extend(to_config_value(copy.deepcopy(v)) for v in value)
                    written += [_join(where, f"{name}.{i}") for i in range(start, len(node[name]))]
                elif last:
                    node[name] = copy.deepcopy(value)
                    written.append(_join(where, str(name)))
                else:
                    following.append((node[name], here, _join(where, str(name))))
            elif isinstance(node, (list, tuple)):
                for index in _list_indices(node, seg, shown, path):
                    at = _join(where, str(index))
                    if not last:
                        following.append((node[index], here, at))
                    elif isinstance(node, tuple):
                        raise ConfigError(f"--options {shown}: '{path}' is a tuple; set it whole, e.g. {path}=(1, 2)")
                    else:
                        node[index] = to_config_value(copy.deepcopy(value))
                        written.append(at)
            else:
                raise ConfigError(
                    f"--options {shown}: '{path}' is {node!r} ({type(node).__name__}), not a dict or list"
                )
        if missing and len(missing) == len(targets) and not is_new:
            _check_parameter(cfg, shown, seg, last, missing, unresolved_ok)
        for node, here, where in missing:
            node[seg] = copy.deepcopy(value) if last else ConfigDict()
            following.append((node[seg], here, _join(where, seg)))
            if last:
                written.append(_join(where, seg))
        targets = following
    return written
