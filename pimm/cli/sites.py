"""Where the launch YAML of ``pimm launch`` / ``pimm submit`` comes from, and how
the files merge (upstream pimm's layout and order).

A project keeps its own profiles as upstream does, in ``launch/`` at the root of
its checkout: ``launch/defaults.yaml``, ``launch/sites/NAME.yaml`` (``--site
NAME``) and recipes (``--recipe launch/runs/NAME.yaml``). pimm ships
``defaults.yaml`` and the sites ``local`` and ``slurm`` inside the package
(``pimm/launch/``), so ``--site local`` and ``--site slurm`` work from an
installed pimm too; a project's file of the same name wins.

Merge order, later wins: the schema's defaults, ``defaults.yaml``, the site,
the recipe, then the command line's flags and its ``--`` tail. A file may name
``_base_: other.yaml`` (or a list), merged under it first, relative to the
file; mappings merge key by key, anything else is replaced. The older
``slurm:`` group of upstream's pre-0.6 profiles is read as ``resources`` (and
``container.image`` / ``module``).
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

from pimm.utils.errors import ConfigError, UserError

__all__ = ["SHIPPED", "base_dir", "defaults_file", "site_file", "recipe_file", "load_yaml", "merge",
           "site_names"]

#: pimm's own launch folder (defaults.yaml, sites/), installed with the package.
SHIPPED = Path(__file__).resolve().parents[1] / "launch"
#: The checkout that holds this pimm (configs/, tools/), when it runs from one.
CHECKOUT = Path(__file__).resolve().parents[2]

_LEGACY_RESOURCES = {"account", "partition", "qos", "constraint", "dependency", "time", "mem", "output", "error",
                     "gpu_directive", "job_name", "signal_delay_s"}
_LEGACY_CONTAINER = {"image", "module"}


def base_dir(repo_root: str | None = None) -> Path:
    """The project folder relative settings start from: ``repo_root`` when given;
    else the working directory when it holds ``configs/`` or ``launch/`` (a
    project's checkout); else the checkout pimm runs from; else the working
    directory."""
    if repo_root is not None:
        return Path(repo_root).expanduser().absolute()
    cwd = Path.cwd()
    if (cwd / "configs").is_dir() or (cwd / "launch").is_dir():
        return cwd
    if (CHECKOUT / "configs").is_dir():
        return CHECKOUT
    return cwd


def _yaml():
    try:
        import yaml
    except ModuleNotFoundError:  # a dependency of pimm; only a broken install lacks it
        raise UserError("launch profiles are YAML: pip install pyyaml") from None
    return yaml


def site_names(base: Path) -> list[str]:
    names = {p.stem for folder in (base / "launch" / "sites", SHIPPED / "sites") if folder.is_dir()
             for p in folder.glob("*.yaml")}
    return sorted(names)


def defaults_file(base: Path) -> Path:
    own = base / "launch" / "defaults.yaml"
    return own if own.is_file() else SHIPPED / "defaults.yaml"


def site_file(name: str, base: Path) -> Path:
    """``--site NAME``: the project's ``launch/sites/NAME.yaml``, else pimm's; a
    name ending in ``.yaml`` (or holding a ``/``) is a path."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise UserError(f"--site {name}: no such file ({path})")
        return path
    for folder in (base / "launch" / "sites", SHIPPED / "sites"):
        if (folder / f"{name}.yaml").is_file():
            return folder / f"{name}.yaml"
    names = site_names(base)
    near = difflib.get_close_matches(name, names, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    raise UserError(f"--site {name}: no site profile of that name ({hint}sites: {', '.join(names)}; a project "
                    f"adds its own as launch/sites/NAME.yaml in {base})")


def recipe_file(recipe: str, base: Path) -> Path:
    path = Path(recipe).expanduser()
    if not path.is_absolute():  # upstream's: relative to the repository root; the working directory next
        path = next((p for p in (base / path, Path.cwd() / path) if p.is_file()), base / path)
    if not path.is_file():
        raise UserError(f"--recipe {recipe}: no such file ({path}); recipes are YAML paths relative to the "
                        f"repository root, e.g. launch/runs/NAME.yaml")
    return path


def merge(base: dict, override: dict) -> dict:
    """``override`` on ``base``, mappings key by key (neither is changed)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if value is None and isinstance(out.get(key), dict):
            continue  # a group whose entries are all commented out (`env:` alone) sets nothing
        if isinstance(out.get(key), dict) and isinstance(value, dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _legacy_slurm_group(data: dict, source: str) -> dict:
    """Upstream's pre-0.6 ``slurm:`` group as the ``resources`` (and container) keys."""
    legacy = data.pop("slurm")
    if legacy is None:
        return data
    if not isinstance(legacy, dict):
        raise ConfigError(f"slurm must be a mapping in {source}")
    resources = dict(data.get("resources") or {})
    if resources.setdefault("scheduler", "slurm") != "slurm":
        raise ConfigError(f"{source}: the slurm group needs resources.scheduler slurm, not "
                          f"{resources['scheduler']!r}")
    for key, value in legacy.items():
        if key == "additional_parameters":
            key, target = "scheduler_options", resources
        elif key in _LEGACY_RESOURCES:
            target = resources
        elif key in _LEGACY_CONTAINER:
            target = data.setdefault("container", {})
        else:
            raise ConfigError(f"unknown launch setting slurm.{key} in {source}")
        if key in target and target[key] != value:
            raise ConfigError(f"{source} sets both slurm.{key} and its newer place; keep one")
        target[key] = value
    data["resources"] = resources
    return data


def load_yaml(path: Path, _seen: tuple = ()) -> dict:
    """One launch YAML with its ``_base_`` chain merged under it."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: its _base_ chain comes back to itself")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror or err}") from None
    yaml = _yaml()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}{where} is not valid YAML: {getattr(err, 'problem', None) or err}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must be a mapping of launch settings, not {type(data).__name__}")
    bases = data.pop("_base_", None)
    if "slurm" in data:
        data = _legacy_slurm_group(data, str(path))
    if bases is None:
        return data
    merged: dict[str, Any] = {}
    for item in bases if isinstance(bases, list) else [bases]:
        base = Path(str(item)).expanduser()
        merged = merge(merged, load_yaml(base if base.is_absolute() else path.parent / base, (*_seen, path)))
    return merge(merged, data)
