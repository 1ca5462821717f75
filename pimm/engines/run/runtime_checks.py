"""The value checks of the runtime keys (:mod:`pimm.engines.run.runtime`): each
takes ``(key, value)`` and returns the value (normalised) or raises a
ConfigError naming the key and what it takes.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

from pimm.utils.domains import MAX_COUNT, Signal, show
from pimm.utils.errors import ConfigError


# -- value checks: each returns the (normalised) value or raises ConfigError ----
def _bool(key, value):
    if not isinstance(value, bool):
        raise ConfigError(f"{key}={value!r} is invalid: it takes True or False")
    return value


def _int(low: int, allow_none: bool = False, high: int = MAX_COUNT):
    def check(key, value):
        if value is None and allow_none:
            return value
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            what = f"an integer in [{low}, {high}]" if high != MAX_COUNT else {
                0: "an integer >= 0", 1: "a positive integer"}.get(low, f"an integer >= {low}")
            cap = f" (at most {high:.0e})" if high == MAX_COUNT and isinstance(value, int) and value > high else ""
            raise ConfigError(f"{key}={value!r} is invalid: it takes {what}{' or None' if allow_none else ''}{cap}")
        return value
    return check


def _positive_number_or_none(key, value):
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}={value!r} is invalid: it takes a positive number or None")
    return value


def _per_part(check, what: str):
    """``check``, or a dict of such values keyed by optimizer part (several
    optimizers: the part names are checked against the optimizer config when
    the trainer builds them)."""
    def check_parts(key, value):
        if isinstance(value, dict):
            for part, item in value.items():
                check(f"{key}.{part}", item)
            return value
        return check(key, value)
    check_parts.__doc__ = what
    return check_parts


def _choice(*choices):
    def check(key, value):
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(f"{key}={value!r} is invalid: it takes one of {', '.join(map(repr, choices))}")
        return value
    return check


def _path(allow_none: bool = False, must_exist: bool = False):
    def check(key, value):
        if value is None and allow_none:
            return value
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ConfigError(f"{key}={value!r} is invalid: it takes a path{' or None' if allow_none else ''}")
        value = os.path.expanduser(str(value))
        if must_exist and not Path(value).is_file():
            raise ConfigError(f"{key}={value!r}: no such file; give the path of a .pth file or None")
        return value
    return check


def _resume(key, value):
    if value is True or value is False or value == "allow_fresh":
        return value
    if isinstance(value, (str, os.PathLike)) and str(value) and str(value) not in ("True", "False", "true", "false"):
        path = Path(os.path.expanduser(str(value)))
        if not path.exists():
            raise ConfigError(f"{key}={str(value)!r} is invalid: it takes True, False, 'allow_fresh' or the path of "
                              "a checkpoint folder (e.g. <save_path>/checkpoints/step000000100-epoch0001), and there "
                              "is no such checkpoint")
        return str(path)
    raise ConfigError(f"{key}={value!r} is invalid: it takes True, False, 'allow_fresh' (resume, or start fresh "
                      "when no usable checkpoint exists) or the path of a checkpoint folder to resume from")


def _seed(key, value):
    if value is None:
        return value
    return _int(0, high=2**32 - 1)(key, value)  # numpy's seeds are 32-bit


def _signals(key, value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a list of signal names like ['SIGTERM', 'SIGUSR2']")
    for name in value:
        if not Signal().accepts(name):
            unknown = not (name.startswith("SIG") and hasattr(signal, name))
            raise ConfigError(f"{key}: {'unknown signal' if unknown else 'signal'} {name!r} "
                              f"{'' if unknown else 'cannot be caught; '}it takes {Signal.what}")
    return list(value)


def _list_or_none(key, value):
    if value is not None and not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a list or None")
    return value


def _patterns_or_none(key, value):
    if value is None:
        return value
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a list of module-name patterns like "
                          "['backbone.enc*'] or None")
    return list(value)


def _key_map(key, value):
    if value is None:
        return value
    try:
        pairs = [(old, new) for old, new in value]
    except (TypeError, ValueError):
        pairs = None
    if pairs is None or not all(isinstance(part, str) for pair in pairs for part in pair):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a list of [old_prefix, new_prefix] pairs, "
                          "e.g. [['module.', '']], or None")
    return [list(pair) for pair in pairs]


def _hooks(key, value):
    if not isinstance(value, (list, tuple)) or not all(isinstance(h, dict) and "type" in h for h in value):
        raise ConfigError(f"{key}={show(value)} is invalid: it takes a list of dict(type=...) (e.g. "
                          f"{key}=[dict(type='CheckpointSaver')]; [] for no hooks; +{key}=[dict(...)] appends)")
    return value


def _typed_dict(key, value):
    if not isinstance(value, dict) or "type" not in value:
        raise ConfigError(f"{key} must be a dict(type=...), got {value!r}")
    return value


def _unit_interval(key, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key}={value!r} is invalid: it takes a probability in [0, 1]")
    return float(value)


def _choice_or_none(*choices):
    def check(key, value):
        if value is None:
            return value
        return _choice(*choices)(key, value)
    return check


def _structured_logging(key, value):
    from pimm.engines.observe.tracing import validate_options

    return validate_options(value)


def _dict_or_none(key, value):
    if value is not None and not isinstance(value, dict):
        raise ConfigError(f"{key} must be a dict(type=...) or None, got {value!r}")
    return value
