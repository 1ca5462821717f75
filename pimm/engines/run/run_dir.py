"""The run directory (``save_path``): refusing to overwrite an earlier run,
writing ``config.py``, and the record of every attempt (``attempts.jsonl``).

Nothing a user made is lost: a fresh run (``resume`` not set) stops with exit
2 when the directory already holds an earlier run's results (checkpoints,
model files, logged metrics, test results). A run that failed before its
first step leaves none of those, so its rerun is not blocked; an earlier,
different ``config.py`` is set aside as ``config.prevN.py``, never replaced.

``attempts.jsonl`` gets one line when an attempt starts (the first run and
every resume: command line, pimm version and git commit with a dirty flag and
a hash of the uncommitted diff, library versions, host, world size, devices,
SLURM/torchrun job ids) and one when it ends (exit reason and code).
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pimm.engines.run.record_form import record_form, without_secrets
from pimm.engines.run.run_records import write_run_records
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.files import append_jsonl, read_jsonl, set_aside
from pimm.utils.redaction import redact_command, redact_secrets

__all__ = ["guard_fresh_run", "write_config", "AttemptRecord", "ATTEMPTS_FILE", "test_source", "CHECKPOINT_CHOICES"]

ATTEMPTS_FILE = "attempts.jsonl"


def _earlier_results(root: Path) -> str | None:
    checkpoints = root / "checkpoints"
    if checkpoints.is_dir() and any(p.name.startswith(("step", ".damaged-step")) for p in checkpoints.iterdir()):
        return "checkpoints"
    model_dir = root / "model"
    if model_dir.is_dir() and any(p.suffix == ".pth" for p in model_dir.iterdir()):
        return "model files (model/*.pth)"
    metrics = root / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        return "a metrics.jsonl"
    if (root / "test_metrics.json").is_file():
        return "test results (test_metrics.json)"
    return None


def guard_fresh_run(cfg) -> None:
    """Refuse a fresh run over an earlier run's results (nothing is changed)."""
    if cfg.resume:
        return
    root = Path(cfg.save_path)
    what = _earlier_results(root) if root.is_dir() else None
    if what:
        raise ConfigError(
            f"save_path {str(root)!r} already holds {what} of an earlier run; pass resume=True to continue it, "
            "or choose another save_path (nothing was changed)"
        )


def write_config(cfg) -> Path:
    """Write the config's record (:func:`~pimm.engines.run.record_form.record_form`:
    as the hooks received it, no secrets) to ``save_path/config.py`` (rank 0), and
    beside it upstream's ``resolved_config.json`` / ``run_metadata.json``
    (:mod:`pimm.engines.run.run_records`). A resume of the same run rewrites it in
    place; any other difference keeps the earlier file beside it."""
    from pimm.utils.config import Config

    path = Path(cfg.save_path) / "config.py"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"save_path={cfg.save_path!r} cannot be created ({err.strerror}): choose a writable "
                          "directory") from None
    if not os.access(path.parent, os.W_OK):
        raise ConfigError(f"save_path={cfg.save_path!r} is not writable: choose a writable directory")
    record = record_form(cfg)
    if path.exists():
        try:
            earlier = Config.fromfile(str(path))
        except UserError:
            earlier = {}
        # A resume (or a run directory that was moved) is the same run: only
        # another config sets the earlier record aside. Secrets are in no record.
        local = ("resume", "save_path", "launch_command", "trust_checkpoint_code")
        if without_secrets({k: v for k, v in earlier.items() if k not in local}) == \
                without_secrets({k: v for k, v in record.items() if k not in local}):
            _dump_record(record, path, same_run=True)
            return path
        set_aside(path)
    _dump_record(record, path, same_run=False)
    return path


def _dump_record(record, path: Path, same_run: bool) -> None:
    """Write ``record`` to ``path`` and the run records beside it (resolved_config.json,
    run_metadata.json: upstream's names)."""
    record.dump(str(path))
    write_run_records(record, same_run=same_run)


def _git_info(root: Path | None = None) -> dict | None:
    """Commit, dirty flag and a hash of the uncommitted diff of the checkout
    pimm runs from, or of ``root`` (None outside a git checkout)."""
    root = Path(__file__).resolve().parents[3] if root is None else Path(root)
    if not (root / ".git").exists():
        return None

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                              check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD")
        untracked = git("ls-files", "--others", "--exclude-standard")
    except (OSError, subprocess.SubprocessError):
        return None
    dirty = bool(diff or untracked)
    info = {"commit": commit, "dirty": dirty}
    if dirty:
        info["diff_sha256"] = hashlib.sha256((diff + untracked).encode()).hexdigest()[:16]
    return info


def _versions() -> dict:
    versions = {"python": sys.version.split()[0]}
    for name in ("torch", "torchdata", "numpy"):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        versions[name] = getattr(module, "__version__", "?")
    return versions


