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
import json
import os
import traceback
import types
from pathlib import Path
from typing import Any, Iterable

from .config_dict import ConfigDict
from .config_dump import _CONFIG_MODULE, _to_source
from .config_imports import IMPORTS_KEY, as_names, import_modules
# The option helpers stay importable from here (``from pimm.utils.config import parse_options``).
from .config_merge import merge_options
from .config_options import apply_option, parse_options, parse_value  # noqa: F401
# Upstream's `--options KEY=VALUE` action, for scripts that import it from here.
from .dict_action import DictAction  # noqa: F401
from .errors import ConfigError
from .redaction import redact_secrets

__all__ = ["Config", "ConfigDict", "ConfigError", "config_file_path"]


BASE_KEY = "_base_"
OPTIONS_HEADER = "# options: "
DELETE_KEY = "_delete_"
#: ``_base_ = "pimm://_base_/default_runtime.py"``: a config shipped inside the package.
PACKAGE_SCHEME = "pimm://"
PACKAGE_CONFIGS = Path(__file__).resolve().parents[1] / "configs"


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
        import_modules(as_names(self.get(IMPORTS_KEY), IMPORTS_KEY, source), source)

    @classmethod
    def fromfile(cls, path: str | os.PathLike) -> "Config":
        """Load a Python config file, resolving ``_base_`` and ``custom_imports``, then
        upstream's ``hooks_override`` (:mod:`pimm.utils.hooks_override`)."""
        from .hooks_override import apply_hooks_override

        resolved = config_file_path(path)
        cfg = cls(_load_file(resolved, None, ()), filename=resolved)
        apply_hooks_override(cfg)
        return cfg

    def merge_from_options(self, tokens: Iterable[str] | None) -> None:
        """Apply ``--options`` tokens (``key=value``, ``+key=value``) in order.
        All tokens are parsed before any is applied; modules the options add
        to ``custom_imports`` are imported before any registry type is checked."""
        merge_options(self, tokens)

    @property
    def command_options(self) -> list[str]:
        """The ``--options`` of the command line(s) that made this config, in
        order; written into the header of a dumped file, so that a resume can
        apply a run's own overrides again (:mod:`pimm.engines.run.resume_config`)."""
        return list(self.__dict__.get("_options", ()))

    def set_command_options(self, tokens) -> None:
        """Record the ``--options`` tokens that made this config (see :attr:`command_options`)."""
        object.__setattr__(self, "_options", [str(t) for t in tokens])

    @classmethod
    def recorded_options(cls, path: str | os.PathLike) -> list[str] | None:
        """The options in a dumped file's header, or None when it has none."""
        try:
            with open(path, encoding="utf-8") as handle:
                head = [handle.readline() for _ in range(2)]
        except (OSError, UnicodeDecodeError):
            return None
        for line in head:
            if line.startswith(OPTIONS_HEADER):
                try:
                    tokens = json.loads(line[len(OPTIONS_HEADER):])
                except ValueError:
                    return None
                return [str(t) for t in tokens] if isinstance(tokens, list) else None
        return None

    @property
    def pretty_text(self) -> str:
        """The config as Python source, for logs (never raises; secrets redacted:
        :func:`pimm.utils.redaction.redact_secrets`)."""
        return _to_source(redact_secrets(self), strict=False)

    def dump(self, path: str | os.PathLike | None = None) -> str:
        """Return the config as a Python file that ``Config.fromfile`` loads
        back to an equal config, and write it to ``path`` if given."""
        text = f"# pimm config{f' (resolved from {self.filename})' if self.filename else ''}\n"
        if self.command_options:
            text += f"{OPTIONS_HEADER}{json.dumps(self.command_options)}\n"
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
        own[IMPORTS_KEY] = as_names(own[IMPORTS_KEY], IMPORTS_KEY, path)
        import_modules(own[IMPORTS_KEY], path)
    merged: dict = {}
    for base in as_names(namespace.get(BASE_KEY), BASE_KEY, path):
        merged = _merge_layer(merged, _load_file(_base_path(base, path), path, (*chain, path)))
    return _merge_layer(merged, own)


def config_file_path(path: str | os.PathLike) -> Path:
    """The absolute path of a config file named on the command line or to
    :meth:`Config.fromfile`: ``pimm://REL`` is a config shipped in the package
    (as in ``_base_``), anything else a path (``~`` expanded)."""
    if str(path).startswith(PACKAGE_SCHEME):
        return _package_config(str(path), f"config file {str(path)!r}")
    return Path(os.path.expanduser(path)).resolve()


def _package_config(name: str, where: str) -> Path:
    """``pimm://REL``: ``pimm/configs/REL``, found from any directory; a name
    pimm does not ship is a ConfigError listing those it does."""
    relative = name[len(PACKAGE_SCHEME):]
    target = (PACKAGE_CONFIGS / relative).resolve()
    if not relative or PACKAGE_CONFIGS not in target.parents or not target.is_file():
        shipped = sorted(f"{PACKAGE_SCHEME}{p.relative_to(PACKAGE_CONFIGS).as_posix()}"
                         for p in PACKAGE_CONFIGS.rglob("*.py"))
        raise ConfigError(f"{where}: pimm ships no such config (it ships {', '.join(shipped) or 'none'})")
    return target


def _base_path(base: str, including: Path) -> Path:
    """Where a ``_base_`` entry points: ``pimm://REL`` is a config shipped in the
    package (``pimm/configs/REL``, e.g. ``pimm://_base_/default_runtime.py``),
    found from any directory; any other path is relative to the including file
    (``~`` expanded)."""
    if base.startswith(PACKAGE_SCHEME):
        return _package_config(base, f"_base_ {base!r} in {including}")
    base_path = Path(os.path.expanduser(base))
    return (base_path if base_path.is_absolute() else including.parent / base_path).resolve()


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
    except (Exception, SystemExit) as err:  # a config that calls sys.exit() is bad input too
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
