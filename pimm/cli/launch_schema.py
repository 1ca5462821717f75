"""The launch settings of ``pimm launch`` / ``pimm submit``: upstream pimm's
``LaunchConfig`` schema (its groups, keys, types and defaults), read from the
merged site / recipe YAML and the command line.

The groups: ``paths`` (where the checkout and the runs are), ``resources``
(nodes, processes, and what SLURM is asked for), ``run`` (the run's name and
its W&B names), ``train`` (the config, weights, resume), ``container``
(apptainer / singularity / shifter / docker), ``submit`` (a remote login host;
refused here), ``chain`` (requeued attempts), ``watchdog`` (the scron entry of
a chained interactive run), ``rdzv`` (a fixed rendezvous), ``env`` (exported
variables) and ``setup`` (shell lines run before training).

:func:`from_dict` checks every key and type and reports the first wrong one in
one line naming its dotted path (exit 2 at the command line); the YAML of
upstream's own site profiles loads unmodified.
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Union

from pimm.utils.errors import ConfigError

__all__ = ["LaunchConfig", "GROUPS", "from_dict", "to_dict", "default_dict", "field_kinds", "describe"]

AUTO = "auto"


@dataclass(kw_only=True)
class Paths:
    repo_root: str = "."
    exp_root: str = "{repo_root}/exp"


@dataclass(kw_only=True)
class Resources:
    scheduler: Literal["local", "slurm", "gcloud"] = "local"
    nnodes: int = 1
    nproc_per_node: Union[int, Literal["auto"]] = 4
    cpus_per_proc: int = 12
    account: str | None = None
    partition: str | None = None
    qos: str | None = None
    constraint: str | None = None
    dependency: str | None = None
    time: Union[str, int, None] = "24:00:00"
    mem: str | None = None
    output: str = "slurm_logs/slurm-%j.out"
    error: str | None = None
    # "none" is pimm's addition: CPU ranks, no GPU asked for.
    gpu_directive: Literal["gres", "gpus-per-node", "none"] = "gres"
    job_name: str | None = None
    signal_delay_s: int = 120
    scheduler_options: dict = field(default_factory=dict)


@dataclass(kw_only=True)
class Run:
    name: str | None = None
    timestamp: bool = True
    wandb_name: str | None = None
    wandb_project: str | None = None
    wandb_api_key: str | None = None


@dataclass(kw_only=True)
class Train:
    config: str | None = None
    weight: str | None = None
    resume: bool = False
    code_copy: bool = True
    python: str | None = None
    options: dict = field(default_factory=dict)
    test: bool = False


@dataclass(kw_only=True)
class Container:
    runtime: Literal["none", "singularity", "apptainer", "shifter", "docker"] = "none"
    image: str | None = None
    module: str | None = None
    binds: list[str] = field(default_factory=list)
    repo_mount: str | None = "/opt/pimm/src"
    unset_env: list[str] = field(default_factory=list)
    interpreter: str | None = None


@dataclass(kw_only=True)
class Submit:
    host: str | None = None
    folder: str | None = None


@dataclass(kw_only=True)
class Chain:
    jobs: int = 1
    resume_first: bool = False
    wandb_group: str | None = None
    wandb_job_type: str = "train-job"


@dataclass(kw_only=True)
class Watchdog:
    qos: str = "cron"
    interval_min: int = 5
    time: str = "1-00:00:00"


@dataclass(kw_only=True)
class Rendezvous:
    endpoint: str | None = None
    id: str | None = None
    backend: str | None = None


@dataclass(kw_only=True)
class LaunchConfig:
    site: str = "local"
    executor: Literal["local", "batch", "interactive"] = "local"
    interactive: bool = False
    paths: Paths = field(default_factory=Paths)
    resources: Resources = field(default_factory=Resources)
    run: Run = field(default_factory=Run)
    train: Train = field(default_factory=Train)
    container: Container = field(default_factory=Container)
    submit: Submit = field(default_factory=Submit)
    chain: Chain = field(default_factory=Chain)
    watchdog: Watchdog = field(default_factory=Watchdog)
    rdzv: Rendezvous = field(default_factory=Rendezvous)
    env: dict = field(default_factory=dict)
    setup: list[str] = field(default_factory=list)


#: The groups, by their key in the YAML.
GROUPS = {"paths": Paths, "resources": Resources, "run": Run, "train": Train, "container": Container,
          "submit": Submit, "chain": Chain, "watchdog": Watchdog, "rdzv": Rendezvous}
_TOP_LEVEL = {f.name for f in fields(LaunchConfig)}


def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def field_kinds(cls) -> dict[str, Any]:
    """``{field name: its type}`` of a group (resolved annotations)."""
    return {f.name: _hints(cls)[f.name] for f in fields(cls)}


def _nearest(name: str, choices) -> str:
    near = difflib.get_close_matches(name, list(choices), n=1)
    return f"; did you mean {near[0]!r}?" if near else ""


def _accepts(kind, value) -> bool:
    origin = typing.get_origin(kind)
    if kind is Any:
        return True
    if origin is Literal:
        return value in typing.get_args(kind)
    if origin in (Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if kind is dict or origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(_accepts(item, v) for v in value)
    return isinstance(value, kind)


def describe(kind) -> str:
    """``int or 'auto'``, ``'gres', 'gpus-per-node' or 'none'``, ``a list of strings``..."""
    origin = typing.get_origin(kind)
    if origin is Literal:
        return " or ".join(repr(v) for v in typing.get_args(kind))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(kind))
    if origin is list:
        return "a list of strings"
    return {bool: "true/false", int: "an integer", str: "a string", dict: "a mapping",
            type(None): "null"}.get(kind, getattr(kind, "__name__", str(kind)))


def _check(path: str, kind, value, source: str) -> None:
    if not _accepts(kind, value):
        raise ConfigError(f"{path}: {value!r} is invalid in {source}: give {describe(kind)}")


def _group(name: str, cls, data: Any, source: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{name} must be a mapping in {source}, not {type(data).__name__}")
    kinds = field_kinds(cls)
    values = dict(data)
    if cls is Train and "no_code_copy" in values:  # upstream's older spelling
        if "code_copy" in values:
            raise ConfigError(f"train.no_code_copy and train.code_copy are both set in {source}: keep one")
        values["code_copy"] = not values.pop("no_code_copy")
    for key, value in values.items():
        if key not in kinds:
            raise ConfigError(f"unknown launch setting {name}.{key} in {source}{_nearest(key, kinds)}")
        _check(f"{name}.{key}", kinds[key], value, source)
    return cls(**values)


def from_dict(data: Any, source: str = "the launch settings") -> LaunchConfig:
    """The typed settings of a merged mapping; one ConfigError line for the first bad key."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source} must be a mapping of launch settings")
    for key in data:
        if key not in _TOP_LEVEL:
            raise ConfigError(f"unknown launch setting {key} in {source}{_nearest(key, _TOP_LEVEL)}")
    kwargs = {}
    for name, cls in GROUPS.items():
        kwargs[name] = _group(name, cls, data.get(name), source)
    hints = _hints(LaunchConfig)
    for key in ("site", "executor", "interactive", "env", "setup"):
        if key in data and not (data[key] is None and key in ("env", "setup")):  # `setup:` alone: none
            _check(key, hints[key], data[key], source)
            kwargs[key] = data[key]
    return LaunchConfig(**kwargs)


def to_dict(config: LaunchConfig) -> dict:
    return asdict(config)


def default_dict() -> dict:
    """Every setting at the schema's default (what no YAML sets)."""
    return to_dict(LaunchConfig())
