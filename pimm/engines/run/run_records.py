"""Upstream pimm's run records beside ``config.py``, and the launch command.

* ``resolved_config.json``: the resolved config as JSON (what ``config.py``
  says, for tools that do not run Python); rewritten with ``config.py``.
* ``model_config.json``: its ``model`` entry alone (what an export needs).
* ``run_metadata.json``: how the run was started, with upstream's fields:
  ``created_at``, ``launch_command``, ``command`` (this process's argv),
  ``cwd``, ``host``, ``config_file``, ``config_file_abs``, ``cli_options``
  (``{key: value}``), ``cli_option_keys``, ``save_path``, ``resume``, ``git``
  (``commit``, ``branch``, ``is_dirty``, ``dirty_check``). Written when the run
  starts; a resume keeps it (``attempts.jsonl`` records every attempt).
* ``PIMM_LAUNCH_COMMAND``: the command a launcher (``pimm submit``, a job
  script) exports for the job; it fills ``launch_command`` when the config
  leaves it unset, so it reaches ``config.py``, these records and the W&B
  run's notes.

A record that a different config would overwrite is kept aside as
``name.prevN.json``, like ``config.py``. No record holds a secret
(:mod:`pimm.utils.redaction`): the config handed in is already the record's
form (:func:`~pimm.engines.run.record_form.record_form`), and the command
lines and options are redacted here; so is ``PIMM_LAUNCH_COMMAND`` when it
becomes the config's ``launch_command``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from pimm.utils.config_dict import to_plain
from pimm.utils.config_options import parse_options
from pimm.utils.files import set_aside
from pimm.utils.redaction import redact_command, redact_secrets

__all__ = ["LAUNCH_COMMAND_ENV", "RESOLVED_CONFIG", "MODEL_CONFIG", "RUN_METADATA", "apply_launch_command",
           "write_run_records"]

LAUNCH_COMMAND_ENV = "PIMM_LAUNCH_COMMAND"
RESOLVED_CONFIG = "resolved_config.json"
MODEL_CONFIG = "model_config.json"
RUN_METADATA = "run_metadata.json"


def apply_launch_command(cfg) -> None:
    """``launch_command`` from ``PIMM_LAUNCH_COMMAND`` when the config leaves it
    unset, its secrets redacted (it is shown and recorded, never run)."""
    command = os.environ.get(LAUNCH_COMMAND_ENV, "").strip()
    if command and cfg.get("launch_command") is None:
        cfg["launch_command"] = redact_secrets(command)


def _json_text(payload) -> str:
    return json.dumps(payload, indent=2, default=str, sort_keys=False) + "\n"


def _write(path: Path, text: str, same_run: bool, keep_existing: bool = False) -> None:
    """Write ``text`` to ``path`` atomically. An existing file of the same run is
    replaced (``keep_existing``: kept); one of another config is set aside."""
    if path.exists():
        if same_run and keep_existing:
            return
        if not same_run:
            set_aside(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _git(root: Path) -> dict | None:
    def run(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = run("rev-parse", "HEAD")
        return {"commit": commit, "branch": run("rev-parse", "--abbrev-ref", "HEAD"),
                "is_dirty": bool(run("status", "--short", "--untracked-files=no")),
                "dirty_check": "tracked_files_only"}
    except (OSError, subprocess.SubprocessError):
        return None


def _plain_config(cfg) -> dict:
    return {k: v for k, v in to_plain(dict(cfg)).items() if not str(k).startswith("_")}


def write_run_records(cfg, same_run: bool) -> None:
    """Write the records of the module docstring into ``cfg.save_path`` (rank 0,
    right after ``config.py``). ``same_run``: ``config.py`` was rewritten in place
    (a resume); otherwise earlier records are set aside. ``cfg``: the record's
    form of the config (no secrets)."""
    root = Path(cfg.save_path)
    plain = _plain_config(cfg)
    _write(root / RESOLVED_CONFIG, _json_text(plain), same_run)
    if isinstance(plain.get("model"), dict):
        _write(root / MODEL_CONFIG, _json_text(plain["model"]), same_run)
    options = cfg.command_options if hasattr(cfg, "command_options") else []
    parsed = {("+" if new else "") + key: value for key, value, new in parse_options(options)}
    config_file = cfg.filename if hasattr(cfg, "filename") else None
    metadata = {
        "created_at": datetime.now(timezone.utc).isoformat(),
        "launch_command": redact_secrets(cfg.get("launch_command") or os.environ.get(LAUNCH_COMMAND_ENV)),
        "command": redact_command(list(sys.argv)),
        "cwd": os.getcwd(),
        "host": socket.gethostname(),
        "config_file": config_file,
        "config_file_abs": os.path.abspath(config_file) if config_file else None,
        "cli_options": redact_secrets(to_plain(parsed)),
        "cli_option_keys": sorted(parsed),
        "save_path": str(cfg.save_path),
        "resume": bool(cfg.get("resume")),
        "git": _git(Path.cwd()),
    }
    _write(root / RUN_METADATA, _json_text(metadata), same_run, keep_existing=True)
