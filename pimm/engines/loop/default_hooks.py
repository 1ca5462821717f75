"""Named default hooks: the runtime services every run gets, whatever its ``hooks`` list.

A run's hooks come from two keys:

* ``default_hooks``: a dict of named services (:data:`DEFAULT_HOOKS`: live
  control, on-demand validation, timer, information writer, progress bar,
  checkpoint loading and saving). Each entry is a ``dict(type=...)`` or
  None (switched off); ``default_hooks = None`` switches them all off. A
  config re-parameterises one by name (``default_hooks =
  dict(checkpoint=dict(keep_last=5))`` merges onto the default, as any dict
  in a ``_base_`` chain does), and so does the command line
  (``--options default_hooks.live_control=None``).
* ``hooks``: the config's own list (upstream's meaning, unchanged), added
  to the defaults.

The rule for a type in both: the list's entry is used, with its own
parameters, and the default of that type is not added (a type is never
registered twice by accident). The same holds between two defaults: a name
given another service's type (``default_hooks.information_writer =
dict(type="ProgressBar")``) replaces that service's own default, which is
then not added; when both names are set to the one type, that is an error
naming them. An ``--options default_hooks.<name>...``
aimed at a default that the list replaces would silently do nothing, so it
is an error naming the list's entry to edit instead.

The order: the defaults in their table order, then the list in its own; the
trainer then sorts the hooks by priority (a stable sort, so hooks of equal
priority keep this order). ``--print-config`` shows the result
(:func:`hook_order_lines`).
"""

from __future__ import annotations

import copy
import difflib

from pimm.engines.hooks.base import PRIORITIES, build_hooks, get_priority
from pimm.utils.errors import ConfigError

__all__ = ["DEFAULT_HOOKS", "fill_default_hooks", "check_default_hooks", "assemble_hooks", "build_run_hooks",
           "hook_order_lines"]

#: The named services, in the order they are registered before the ``hooks`` list.
DEFAULT_HOOKS: dict[str, dict] = {
    "checkpoint_loader": dict(type="CheckpointLoader"),
    "timer": dict(type="IterationTimer", warmup_iter=2),
    "information_writer": dict(type="InformationWriter", log_frequency=20),
    "progress_bar": dict(type="ProgressBar"),
    # Idle until used (a file check every few steps, a signal handler): edit
    # save_path/control.json, or `kill -USR1 <pid>` to evaluate now.
    "live_control": dict(type="LiveControl"),
    "on_demand_validation": dict(type="OnDemandValidation"),
    "checkpoint": dict(type="CheckpointSaver", save_freq=None, keep_last=2),
}


