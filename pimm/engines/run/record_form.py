"""What of a run's config is written down, and how a written record is read back.

A run's records (``config.py``, ``resolved_config.json``, ``run_metadata.json``)
hold the config **as the hooks received it**: the runtime defaults, the file
with its ``_base_`` chain and ``hooks_override``, and the ``--options``, but
not what each hook's ``modify_config`` then changed. A resume (``--resume
RUN_DIR``) runs that record through the same start-up, so every hook makes
its change again on the same input: a hook whose change is not idempotent
(``WeightDecayExclusion`` splits the optimizer and widens ``max_lr``) cannot
apply it twice, and a key a hook adds for the builder
(``optimizer.no_weight_decay``) is never handed back to the config checks as
if the user had written it. This is also what upstream pimm records.

Secrets are never written (:func:`pimm.utils.redaction.redact_secrets`): a
string under a secret-looking key (``token``, ``api_key``, ``password``,
``*_secret``) is ``"<redacted>"`` in every record. Reading a record back
(:func:`forget_redacted_secrets`), such a value is not replayed as the
literal text: it is removed from its ``dict(type=...)`` so the constructor's
default applies (``PushToHub(token=None)``: the environment's ``HF_TOKEN`` or
the stored login), or set to None elsewhere, and the log says which; giving
it again with ``--options`` uses that value for this attempt (still
unrecorded). ``trust_checkpoint_code`` is never written as True: trusting one
checkpoint's code is a decision of one invocation (docs/security.md).
"""

from __future__ import annotations

import copy
from typing import Any

from pimm.utils.config import Config
from pimm.utils.config_dict import to_plain
from pimm.utils.redaction import REDACTED, is_secret_key, redact_secrets

__all__ = ["note_hook_changes", "record_form", "redacted_config", "forget_redacted_secrets", "without_secrets"]

_UNSET = object()
_BEFORE_HOOKS = "_before_hooks"
_FORGOTTEN = "_redacted_secrets"


def _differs(a: Any, b: Any) -> bool:
    try:
        return bool(a != b)
    except Exception:  # noqa: BLE001  (arrays and other values without a plain ==)
        return repr(a) != repr(b)


class note_hook_changes:
    """``with note_hook_changes(cfg): hook.modify_config(cfg) ...``: remember
    the value each top-level key had before the hooks changed it, so that
    :func:`record_form` writes the config as the hooks received it."""

    def __init__(self, cfg):
        self.cfg = cfg

    def __enter__(self):
        self.before = {key: copy.deepcopy(value) for key, value in self.cfg.items()}
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is not None:
            return
        changed = {key: self.before.get(key, _UNSET) for key in [*self.before, *self.cfg]
                   if _differs(self.before.get(key, _UNSET), self.cfg.get(key, _UNSET))}
        try:
            object.__setattr__(self.cfg, _BEFORE_HOOKS, changed)
        except AttributeError:  # a plain dict config (no attributes): nothing is recorded from it
            pass


def record_form(cfg) -> Config:
    """The config to write into the run's records: as the hooks received it
    (:class:`note_hook_changes`), without secrets, ``trust_checkpoint_code``
    False, with the ``--options`` header redacted too. ``cfg`` is not changed."""
    plain = {k: v for k, v in to_plain(dict(cfg)).items()}
    for key, before in getattr(cfg, "__dict__", {}).get(_BEFORE_HOOKS, {}).items():
        if before is _UNSET:
            plain.pop(key, None)
        else:
            plain[key] = to_plain(before)
    for path in getattr(cfg, "__dict__", {}).get(_FORGOTTEN, ()):
        _mark_redacted(plain, path.split("."))  # the record still says a secret was given
    if plain.get("trust_checkpoint_code"):
        plain["trust_checkpoint_code"] = False
    return _redacted(cfg, plain)


def redacted_config(cfg) -> Config:
    """``cfg`` as it runs (the hooks' changes included) with its secrets
    redacted, for showing (``--print-config``). ``cfg`` is not changed."""
    return _redacted(cfg, to_plain(dict(cfg)))


def _redacted(cfg, plain: dict) -> Config:
    out = Config(redact_secrets(plain), filename=getattr(cfg, "filename", None))
    options = getattr(cfg, "command_options", None) or []
    out.set_command_options([redact_secrets(str(token)) for token in options])
    return out


def forget_redacted_secrets(cfg) -> list[str]:
    """Read back from a record: every ``"<redacted>"`` under a secret key is
    removed from its ``dict(type=...)`` (the constructor's default applies)
    or set to None elsewhere. Returns the dotted keys affected."""
    found: list[str] = []

    def visit(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key in list(node):
                where = f"{path}.{key}" if path else str(key)
                if is_secret_key(key) and node[key] == REDACTED:
                    found.append(where)
                    if "type" in node:
                        del node[key]
                    else:
                        node[key] = None
                else:
                    visit(node[key], where)
        elif isinstance(node, (list, tuple)):
            for index, item in enumerate(node):
                visit(item, f"{path}.{index}")

    visit(cfg, "")
    if found:
        try:
            object.__setattr__(cfg, _FORGOTTEN, [*getattr(cfg, "__dict__", {}).get(_FORGOTTEN, ()), *found])
        except AttributeError:
            pass
    return found


def _mark_redacted(node: Any, segments: list[str]) -> None:
    for segment in segments[:-1]:
        if isinstance(node, dict) and segment in node:
            node = node[segment]
        elif isinstance(node, list) and segment.isdigit() and int(segment) < len(node):
            node = node[int(segment)]
        else:
            return
    if isinstance(node, dict) and node.get(segments[-1]) is None:
        node[segments[-1]] = REDACTED


def without_secrets(value: Any) -> Any:
    """``value`` without the entries under secret keys (for comparing records:
    a secret is never in one, so it is no difference)."""
    if isinstance(value, dict):
        return {k: without_secrets(v) for k, v in value.items() if not is_secret_key(k)}
    if isinstance(value, (list, tuple)):
        return [without_secrets(v) for v in value]
    return value
