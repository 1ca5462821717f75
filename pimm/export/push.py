"""Pushing an export folder to the Hugging Face Hub (upstream's
``pimm.export.push_to_hub``). Apart from :mod:`pimm.export.hub` (names), since
pushing a model that is not yet exported goes through
:func:`save_pretrained <pimm.export.save_pretrained>`, and loading, which
saving uses, resolves names."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from pimm.engines.state.weight_source import EXPORT_WEIGHT_NAMES, hf_offline
from pimm.export.configs import CONFIG_READ_NAMES
from pimm.export.hub import UPLOADED, check_repo_id
from pimm.export.saving import save_pretrained
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.redaction import redact_secrets

__all__ = ["push_to_hub"]


def _export_folder(path: Any) -> Path | None:
    if isinstance(path, (str, os.PathLike)) and Path(path).is_dir() and any(
            (Path(path) / name).is_file() for name in EXPORT_WEIGHT_NAMES):
        return Path(path)
    return None


def _check_uploadable(folder: Path) -> None:
    """An export folder must not carry secrets to the Hub (one written by an
    older pimm, or edited by hand)."""
    for name in CONFIG_READ_NAMES:
        path = folder / name
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if redact_secrets(text) != text:
                raise UserError(f"push_to_hub: {path} holds a secret (a token, key or password); nothing was "
                                "uploaded: export again with pimm export / save_pretrained, which redacts it")


def push_to_hub(model_or_directory: Any, repo_id: str, *, save_directory: str | os.PathLike | None = None,
                private: bool | None = None, token: str | None = None, revision: str | None = None,
                commit_message: str = "Upload pimm model", **save_kwargs: Any):
    """Upload an export to the Hub repository ``repo_id`` (created when
    missing; ``private`` as the Hub defaults when None) and return the commit.

    ``model_or_directory``: an export folder (uploaded as it is: its weights,
    config files and ``README.md`` only), or anything :func:`save_pretrained
    <pimm.export.save_pretrained>` takes, exported first into
    ``save_directory`` (default: a temporary folder) with ``save_kwargs``.
    ``revision``: the branch to commit to (created when missing). ``token``: a
    Hub token (default: the ambient login); it is passed to the Hub and
    written nowhere."""
    check_repo_id(repo_id)
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise ConfigError("push_to_hub needs huggingface_hub: pip install 'pimm[hub]'") from None
    if hf_offline():
        raise UserError(f"push_to_hub: HF_HUB_OFFLINE=1 forbids uploading to {repo_id}; unset it to push")
    folder = _export_folder(model_or_directory)
    with tempfile.TemporaryDirectory(prefix="pimm-export-") as scratch:
        if folder is None:
            folder = save_pretrained(model_or_directory, save_directory if save_directory is not None else scratch,
                                     **save_kwargs)
        _check_uploadable(folder)
        api = HfApi(token=token)
        try:
            api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
            if revision is not None:
                api.create_branch(repo_id=repo_id, repo_type="model", branch=revision, exist_ok=True)
            return api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(folder),
                                     commit_message=commit_message, revision=revision, allow_patterns=UPLOADED)
        except Exception as err:  # network, authentication, quota: huggingface_hub raises many types
            first = str(err).splitlines()[0] if str(err) else ""
            kept = "" if folder == Path(scratch) else f"; the export in {folder} is complete: push it again later"
            raise UserError(f"push_to_hub: uploading to {repo_id} failed ({type(err).__name__}: {first}){kept}") \
                from None
