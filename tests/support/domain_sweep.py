"""The property sweep of ``tests/test_domains.py``: every leaf key of every
shipped config set to wrong-typed and out-of-domain values, resolved in-process
the way the command line resolves a config (file, ``--options``, then
:func:`pimm.engines.launch.prepare_config`)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pimm.cli

pimm.cli.register_all()

from pimm.engines.run.launch import prepare_config  # noqa: E402
from pimm.engines.run.runtime import apply_runtime_defaults  # noqa: E402
from pimm.utils.config import Config  # noqa: E402
from pimm.utils.errors import UserError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# The hostile values of issues 38 and 32, as the --options text a user would type.
VALUES = ("None", "-1", "0", "'zzz'", str(10**12), "[]", "1e30", "nan", "inf", "-inf")
SKIP_KEYS = {"_base_", "custom_imports"}  # read when the file loads, not after --options


def shipped_configs() -> list[Path]:
    return sorted(p for p in (ROOT / "configs").rglob("*.py") if not any(part.startswith("_base") for part in p.parts))


def leaf_paths(node: Any, prefix: str = "") -> Iterator[str]:
    """Dotted paths of the leaves (a list of dicts is walked by index; other lists are leaves)."""
    if isinstance(node, dict):
        for key, child in node.items():
            if not prefix and key in SKIP_KEYS:
                continue
            yield from leaf_paths(child, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(node, (list, tuple)) and node and all(isinstance(v, dict) for v in node):
        for i, child in enumerate(node):
            yield from leaf_paths(child, f"{prefix}.{i}")
    else:
        yield prefix


@dataclass
class Outcome:
    config: str
    option: str
    error: str | None  # the one line, or None when the config resolved
    original: Any = None  # the config's own value at the key


def load(path: Path, save_path: str) -> Config:
    cfg = Config.fromfile(str(path))
    apply_runtime_defaults(cfg)
    cfg.merge_from_options([f"save_path={save_path}"])
    return cfg


def value_at(cfg: Any, key: str) -> Any:
    for seg in key.split("."):
        cfg = cfg[int(seg)] if isinstance(cfg, (list, tuple)) else cfg[seg]
    return cfg


def resolve(base: Config, option: str, frozen: bytes | None = None) -> Outcome:
    """``option`` applied to a copy of ``base`` (``frozen``: ``base`` pickled, when the caller keeps it) and
    the config resolved; a UserError is the expected refusal."""
    cfg = pickle.loads(frozen or pickle.dumps(base))  # a deep copy, several times faster than copy.deepcopy
    try:
        cfg.merge_from_options([option])
        prepare_config(cfg, 1, "train")
    except UserError as err:
        return Outcome(str(base.filename), option, str(err), value_at(base, option.split("=", 1)[0]))
    return Outcome(str(base.filename), option, None, value_at(base, option.split("=", 1)[0]))


def sweep(save_path: str) -> Iterator[Outcome]:
    for path in shipped_configs():
        base = load(path, save_path)
        frozen = pickle.dumps(base)
        for key in leaf_paths(base):
            for value in VALUES:
                yield resolve(base, f"{key}={value}", frozen)

