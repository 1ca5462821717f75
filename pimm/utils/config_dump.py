"""Writing a resolved config back as a Python file that loads to an equal config."""

from __future__ import annotations

import builtins
import importlib
import keyword
import math
import types
from typing import Any

from .errors import ConfigError

# ``__name__`` of an executing config file; objects defined there cannot be imported back.
_CONFIG_MODULE = "__pimm_config__"

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
