"""Which config a resume runs: the run's own record, not the command line's.

The trap this avoids: a run started with ``--options epoch=20 optimizer.lr=0.002``
and resumed with the command line minus those overrides used to rebuild the
run from the config file alone. It then silently trained another run (4
epochs, another lr) or, when the shorter schedule no longer fitted the step
already reached, died on a raw ``ValueError: Tried to step 331 times``.

The rule (docs/checkpoints.md, "Which config a resume uses"): with
``resume=True`` and a ``config.py`` in ``save_path`` (written by every run),

* the run's recorded ``config.py`` is the base;
* the ``--options`` given now apply on top of it (explicit changes: the
  checkpoint's restore lists each one that differs, and refuses, exit 2, a
  schedule that no longer reaches the step the run is at);
* where the config file on the command line differs from the record (the
  overrides the run was started with, or an edit of the file since), the
  run's value is kept and the keys are listed once in the log: pass them as
  ``--options`` to change them;
* ``save_path`` is where the run was found, so a moved run directory resumes.

``pimm train --resume RUN_DIR`` is the same with no config file at all.
"""

from __future__ import annotations

from pathlib import Path

from pimm.utils.config import Config
from pimm.utils.errors import ConfigError, UserError

__all__ = ["recorded_config", "run_dir_options", "ignored_file_keys", "RECORD"]

RECORD = "config.py"
# Keys a resume takes from where it runs, never from the record.
_LOCAL_KEYS = ("save_path", "resume")


def recorded_config(save_path: str | Path) -> Config | None:
    """The run's recorded config, or None when ``save_path`` holds none (a run
    that never started: the config file is then all there is)."""
    path = Path(save_path) / RECORD
    if not path.is_file():
        return None
    try:
        return Config.fromfile(str(path))
    except UserError as err:
        raise ConfigError(f"resume=True: the run's recorded {path} cannot be read ({err}); fix or remove it, or "
                          "resume from another save_path (nothing was changed)") from None


def run_dir_options(run_dir: str) -> tuple[str, list[str]]:
    """``--resume RUN_DIR``: the recorded config file and the options that put
    the run where it was found."""
    root = Path(run_dir)
    if not (root / RECORD).is_file():
        what = "does not exist" if not root.exists() else f"holds no {RECORD}: it is not a pimm run directory"
        raise ConfigError(f"--resume {run_dir}: the directory {what}; give the save_path of a run started by "
                          "pimm train")
    return str(root / RECORD), [f"save_path={str(root)!r}", "resume=True"]


def _flat(cfg) -> dict[str, str]:
    from pimm.engines.state.restore import flatten_config

    return {k: v for k, v in flatten_config(cfg).items() if k.split(".")[0] not in _LOCAL_KEYS}


def ignored_file_keys(from_file, resumed, limit: int = 12) -> str | None:
    """One line naming the keys where the command line's config (file and
    options) differs from the config the resume runs (the record with the
    options), or None when they agree."""
    ours, theirs = _flat(resumed), _flat(from_file)
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    if not keys:
        return None
    shown = [f"{k} (run {ours.get(k, '<unset>')}, file {theirs.get(k, '<unset>')})" for k in keys[:limit]]
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ("Resuming with the run's own recorded config.py: the config file differs from it in "
            f"{'; '.join(shown)}{more}. The run's values are kept (they include the --options it was started "
            "with); pass --options KEY=VALUE on the resume to change one")
