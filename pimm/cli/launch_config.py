"""The launch settings of one ``pimm launch`` / ``pimm submit`` command line,
resolved: the YAML layers merged (:mod:`pimm.cli.sites`), the flags on top,
``{placeholders}`` expanded, the ``--`` tail turned into ``--options`` tokens,
and the training config found by name.

The tail (everything after a bare ``--``) is ``KEY=VALUE`` tokens that patch
the Python experiment config, as upstream's: the value is read as YAML
(``epoch=2``, ``use_wandb=False``, ``data.train.max_len=32``,
``optimizer.betas=[0.9,0.99]``, ``x={a: 1}``) and handed to pimm's
``--options`` as the same value; every rule of ``--options`` holds (an unknown
key names the nearest one, ...). A token without ``=`` or starting with ``--``
is one error line.
"""

from __future__ import annotations

import copy
import datetime as dt
import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pimm.cli import launch_schema, sites
from pimm.utils.errors import ConfigError, UserError

__all__ = ["Resolved", "resolve", "split_tail", "tail_options", "option_token", "find_config", "list_configs",
           "timestamp"]

# {key} or {dotted.key}; ${NAME} is the shell's and left alone.
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def timestamp() -> str:
    """The launch time as upstream names runs: ``YYYY-mm-dd_HH-MM-SS``."""
    return dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")


def split_tail(argv: list[str]) -> tuple[list[str], list[str]]:
    """``(launcher flags, tail)`` around the first bare ``--``."""
    if "--" not in argv:
        return list(argv), []
    at = argv.index("--")
    return list(argv[:at]), list(argv[at + 1:])


def option_token(key: str, value: Any, raw: str | None = None) -> str:
    """``key=text`` for pimm's ``--options`` that gives ``value`` (a YAML value;
    ``raw`` is the text it was read from, when it came from the command line)."""
    def plain(v) -> bool:
        if isinstance(v, (list, tuple)):
            return all(plain(x) for x in v)
        if isinstance(v, dict):
            return all(plain(k) and plain(x) for k, x in v.items())
        return v is None or isinstance(v, (bool, int, float, str))

    if isinstance(value, str):
        quoted = raw is not None and raw.strip()[:1] in ("'", '"')
        return f"{key}={value!r}" if quoted else f"{key}={value}"
    if plain(value):
        return f"{key}={value!r}"
    return f"{key}={raw if raw is not None else value}"  # a YAML date and the like: pimm reads the text


def tail_options(tail: list[str]) -> list[tuple[str, Any, str]]:
    """``[(key, YAML value, raw text)]`` of the tail; one error line for a bad token."""
    yaml = sites._yaml()
    out = []
    for token in tail:
        if token.startswith("--") or "=" not in token:
            raise UserError(f"{token!r} after '--' is not KEY=VALUE: everything after a bare '--' overrides the "
                            "experiment config (e.g. -- epoch=2 optimizer.lr=0.01); launcher flags go before it")
        key, _, raw = token.partition("=")
        if not key.strip():
            raise UserError(f"{token!r} after '--' has no key: write KEY=VALUE, e.g. epoch=2")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        out.append((key.strip(), value, raw))
    return out


# -- placeholders -------------------------------------------------------------------------
def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    out = {}
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out[path] = value
            out.update(_flatten(value, path))
    return out


def _expand(value: Any, context: dict, where: str) -> Any:
    if isinstance(value, str):
        def one(match):
            key = match.group(1)
            if key not in context:
                raise ConfigError(f"{where}: unknown placeholder {{{key}}} in {value!r} (placeholders name launch "
                                  "settings, e.g. {repo_root}, {paths.exp_root}, {run.name}, {timestamp})")
            return str(context[key])
        return _PLACEHOLDER.sub(one, value)
    if isinstance(value, list):
        return [_expand(v, context, where) for v in value]
    if isinstance(value, dict):
        return {k: _expand(v, context, f"{where}.{k}" if where else str(k)) for k, v in value.items()}
    return value


def expand_placeholders(data: dict, launch_time: str) -> dict:
    """Every ``{key}`` in the settings, until nothing changes (a few passes)."""
    data = copy.deepcopy(data)
    for _ in range(8):
        context = _flatten(data)
        context.update({k: v for k, v in (data.get("paths") or {}).items()})
        context["timestamp"] = launch_time
        expanded = {k: _expand(v, context, k) for k, v in data.items()}
        if expanded == data:
            return data
        data = expanded
    raise ConfigError("the launch settings' placeholders refer to each other in a loop")


