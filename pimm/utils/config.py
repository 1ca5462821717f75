"""Python config files: loading with ``_base_`` inheritance, ``--options``
overrides, and writing a resolved config back to a loadable file.

A config is a Python file; its top-level names are the keys. A config can
inherit from others (``_base_``), pull in user modules whose classes it names
(``custom_imports``), be edited from the command line (``--options``), and is
written into the run directory as ``config.py`` so that training from that
file reproduces the run. The user-facing rules are in ``docs/config.md``.
"""

from __future__ import annotations

import ast
import builtins
import copy
import difflib
import importlib
import keyword
import math
import os
import re
import sys
import traceback
import types
from pathlib import Path
from typing import Any, Iterable

from .errors import ConfigError

__all__ = ["Config", "ConfigDict", "ConfigError", "apply_option", "parse_options", "parse_value"]

BASE_KEY = "_base_"
DELETE_KEY = "_delete_"
IMPORTS_KEY = "custom_imports"
# ``__name__`` of an executing config file; objects defined there cannot be imported back.
_CONFIG_MODULE = "__pimm_config__"


def _convert(value: Any) -> Any:
    """Deep-convert dicts, also inside lists and tuples, to ConfigDict."""
    if isinstance(value, ConfigDict):
        return value
    if isinstance(value, dict):
        return ConfigDict(value)
    if type(value) is list:
        return [_convert(v) for v in value]
    if type(value) is tuple:
        return tuple(_convert(v) for v in value)
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    return value


