"""Names of models on the Hugging Face Hub (pushing an export there: :mod:`pimm.export.push`).

A name that :func:`from_pretrained <pimm.export.from_pretrained>` takes is
resolved in this order:

1. a local path that exists (file or folder) is that path, whatever it looks like;
2. ``hf://Org/Name[@revision][/file]`` is a Hub model;
3. a bare ``Org/Name`` (two names joined by one ``/``, nothing else) is the Hub
   model ``hf://Org/Name``: upstream's README form;
4. anything else is a local path that does not exist (one error line).

Hub models come from huggingface_hub's cache: ``cache_dir=`` when given, else
``HF_HUB_CACHE``, else ``HF_HOME/hub``, else huggingface_hub's default (read
when the call is made). With ``HF_HUB_OFFLINE=1`` nothing is fetched: a model
that is not cached is one line naming it and the command that fetches it.
"""

from __future__ import annotations

import os
import re
from typing import Any

from pimm.engines.state.weight_source import EXPORT_WEIGHT_NAMES, HF_SCHEME, WeightSource, resolve_weight_source
from pimm.export.configs import CONFIG_READ_NAMES
from pimm.utils.errors import ConfigError

__all__ = ["REPO_ID", "UPLOADED", "is_repo_id", "resolve_pretrained", "check_repo_id"]

#: A Hub repository id: ``Org/Name`` (letters, digits, ``-``, ``_``, ``.``; not starting with ``.``).
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9_][\w.-]*")
#: What an upload of an export folder sends (upstream's selection).
UPLOADED = [*EXPORT_WEIGHT_NAMES, *CONFIG_READ_NAMES, "README.md"]


def is_repo_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hub repository id (``Org/Name``)."""
    return bool(REPO_ID.fullmatch(name)) and ".." not in name


def check_repo_id(repo_id: Any, what: str = "repo_id") -> str:
    if not isinstance(repo_id, str) or not is_repo_id(repo_id):
        raise ConfigError(f"{what}={repo_id!r} is not a Hugging Face repository id: write it as 'org/name'")
    return repo_id


def resolve_pretrained(name_or_path: str | os.PathLike, *, revision: str | None = None,
                       cache_dir: str | os.PathLike | None = None) -> WeightSource:
    """The weight source ``name_or_path`` names (the rule of the module docstring)."""
    text = os.fspath(name_or_path)
    if not text.startswith(HF_SCHEME) and not os.path.exists(os.path.expanduser(text)) and is_repo_id(text):
        return resolve_weight_source(HF_SCHEME + text, revision=revision, cache_dir=cache_dir, shown=text)
    return resolve_weight_source(text, revision=revision, cache_dir=cache_dir)
