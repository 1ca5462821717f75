"""``hooks_override``: upstream pimm's config key for changing the options of
hooks a config inherits, by type, without copying the whole ``hooks`` list::

    hooks_override = dict(
        CheckpointSaver=dict(save_freq=500),
        SemSegEvaluator={"every_n_steps": 1000},   # dotted names reach nested dicts: "a.b"
    )

Each entry sets those options on every hook of that type in ``hooks``,
exactly like ``--options hooks.CheckpointSaver.save_freq=500`` (the same
checks: a misspelt option is an error naming the nearest parameter). A type
that only a named default provides (``default_hooks.checkpoint`` for
``CheckpointSaver``, from the runtime base the config inherits) is set there,
like ``--options default_hooks.checkpoint.save_freq=500``; a type in the
``hooks`` list replaces its default, so the list's entry is the one edited. It is applied when the file is loaded,
after its ``_base_`` chain and before ``--options`` (so the command line wins),
and the key is then removed: ``config.py`` of a run holds the edited hooks.
A type that is in none of those lists is an error, not a silent no-op.

Loading does not depend on which registries are imported: an option of a
hook whose type no registry knows yet is set and checked with the whole
config at start-up (an option of a known type is checked at once).
``--options hooks_override=dict(...)`` (or ``hooks_override.<Type>.<option>=v``)
is applied at once, where it stands among the options, with the same checks.
"""

from __future__ import annotations

from typing import Any

from .config_options import apply_option
from .errors import ConfigError

__all__ = ["KEY", "apply_hooks_override", "apply_overrides"]

KEY = "hooks_override"


def _types(entries: Any) -> list[str]:
    if not isinstance(entries, (list, tuple)):
        return []
    return [e["type"] for e in entries if isinstance(e, dict) and isinstance(e.get("type"), str)]


def _targets(cfg: dict) -> dict[str, list[str]]:
    """Each hook type the config holds -> the option prefixes that reach it:
    ``hooks.<Type>`` for the list, ``default_hooks.<name>`` for a named default
    the list does not replace."""
    listed = set(_types(cfg.get("hooks")))
    targets: dict[str, list[str]] = {t: [f"hooks.{t}"] for t in listed}
    defaults = cfg.get("default_hooks")
    for name, entry in (defaults.items() if isinstance(defaults, dict) else ()):
        kind = entry.get("type") if isinstance(entry, dict) else None
        if isinstance(kind, str) and kind not in listed:
            targets.setdefault(kind, []).append(f"default_hooks.{name}")
    return targets


def apply_hooks_override(cfg: dict) -> None:
    """Apply and remove ``cfg["hooks_override"]`` of a loaded file (see the module docstring)."""
    if KEY not in cfg:
        return
    apply_overrides(cfg, cfg.pop(KEY), unresolved_ok=True)


def apply_overrides(cfg: dict, overrides: Any, source: str = KEY, unresolved_ok: bool = False) -> list[str]:
    """Set ``overrides`` (``dict(HookType=dict(option=value))``) on the hooks of
    ``cfg``; returns the paths set. ``source`` names the culprit in errors;
    ``unresolved_ok``: see :func:`pimm.utils.config_options.apply_option`."""
    if overrides is None:
        return []
    if not isinstance(overrides, dict):
        raise ConfigError(f"{source} must be a dict(HookType=dict(option=value)), got {overrides!r}")
    targets = _targets(cfg)
    written: list[str] = []
    for hook_type, options in overrides.items():
        if not isinstance(options, dict):
            raise ConfigError(f"{source}[{hook_type!r}] must be a dict of options, e.g. dict(save_freq=100), "
                              f"got {options!r}")
        prefixes = targets.get(hook_type)
        if not prefixes:
            listed = sorted(targets)
            raise ConfigError(f"{source}: hook type {hook_type!r} is not in the config's hooks "
                              f"({', '.join(listed) or 'none'}); add dict(type={hook_type!r}) to hooks or drop it "
                              f"from {KEY}")
        for option, value in options.items():
            for prefix in prefixes:
                try:
                    written += apply_option(cfg, f"{prefix}.{option}", value, unresolved_ok=unresolved_ok)
                except ConfigError as err:
                    err.args = (str(err).replace("--options ", f"{source}: ", 1),)
                    raise
    return written
