"""Redaction of what must not be written down: secrets everywhere, paths in
what is published.

Two separate passes, because their audiences differ:

* :func:`redact_secrets` is applied to everything pimm *writes* about a run
  (``config.py``, ``resolved_config.json``, ``run_metadata.json``,
  ``attempts.jsonl``, checkpoints) and to exports: values under secret-looking
  keys (``token``, ``api_key``, ``password``, ``*_secret``, ...) and secret
  assignments or flags inside strings (``WANDB_API_KEY=...``, ``--token X``)
  become ``"<redacted>"``. The live run keeps the real values in memory.
* :func:`redact_paths` is for publishing only (exports, model cards): a run's
  own records keep real paths because resume needs them.

Both return copies and never touch non-string scalars, so a model switch such
as ``mask_token=False`` survives: a secret is always text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "SECRET_KEY_PATTERN", "is_secret_key", "redact_secrets", "redact_secrets_in_text",
           "redact_command", "redact_paths", "redact_paths_in_text"]

REDACTED = "<redacted>"

#: Key names (lower-cased, ``-`` read as ``_``) whose string value is a secret.
#: ``token`` alone or as a suffix (``hf_token``, ``wandb_token``), but not the
#: model vocabulary's ``mask_token``/``cls_token``/``pad_token``; ``key`` only
#: in its credential forms (``api_key``, ``access_key``, ...), never a bare
#: ``*_key`` (``grid_key``, ``feat_keys`` are data names).
SECRET_KEY_PATTERN = re.compile(
    r"""^(?:
        (?:[a-z0-9]+_)*
        (?:(?<!mask_)(?<!cls_)(?<!pad_)(?<!sep_)(?<!bos_)(?<!eos_)(?<!unk_)(?<!end_)(?<!class_)(?<!start_)
           (?<!special_)(?<!register_)(?<!prompt_)(?<!query_)(?<!dist_)token
          |auth_token|access_token|refresh_token|id_token
          |api_?key|access_?key|secret_?key|private_?key|auth_?key|client_?key|license_?key
          |secret|client_secret|password|passwd|passphrase|credentials?)
    )$""",
    re.VERBOSE,
)


def _normal(name: str) -> str:
    return str(name).strip().lower().replace("-", "_").lstrip("_")


def is_secret_key(name: Any) -> bool:
    """Whether a config key or option name holds a secret (``token``,
    ``hf_token``, ``api_key``, ``apikey``, ``password``, ``client_secret``, ...).
    A dotted option key is judged by its last part (``hooks.0.token``)."""
    if not isinstance(name, str) or not name.strip():
        return False
    return bool(SECRET_KEY_PATTERN.match(_normal(name.rsplit(".", 1)[-1])))


# An environment variable named like a credential: ``*_KEY``, ``*_TOKEN``,
# ``*_SECRET``, ``*_PASSWORD`` (and the bare words), upper case as the shell writes them.
_SECRET_ENV = re.compile(r"^(?:[A-Z0-9]+_)*(?:KEY|APIKEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?)$")
_QUOTED_OR_BARE = r"""(?:"(?:[^"\\]|\\.)*"|'[^']*'|[^\s,;)\]}&|'"]+)"""

# ``NAME=value`` at a word boundary: shell assignments, ``--options`` tokens
# (``hooks.0.token=...``), keyword arguments (``dict(token='...')``).
_ASSIGNMENT = re.compile(r"(?<![\w.\-])(?P<name>[A-Za-z_+][\w.\-]*)(?P<sep>\s*=\s*|=)(?P<value>" + _QUOTED_OR_BARE + ")")
# ``--token X`` / ``--token=X`` / ``--api-key X``.
_FLAG = re.compile(r"(?<![\w\-])(?P<name>--?[A-Za-z][\w\-]*)(?P<sep>=|\s+(?!-))(?P<value>" + _QUOTED_OR_BARE + ")")
# ``"token": "..."`` in JSON or a Python literal written into a string.
_MAPPING_ENTRY = re.compile(r"""(?P<q>["'])(?P<name>[\w\-.]+)(?P=q)(?P<sep>\s*:\s*)(?P<value>"(?:[^"\\]|\\.)*"|'[^']*')""")
# Credentials in a URL: ``https://user:password@host``.
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][\w+.\-]*://[^\s/:@]+:)(?P<value>[^\s/@]+)(?=@)")
# A Hugging Face token written anywhere.
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def _secret_name(name: str) -> bool:
    name = name.lstrip("+")
    return bool(_SECRET_ENV.match(name)) or is_secret_key(name)


def _replace_value(match: re.Match) -> str:
    value = match["value"]
    if value == REDACTED or value.strip("'\"") in ("", REDACTED):
        return match[0]
    quote = value[0] if value[:1] in ("'", '"') and value[-1:] == value[:1] and len(value) > 1 else ""
    return match[0][: match.start("value") - match.start()] + f"{quote}{REDACTED}{quote}"


def redact_secrets_in_text(text: str) -> str:
    """``text`` with the values of secret assignments, flags, mapping entries,
    URL passwords and Hugging Face tokens replaced by ``"<redacted>"``."""
    if not text:
        return text
    text = _ASSIGNMENT.sub(lambda m: _replace_value(m) if _secret_name(m["name"]) else m[0], text)
    text = _FLAG.sub(lambda m: _replace_value(m) if is_secret_key(m["name"].lstrip("-")) else m[0], text)
    text = _MAPPING_ENTRY.sub(lambda m: _replace_value(m) if _secret_name(m["name"]) else m[0], text)
    text = _URL_PASSWORD.sub(lambda m: m["head"] + REDACTED, text)
    return _HF_TOKEN.sub(REDACTED, text)


def redact_command(argv: list) -> list:
    """A command line as a list (``sys.argv``) with its secrets redacted: each
    word as :func:`redact_secrets_in_text` does, and the word after a secret
    flag given apart (``["--token", "X"]``)."""
    out: list = []
    secret_next = False
    for word in argv:
        text = str(word)
        if secret_next and not text.startswith("-"):
            out.append(REDACTED)
        else:
            out.append(redact_secrets_in_text(text))
        secret_next = text.startswith("-") and "=" not in text and is_secret_key(text.lstrip("-"))
    return out


def _rebuild(obj: Any, items: Any) -> Any:
    """A container of ``obj``'s type holding ``items`` (plain type when that
    type cannot be built from its items)."""
    try:
        return type(obj)(items)
    except TypeError:
        return dict(items) if isinstance(obj, Mapping) else list(items)


def redact_secrets(obj: Any) -> Any:
    """A copy of ``obj`` (nested dicts, lists, tuples, strings) where every
    string under a secret key (:func:`is_secret_key`) is ``"<redacted>"`` and
    every string has its secret assignments and flags redacted
    (:func:`redact_secrets_in_text`). Other values are returned as they are."""
    if isinstance(obj, str):
        return redact_secrets_in_text(obj)
    if isinstance(obj, Mapping):
        return _rebuild(obj, {key: (REDACTED if is_secret_key(key) and _is_text(value) else redact_secrets(value))
                              for key, value in obj.items()})
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [redact_secrets(v) for v in obj])
    return obj


def _is_text(value: Any) -> bool:
    return isinstance(value, (str, bytes)) and bool(value) and value != REDACTED


# -- paths --------------------------------------------------------------------
# Where a path may begin inside a string: its start, after a space, quote,
# bracket, separator or an ``=`` (``--config-file=/x``, ``PYTHONPATH=/a:/b``).
_PATH_START = r"(?:^|(?<=[\s=\"'(\[{,:;]))"
_PATH_BODY = r"[^\s\"'()\[\]{},:;]*"
_PATH = re.compile(
    r"file://" + _PATH_BODY
    + r"|" + _PATH_START + r"(?:~[\w.\-]*|\$HOME|\$\{HOME\})/" + _PATH_BODY
    + r"|" + _PATH_START + r"/(?![/\s])[^\s\"'()\[\]{},:;/]" + _PATH_BODY
    + r"|" + _PATH_START + r"[A-Za-z]:\\" + r"[^\s\"'()\[\]{},;]*"
)


def redact_paths_in_text(text: str) -> str:
    """``text`` with every absolute path, ``~/`` or ``$HOME/`` path and
    ``file://`` URL in it (also inside a command line) replaced by ``"<redacted>"``;
    other URLs (``https://``, ``hf://``) are kept."""
    if not text:
        return text
    return _PATH.sub(REDACTED, text)


def redact_paths(obj: Any) -> Any:
    """A copy of ``obj`` for publishing: every path in its strings and in its
    dict keys is ``"<redacted>"`` (:func:`redact_paths_in_text`). Keys that
    would collide once redacted are numbered (``<redacted>``, ``<redacted>#2``)."""
    if isinstance(obj, str):
        return redact_paths_in_text(obj)
    if isinstance(obj, Mapping):
        out: dict = {}
        for key, value in obj.items():
            new_key = redact_paths_in_text(key) if isinstance(key, str) else key
            if new_key != key and new_key in out:
                n = 2
                while f"{new_key}#{n}" in out:
                    n += 1
                new_key = f"{new_key}#{n}"
            out[new_key] = redact_paths(value)
        return _rebuild(obj, out)
    if isinstance(obj, (list, tuple)):
        return _rebuild(obj, [redact_paths(v) for v in obj])
    return obj