def _devices() -> list[str]:
    import torch

    if torch.cuda.is_available():
        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return [f"cpu ({os.cpu_count()} cores)"]


#: ``pimm test RUN_DIR --checkpoint``: the named model files of a run.
CHECKPOINT_CHOICES = {"best": "model_best.pth", "last": "model_last.pth"}


def _weights_of(run: Path, checkpoint: str) -> Path:
    """The weight file ``--checkpoint`` names in ``run``: best, last, a model file,
    or a committed checkpoint folder (its ``common.pth`` holds the model)."""
    if checkpoint in CHECKPOINT_CHOICES:
        path = run / "model" / CHECKPOINT_CHOICES[checkpoint]
        if not path.is_file():
            hint = ("the run had no evaluator ranking its checkpoints, or never evaluated: use --checkpoint last"
                    if checkpoint == "best" else "the run committed no checkpoint yet")
            raise ConfigError(f"--checkpoint {checkpoint}: {run} has no model/{path.name} ({hint})")
        return path
    path = Path(checkpoint)
    if path.is_dir():
        if not (path / "COMMITTED").is_file() or not (path / "common.pth").is_file():
            raise ConfigError(f"--checkpoint {checkpoint}: not a committed checkpoint folder (no COMMITTED manifest "
                              "or no common.pth); give best, last, a model/*.pth file or a checkpoints/step... folder")
        return path / "common.pth"
    if not path.is_file():
        raise ConfigError(f"--checkpoint {checkpoint}: no such file or folder (give best, last, a weight file or a "
                          "checkpoint folder)")
    return path


def test_source(run_dir: str, checkpoint: str = "best") -> tuple[str, list[str]]:
    """``pimm test RUN_DIR [--checkpoint best|last|PATH]``: the run's recorded
    config file and the options that score the chosen weights on its test
    split, writing ``test.log`` and ``test_metrics.json`` (an earlier one kept
    aside) into the run directory."""
    run = Path(run_dir).resolve()
    record = run / "config.py"
    if not record.is_file():
        what = "does not exist" if not run.exists() else "holds no config.py: it is not a pimm run directory"
        raise ConfigError(f"pimm test {run_dir}: the directory {what}; give the save_path of a run started by "
                          "pimm train")
    weight = _weights_of(run, checkpoint)
    return str(record), [f"save_path={run}", f"weight={weight.resolve()}", "resume=False"]


class AttemptRecord:
    """One attempt's lines in ``attempts.jsonl`` (written by rank 0)."""

    def __init__(self, save_path: str | Path, mode: str, world_size: int):
        self.path = Path(save_path) / ATTEMPTS_FILE
        self.mode, self.world_size = mode, world_size
        self.attempt = 1 + sum(1 for record in read_jsonl(self.path)
                               if record.get("event") == "start" and record.get("mode", "train") == mode)
        self.start_time: float | None = None

    def _append(self, record: dict) -> None:
        append_jsonl(self.path, record)

    def start(self) -> dict:
        """Append the attempt's start record (versions, git state, world size) and return it."""
        import pimm

        self.start_time = time.time()
        record = {
            "event": "start", "attempt": self.attempt, "mode": self.mode, "time": self.start_time,
            "command": redact_command([sys.executable, *sys.argv]), "cwd": os.getcwd(), "host": socket.gethostname(),
            "pid": os.getpid(), "world_size": self.world_size, "devices": _devices(),
            "pimm_version": getattr(pimm, "__version__", "?"), "git": _git_info(), "versions": _versions(),
            "job": {k: os.environ[k] for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "SLURM_ARRAY_TASK_ID",
                                               "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
                    if k in os.environ},
        }
        self._append(record)
        return record

    def end(self, exit_reason: str, exit_code: int) -> None:
        """Append the attempt's end record (reason, exit code, duration)."""
        if self.start_time is None:
            return
        now = time.time()
        self._append({"event": "end", "attempt": self.attempt, "mode": self.mode, "time": now,
                      "duration_s": round(now - self.start_time, 3), "exit_reason": redact_secrets(exit_reason),
                      "exit_code": exit_code})

    def summary(self, record: dict) -> str:
        """One log line describing the start ``record``."""
        git = record.get("git") or {}
        commit = f"{git['commit'][:10]}{' (dirty ' + git['diff_sha256'] + ')' if git.get('dirty') else ''}" \
            if git else "not a git checkout"
        versions = " ".join(f"{k} {v}" for k, v in record["versions"].items())
        job = " ".join(f"{k}={v}" for k, v in record["job"].items())
        return (f"attempt {record['attempt']} on {record['host']} (pid {record['pid']}, world size "
                f"{record['world_size']}, {', '.join(record['devices'])}); pimm {record['pimm_version']} at {commit}; "
                f"{versions}{'; ' + job if job else ''}")
