"""``--options`` overrides: parsing ``key=value`` tokens and applying them to a config.

The grammar (dotted keys, list indices, hook-type selectors, ``+key``,
literal-only values) is documented in ``docs/config.md``.
"""

from __future__ import annotations

import ast
import copy
import difflib
import re
from typing import Any, Iterable

from .config_dict import ConfigDict, to_config_value
from .errors import ConfigError

__all__ = ["apply_option", "parse_options", "parse_value"]

_OPTION_FORM = "expected key=value, e.g. optimizer.lr=0.01, hooks.2.save_freq=50 or +new_key=1"
_INT = re.compile(r"-?\d+")
_CALL = re.compile(r"[A-Za-z_][\w.]*\s*\(")
_NOT_PYTHON = {"true": "True", "false": "False", "none": "None", "null": "None"}


def parse_value(text: str, key: str = "value") -> Any:
    """A Python literal, or the text itself if it is a bare word such as
    ``exp/run1``; never evaluated as code."""
    try:
        return ast.literal_eval(text)
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
            f"types present: {', '.join(present) or '(none)'}; or use an index 0..{len(node) - 1}"
        )
    return matches


def apply_option(cfg: dict, key: str, value: Any, is_new: bool = False) -> None:
    """Set dotted ``key`` to ``value``. A non-integer segment on a list selects
    every dict entry whose ``type`` equals it. Without ``is_new`` the key must
    exist (in at least one selected entry); with it, missing parents are created
    as dicts. Each target gets its own copy of ``value``."""
    segments = key.split(".")
    targets: list[tuple[Any, str]] = [(cfg, "")]
    for depth, seg in enumerate(segments):
        last = depth == len(segments) - 1
        following: list[tuple[Any, str]] = []
        missing: list[tuple[dict, str]] = []
        for node, path in targets:
            here = f"{path}.{seg}" if path else seg
            if isinstance(node, dict):
                name = seg if seg in node else int(seg) if _INT.fullmatch(seg) and int(seg) in node else None
                if name is None:
                    missing.append((node, here))
                elif last:
                    node[name] = copy.deepcopy(value)
                else:
                    following.append((node[name], here))
            elif isinstance(node, (list, tuple)):
                for index in _list_indices(node, seg, key, path):
                    if not last:
                        following.append((node[index], here))
                    elif isinstance(node, tuple):
                        raise ConfigError(f"--options {key}: '{path}' is a tuple; set it whole, e.g. {path}=(1, 2)")
                    else:
                        node[index] = to_config_value(copy.deepcopy(value))
            else:
                raise ConfigError(
                    f"--options {key}: '{path}' is {node!r} ({type(node).__name__}), not a dict or list"
                )
        if missing and len(missing) == len(targets) and not is_new:
            close = difflib.get_close_matches(key, _config_paths(cfg), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown config key {key!r}{hint}; write +{key}=... to add a new key")
        for node, here in missing:
            node[seg] = copy.deepcopy(value) if last else ConfigDict()
            following.append((node[seg], here))
        targets = following