def _unknown_name(name: str) -> ConfigError:
    close = difflib.get_close_matches(str(name), list(DEFAULT_HOOKS), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(f"default_hooks.{name} is not a default hook ({hint}the names are "
                       f"{', '.join(DEFAULT_HOOKS)}); list any other hook in `hooks`")


def fill_default_hooks(cfg) -> None:
    """Complete ``cfg.default_hooks`` with the engine's entries it leaves out: a
    config without ``_base_`` (or one naming only some entries) gets the same
    defaults as one built on the runtime base. An entry without ``type`` is
    merged onto the default of its name."""
    value = cfg.get("default_hooks", DEFAULT_HOOKS)
    if value is None or not isinstance(value, dict):
        cfg["default_hooks"] = copy.deepcopy(value)
        return
    filled = {}
    for name, default in DEFAULT_HOOKS.items():
        entry = value.get(name, default)
        if isinstance(entry, dict) and "type" not in entry:
            entry = {**default, **entry}
        filled[name] = copy.deepcopy(entry)
    filled.update((name, entry) for name, entry in value.items() if name not in DEFAULT_HOOKS)  # reported by the check
    cfg["default_hooks"] = filled


def check_default_hooks(key, value):
    """``default_hooks``: None, or a dict of known names, each a ``dict(type=...)`` or None."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"default_hooks must be a dict of named hooks (e.g. dict(live_control=None)) or None, "
                          f"got {type(value).__name__}")
    for name, entry in value.items():
        if name not in DEFAULT_HOOKS:
            raise _unknown_name(name)
        if entry is not None and (not isinstance(entry, dict) or "type" not in entry):
            raise ConfigError(f"default_hooks.{name} must be a dict(type=...) or None (switched off), got {entry!r}")
    return value


def _type_name(entry) -> str | None:
    kind = entry.get("type") if isinstance(entry, dict) else None
    return kind if isinstance(kind, str) or kind is None else getattr(kind, "__name__", repr(kind))


def assemble_hooks(cfg) -> list[tuple[str, dict]]:
    """The hook configs a run builds, as ``(origin, dict(type=...))`` pairs in
    registration order: the defaults not replaced by the list, then the list.
    ``origin`` says where the entry came from (``default_hooks.timer``,
    ``hooks[2]``)."""
    hooks = cfg.get("hooks")
    if hooks is None:
        hooks = []
    if not isinstance(hooks, (list, tuple)):
        raise ConfigError(f"hooks must be a list of dict(type=...), got {type(hooks).__name__}")
    defaults = check_default_hooks("default_hooks", cfg.get("default_hooks"))
    options = getattr(cfg, "command_options", None) or []
    listed: dict[str, int] = {}
    for index, entry in enumerate(hooks):
        listed.setdefault(_type_name(entry), index)
    chosen = []
    retyped = _retyped_defaults(defaults) if defaults is not None else {}
    for name in DEFAULT_HOOKS if defaults is not None else ():  # the table's order, whatever the config's
        entry = defaults.get(name)
        if name in retyped:  # another name of default_hooks was given this service's type: that one is used
            continue
        replaced_by = listed.get(_type_name(DEFAULT_HOOKS[name] if entry is None else entry))
        if replaced_by is not None:
            token = next((t for t in options if _option_key(t).split(".")[:2] == ["default_hooks", name]), None)
            if token is not None:
                kind = _type_name(hooks[replaced_by])
                raise ConfigError(
                    f"--options {token} has no effect: the hooks list has its own {kind} (hooks[{replaced_by}]), "
                    f"used instead of default_hooks.{name}; change that entry (--options hooks.{kind}.<key>=...) "
                    f"or drop it from the list")
            continue
        if entry is not None:
            chosen.append((f"default_hooks.{name}", entry))
    chosen += [(f"hooks[{index}]", entry) for index, entry in enumerate(hooks)]
    return chosen


def _retyped_defaults(defaults: dict) -> dict[str, str]:
    """``{name: other name}`` for each default whose type another name of
    ``default_hooks`` was set to (that entry is used and this one dropped);
    ConfigError when the entry of this name was set too (two of one type)."""
    out = {}
    for other, entry in defaults.items():
        kind = _type_name(entry) if entry is not None else None
        if other not in DEFAULT_HOOKS or kind is None or kind == DEFAULT_HOOKS[other]["type"]:
            continue
        for name, default in DEFAULT_HOOKS.items():
            if name == other or default["type"] != kind:
                continue
            own = defaults.get(name)
            if own is not None and own != default:
                raise ConfigError(f"default_hooks.{other} and default_hooks.{name} are both {kind} hooks: one "
                                  f"service would run twice; set one of them (the other to None)")
            out[name] = other
    return out


def build_run_hooks(cfg) -> list:
    """Build :func:`assemble_hooks`' entries; each hook remembers its ``origin``."""
    assembled = assemble_hooks(cfg)
    built = build_hooks([entry for _, entry in assembled], origins=[origin for origin, _ in assembled])
    for (origin, _), hook in zip(assembled, built):
        hook.origin = origin
    return built


def hook_order_lines(hooks) -> list[str]:
    """One line per hook in the order the trainer runs them (priority, then
    registration order), for ``--print-config``."""
    names = {value: name for name, value in sorted(PRIORITIES.items(), key=lambda kv: -kv[1])}
    ordered = sorted(hooks, key=lambda h: get_priority(h.priority))
    lines = []
    for hook in ordered:
        priority = get_priority(hook.priority)
        label = f"{priority} {names[priority]}" if priority in names else str(priority)
        lines.append(f"{label:<16} {type(hook).__name__:<22} {getattr(hook, 'origin', '')}")
    return lines


def _option_key(token: str) -> str:
    return str(token).partition("=")[0].strip().lstrip("+")