class ConfigDict(dict):
    """A dict whose (nested) keys can also be read and written as attributes.

    Keys that collide with dict methods (``items``, ``keys``, ``update``, ...)
    must be accessed with ``cfg["items"]``."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__()
        self.update(*args, **kwargs)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _convert(value))

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

    def copy(self) -> "ConfigDict":
        return copy.copy(self)

    def to_dict(self) -> dict:
        """Plain nested dicts and lists (tuples stay tuples)."""
        return _plain(self)


class Config(ConfigDict):
    """A whole config: a ConfigDict plus the file it came from (``filename``,
    kept outside the data, so it does not affect equality or dumping)."""

    def __init__(self, cfg_dict: dict | None = None, filename: str | os.PathLike | None = None):
        super().__init__(cfg_dict or {})
        object.__setattr__(self, "_filename", str(filename) if filename is not None else None)

    @property
    def filename(self) -> str | None:
        return self.__dict__.get("_filename")

    def __repr__(self) -> str:
        return f"Config(filename={self.filename!r}, {dict.__repr__(self)})"

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        # Pickle restores the items before this state, so a spawned worker that
        # receives the config re-imports the user modules and their registrations.
        source = self.filename or "unpickled config"
        _import_modules(_as_names(self.get(IMPORTS_KEY), IMPORTS_KEY, source), source)

    @classmethod
    def fromfile(cls, path: str | os.PathLike) -> "Config":
        """Load a Python config file, resolving ``_base_`` and ``custom_imports``."""
        resolved = Path(os.path.expanduser(path)).resolve()
        return cls(_load_file(resolved, None, ()), filename=resolved)

    def merge_from_options(self, tokens: Iterable[str] | None) -> None:
        """Apply ``--options`` tokens (``key=value``, ``+key=value``) in order.
        All tokens are parsed before any is applied."""
        for key, value, is_new in parse_options(tokens):
            apply_option(self, key, value, is_new)

    @property
    def pretty_text(self) -> str:
        """The config as Python source, for logs (never raises)."""
        return _to_source(self, strict=False)

    def dump(self, path: str | os.PathLike | None = None) -> str:
        """Return the config as a Python file that ``Config.fromfile`` loads
        back to an equal config, and write it to ``path`` if given."""
        text = f"# pimm config{f' (resolved from {self.filename})' if self.filename else ''}\n"
        text += _to_source(self, strict=True)
        if path is not None:
            path = Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, path)  # readers never see a half-written file
        return text


# --------------------------------------------------------------------------- loading


def _load_file(path: Path, included_by: Path | None, chain: tuple[Path, ...]) -> dict:
    where = f" (listed in _base_ of {included_by})" if included_by else ""
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}{where}")
    if path in chain:
        raise ConfigError("circular _base_: " + " -> ".join(str(p) for p in (*chain, path)))
    namespace, bound = _execute(path)
    own = {k: v for k, v in namespace.items() if _is_config_key(k, v, bound)}
    if IMPORTS_KEY in own:
        own[IMPORTS_KEY] = _as_names(own[IMPORTS_KEY], IMPORTS_KEY, path)
        _import_modules(own[IMPORTS_KEY], path)
    merged: dict = {}
    for base in _as_names(namespace.get(BASE_KEY), BASE_KEY, path):
        base_path = Path(os.path.expanduser(base))
        base_path = (base_path if base_path.is_absolute() else path.parent / base_path).resolve()
        merged = _merge_layer(merged, _load_file(base_path, path, (*chain, path)))
    return _merge_layer(merged, own)


def _execute(path: Path) -> tuple[dict, tuple[set, set]]:
    """Run a config file; return its namespace and (names bound by assignment,
    names bound by import/def/class) at top level."""
    try:
        source = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    try:
        tree = ast.parse(source, str(path))
        code = compile(tree, str(path), "exec")
    except SyntaxError as err:
        raise ConfigError(f"syntax error in config {path}:{err.lineno}: {err.msg}") from None
    namespace: dict = {"__file__": str(path), "__name__": _CONFIG_MODULE}
    try:
        exec(code, namespace)
    except Exception as err:
        frames = [f.lineno for f in traceback.extract_tb(err.__traceback__) if f.filename == str(path)]
        at = f"{path}:{frames[-1]}" if frames else str(path)
        raise ConfigError(f"error while executing config {at}: {type(err).__name__}: {err}") from err
    return namespace, _top_level_bindings(tree)


def _top_level_bindings(tree: ast.AST) -> tuple[set, set]:
    assigned: set = set()
    imported: set = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                imported.add(child.name)
                continue  # names inside are not top level
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in child.names)
            elif isinstance(child, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                assigned.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            visit(child)

    visit(tree)
    return assigned, imported


def _is_config_key(name: str, value: Any, bound: tuple[set, set]) -> bool:
    """Top-level names that are config data: not private, not modules, not
    imported/defined helpers (``type=SomeClass`` inside a dict is kept)."""
    assigned, imported = bound
    if name.startswith("_") or isinstance(value, types.ModuleType):
        return False
    if name in assigned:
        return True
    # Star imports bind names the AST cannot see; classes/functions among them are helpers.
    return name not in imported and not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType))


def _as_names(value: Any, key: str, source: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, os.PathLike)):
        value = [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, (str, os.PathLike)) and str(v) for v in value):
        return [os.fspath(v) for v in value]
    raise ConfigError(f"{source}: {key} must be a string or a list of strings, got {value!r}")


def _import_modules(names: list[str], source: Any) -> None:
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


def _strip_delete(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_delete(v) for k, v in value.items() if k != DELETE_KEY}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_strip_delete(v) for v in value)
    return value


def _merge(base: dict, child: dict) -> dict:
    """Child on top of base: dicts merge recursively unless the child dict has
    ``_delete_=True``; everything else (lists included) replaces."""
    out = dict(base)
    for key, value in child.items():
        if key == DELETE_KEY:
            continue
        if isinstance(value, dict) and isinstance(out.get(key), dict) and not value.get(DELETE_KEY, False):
            out[key] = _merge(out[key], value)
        else:
            out[key] = _strip_delete(value)
    return out


def _merge_layer(base: dict, child: dict) -> dict:
    # custom_imports accumulate: every layer's classes must stay importable
    # when the resolved config is reloaded from the run directory.
    imports = list(dict.fromkeys([*base.get(IMPORTS_KEY, []), *child.get(IMPORTS_KEY, [])]))
    merged = _merge(base, child)
    if imports:
        merged[IMPORTS_KEY] = imports
    return merged


# --------------------------------------------------------------------------- --options

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
                        node[index] = _convert(copy.deepcopy(value))
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


# --------------------------------------------------------------------------- dumping

_WIDTH = 100


class _SourceWriter:
    """Formats values as Python expressions, collecting the import lines that
    classes and functions need."""

    def __init__(self, top_keys: list[str], strict: bool):
        self.strict = strict
        self.shadowed = set(top_keys) & set(dir(builtins))
        self.taken = set(top_keys) | {"dict", "float", "set", "frozenset"}
        self.imports: dict[tuple[str, str], str] = {}  # (module, name) -> local name

    def builtin(self, name: str) -> str:
        return f"__import__('builtins').{name}" if name in self.shadowed else name

    def fail(self, path: str, value: Any, why: str) -> str:
        if self.strict:
            raise ConfigError(f"cannot write config key '{path}' to a config file: {value!r} {why}")
        return repr(value)

    def reference(self, obj: Any, path: str) -> str:
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
        if not module or "<" in qualname:
            return self.fail(path, obj, "is a lambda or local object; use a function or class of an importable module")
        if module in ("__main__", _CONFIG_MODULE):
            return self.fail(path, obj, f"is defined in {module}; move it into an importable module")
        try:
            target: Any = importlib.import_module(module)
            for part in qualname.split("."):
                target = getattr(target, part)
            same = target is obj or target == obj
        except Exception:
            same = False
        if not same:
            return self.fail(path, obj, f"cannot be imported back as {module}.{qualname}")
        head, _, rest = qualname.partition(".")
        if module == "builtins":
            return self.builtin(head) + (f".{rest}" if rest else "")
        if (module, head) not in self.imports:
            alias, n = head, 0
            while alias in self.taken:
                n += 1
                alias = f"{head}_{n}"
            self.taken.add(alias)
            self.imports[(module, head)] = alias
        return self.imports[(module, head)] + (f".{rest}" if rest else "")

    def inline(self, v: Any, path: str) -> str:
        if v is None or type(v) in (bool, str, bytes, complex):
            return repr(v)
        if isinstance(v, int) and not isinstance(v, bool):
            return int.__repr__(v)  # int subclasses (IntEnum) are written as their value
        if isinstance(v, str):
            return str.__repr__(v)
        if isinstance(v, float):
            if math.isfinite(v):
                return float.__repr__(float(v))
            return f"{self.builtin('float')}({str(float(v))!r})"
        if isinstance(v, dict):
            if self.keyword_form(v):
                inner = ", ".join(f"{k}={self.inline(x, f'{path}.{k}')}" for k, x in v.items())
                return f"dict({inner})"
            return "{" + ", ".join(f"{self.inline(k, path)}: {self.inline(x, f'{path}.{k}')}" for k, x in v.items()) + "}"
        if isinstance(v, (list, tuple, set, frozenset)):
            items = [self.inline(x, f"{path}.{i}") for i, x in enumerate(v)]
            if isinstance(v, list):
                return "[" + ", ".join(items) + "]"
            if isinstance(v, tuple):
                return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
            body = "{" + ", ".join(items) + "}" if items else ""
            return f"{self.builtin('frozenset')}({body})" if isinstance(v, frozenset) else body or f"{self.builtin('set')}()"
        if isinstance(v, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            return self.reference(v, path)
        return self.fail(path, v, f"({type(v).__name__}) is not a Python literal; use a literal such as a string")

    def keyword_form(self, d: dict) -> bool:
        # ``dict(a=1)`` reads like a hand-written config; ``{...}`` when keys are not names.
        return "dict" not in self.shadowed and all(isinstance(k, str) and k.isidentifier() and not keyword.iskeyword(k) for k in d)

    def block(self, v: Any, path: str, indent: int) -> str:
        """Like inline, but spread over lines (one item per line) when too long."""
        text = self.inline(v, path)
        if indent + len(text) <= _WIDTH or not isinstance(v, (dict, list, tuple)) or not v:
            return text
        pad = " " * (indent + 4)
        if isinstance(v, dict):
            kw = self.keyword_form(v)
            lines = [
                (f"{pad}{k}=" if kw else f"{pad}{self.inline(k, path)}: ") + self.block(x, f"{path}.{k}", indent + 4) + ","
                for k, x in v.items()
            ]
            opening, closing = ("dict(", ")") if kw else ("{", "}")
        else:
            lines = [pad + self.block(x, f"{path}.{i}", indent + 4) + "," for i, x in enumerate(v)]
            opening, closing = ("[", "]") if isinstance(v, list) else ("(", ")")
        return opening + "\n" + "\n".join(lines) + "\n" + " " * indent + closing


def _to_source(cfg: dict, strict: bool) -> str:
    for key in cfg:
        if strict and not (isinstance(key, str) and key.isidentifier() and not keyword.iskeyword(key)
                           and not key.startswith("_")):
            raise ConfigError(
                f"cannot write top-level config key {key!r} to a config file: "
                "top-level keys must be Python names that do not start with '_'"
            )
    writer = _SourceWriter([k for k in cfg if isinstance(k, str)], strict)
    body = [f"{key} = {writer.block(value, str(key), 0)}" for key, value in cfg.items()]
    imports = [f"from {m} import {n}" + (f" as {a}" if a != n else "") for (m, n), a in writer.imports.items()]
    return "\n".join([*imports, *([""] if imports else []), *body]) + "\n"