# -- the training config by name ------------------------------------------------------------
def list_configs(configs: Path, folder: str = "") -> list[str]:
    """Config names (``tests/tiny_semseg``) under ``configs/folder``; ``_base_``
    folders and ``_``-files are bases, not configs."""
    root = configs / folder if folder else configs
    names = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(configs)
        if any(part.startswith("_") for part in rel.parts):
            continue
        names.append(rel.with_suffix("").as_posix())
    return names


def find_config(name: str, repo_root: Path) -> tuple[Path, str]:
    """``(file, group)`` of ``--train.config NAME``: ``configs/NAME.py`` under
    the repository root (a ``configs/`` prefix and a ``.py`` suffix may be
    written), or a file path. ``group`` is the config's folder under
    ``configs/`` (``tests``), which the run folder repeats under ``exp_root``."""
    configs = repo_root / "configs"
    text = name.strip()
    ref = Path(text[:-3] if text.endswith(".py") else text)
    if ref.is_absolute():
        try:
            ref = ref.relative_to(configs.resolve())
        except ValueError:
            path = Path(text)
            if path.is_file():
                return path, ""
            raise UserError(f"--train.config {name}: no such file") from None
    if ref.parts[:1] == ("configs",):
        ref = Path(*ref.parts[1:])
    candidate = configs / f"{ref.as_posix()}.py"
    if candidate.is_file():
        parent = ref.parent.as_posix()
        return candidate, "" if parent == "." else parent
    own = Path(text).expanduser()
    if own.is_file():  # a config file outside configs/
        return own.absolute(), ""
    known = list_configs(configs) if configs.is_dir() else []
    near = difflib.get_close_matches(ref.as_posix(), known, n=1, cutoff=0.6)
    if not near:  # the same name in another folder
        near = [k for k in known if Path(k).name == ref.name][:1]
    hint = f"did you mean {near[0]}? " if near else ""
    folder = ref.parent.as_posix()
    listing = f"pimm ls {folder}" if folder != "." and (configs / folder).is_dir() else "pimm ls"
    raise UserError(f"--train.config {name}: no {candidate} ({hint}`{listing}` lists the configs; "
                    "--paths.repo-root chooses the checkout)")


# -- one command line, resolved ----------------------------------------------------------------
@dataclass
class Resolved:
    """The launch settings of one command line."""

    config: launch_schema.LaunchConfig
    base: Path  # the repository root every relative setting starts from
    layers: list[str]  # the YAML files merged, in order
    options: list[str]  # pimm --options tokens: train.options, then the tail
    argv: list[str]  # the command line as given (PIMM_LAUNCH_COMMAND)
    launch_time: str
    flags: dict = field(default_factory=dict)  # what the command line set (dotted keys)


def _set(data: dict, dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def resolve(flags: dict, tail: list[str], argv: list[str], *, default_site: str) -> Resolved:
    """Merge defaults, site, recipe, ``flags`` (dotted keys, as parsed) and the tail."""
    launch_time = timestamp()
    base = sites.base_dir(flags.get("paths.repo_root"))
    layers = [sites.defaults_file(base)]
    data = sites.load_yaml(layers[0])
    recipe = None
    if flags.get("recipe"):
        layers.append(sites.recipe_file(flags["recipe"], base))
        recipe = sites.load_yaml(layers[-1])
    site = flags.get("site") or (recipe or {}).get("site") or default_site
    site_path = sites.site_file(str(site), base)
    layers.insert(1, site_path)
    data = sites.merge(data, sites.load_yaml(site_path))
    if recipe is not None:
        data = sites.merge(data, recipe)
    data["site"] = site_path.stem if str(site).endswith((".yaml", ".yml")) or "/" in str(site) else str(site)
    merged = sites.merge(launch_schema.default_dict(), data)
    for key, value in flags.items():
        if key not in ("site", "recipe", "dry_run", "output", "no_remote"):
            _set(merged, key, value)
    parsed_tail = tail_options(tail)
    if merged["chain"]["jobs"] > 1 and merged["run"]["name"]:
        merged["run"]["timestamp"] = False  # every attempt of a chain writes the same run folder
    merged = expand_placeholders(merged, launch_time)
    source = " + ".join(str(p) for p in layers) + " and the command line"
    config = launch_schema.from_dict(merged, source)
    options = [option_token(k, v) for k, v in config.train.options.items()]
    context = _flatten(merged)
    context.update(merged["paths"])
    context["timestamp"] = launch_time
    for key, value, raw in parsed_tail:
        value = _expand(value, context, key) if isinstance(value, str) else value
        options.append(option_token(key, value, raw))
    return Resolved(config=config, base=base, layers=[str(p) for p in layers], options=options, argv=list(argv),
                    launch_time=launch_time, flags=dict(flags))
