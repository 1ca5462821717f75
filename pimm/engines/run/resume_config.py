"""Which config a resume runs: the run's own, not a command line that forgot
its overrides.

The trap this avoids: a run started with ``--options epoch=20 optimizer.lr=0.002``
and resumed by a command line without those overrides used to be rebuilt from
the config file alone. It then silently trained another run (4 epochs,
another lr) or, when the shorter schedule no longer fitted the step already
reached, died on a raw ``ValueError: Tried to step 331 times``.

The rule (docs/checkpoints.md, "Which config a resume uses"). Every run
records the ``--options`` it was started with in the header of its
``save_path/config.py``. With ``resume=True`` the config is

    the config file  +  the run's recorded options that define it  +  the options given now

(those that define it: epoch, model, optimizer, scheduler, data, batch
sizes, seed, ... — :data:`RUN_DEFINING`; hook and logging options belong to
one attempt), so a resume given without the earlier overrides continues the
same run, an edit of the config file and a new option are deliberate changes, and each
difference from the run's record is listed once in the log. A change that no
longer fits the run (a schedule shorter than the step reached) stops with exit
2 when the checkpoint is restored, before anything in the run directory is
rewritten. A record without the options header (written before pimm recorded
them) is itself the base, the new options on top, and the keys where the
config file differs from it are listed as kept from the run.

``pimm train --resume RUN_DIR`` runs the recorded ``config.py`` itself with
the new options on top: no config file is needed.
"""

from __future__ import annotations

from pathlib import Path

from pimm.utils.config import Config
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.redaction import is_secret_key

__all__ = ["RECORD", "recorded_config", "resume_config", "run_dir_options", "differences"]

RECORD = "config.py"
# Keys a resume takes from where it runs, never from the record.
_LOCAL_KEYS = ("save_path", "resume")
# Top-level keys whose start options define the run, so a resume applies them
# again; the others (hooks, logging, intervals, save_path) are the command
# line's: a hook option such as a fault injection or a log frequency is a
# condition of one attempt, not part of the run.
RUN_DEFINING = ("epoch", "model", "optimizer", "scheduler", "data", "param_dicts", "batch_size", "batch_size_val",
                "grad_accum_steps", "seed", "clip_grad", "enable_amp", "amp_dtype", "train", "num_worker",
                "parallel", "custom_imports", "gradient_checkpointing")


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
    if (root / "COMMITTED").is_file():  # a checkpoint folder: save_path/checkpoints/<step>
        run = root.parent.parent
        spelling = (f"--config-file {run / RECORD} --options save_path={run} resume={root}" if (run / RECORD).is_file()
                    else f"--config-file CFG --options resume={root}")
        raise ConfigError(f"--resume {run_dir}: this is a checkpoint folder; --resume takes a run directory "
                          f"(save_path). To continue from this checkpoint write: {spelling}")
    if not (root / RECORD).is_file():
        what = "does not exist" if not root.exists() else f"holds no {RECORD}: it is not a pimm run directory"
        raise ConfigError(f"--resume {run_dir}: the directory {what}; give the save_path of a run started by "
                          "pimm train")
    return str(root / RECORD), [f"save_path={str(root)}", "resume=True"]


def resume_config(config_file: str, options: list[str], from_command_line: Config,
                  defaults) -> tuple[Config, Config | None, str | None]:
    """The config a resume runs (before hooks and validation), the run's record
    (None when ``save_path`` holds none) and a line for the log (or None).
    ``defaults`` fills in the runtime keys (``apply_runtime_defaults``)."""
    save_path, resume = from_command_line.save_path, from_command_line.resume
    record_path = Path(save_path) / RECORD
    record = recorded_config(save_path)
    if record is None:
        return from_command_line, None, None
    started_with = Config.recorded_options(record_path)
    if Path(config_file).resolve() == record_path.resolve():
        # --resume RUN_DIR: the record already holds its options (a copy: the record stays the reference)
        cfg, note = Config.fromfile(str(record_path)), None
        started_with = started_with or []
    elif started_with is None:
        cfg = Config.fromfile(str(record_path))  # a record without its options: the record is the run
        ignored = differences(record, from_command_line)
        note = ("kept from the run's record (config.py, written before pimm recorded a run's options), where the "
                f"command line differs from it: {'; '.join(ignored)}" if ignored else None)
        started_with = []
    else:
        cfg = Config.fromfile(config_file)
        again = [t for t in _still_standing(started_with, options) if _defines_the_run(t)]
        note = f"the options this run was started with, applied again: {' '.join(again)}" if again else None
        defaults(cfg)
        try:
            cfg.merge_from_options(again)
        except UserError as err:
            raise ConfigError(f"resume: the options this run was started with (recorded in {record_path}) no longer "
                              f"apply to {config_file}: {err}. Resume with --resume {save_path} to run the "
                              "recorded config itself (nothing was changed)") from None
    defaults(cfg)  # keys added to pimm since the run started
    cfg.merge_from_options(options)
    cfg.save_path, cfg.resume = save_path, resume
    cfg.set_command_options([*(t for t in _still_standing(started_with, options) if _defines_the_run(t)), *options])
    return cfg, record, note


def _defines_the_run(token: str) -> bool:
    return token.partition("=")[0].lstrip("+").strip().split(".")[0] in RUN_DEFINING


def _still_standing(earlier: list[str], now: list[str]) -> list[str]:
    """The earlier options that the new ones neither repeat nor replace (a
    plain ``key=value`` is replaced by a later one for the same key; a
    ``+key=...`` only by the same token, so an append is never doubled)."""
    keys_now = {t.partition("=")[0].strip() for t in now if not t.startswith("+")}
    return [t for t in earlier if t not in now and (t.startswith("+") or t.partition("=")[0].strip() not in keys_now)]


def differences(record, resumed, limit: int = 12) -> list[str]:
    """``key: run value -> now`` for each key where ``resumed`` differs from the
    record (secrets, never recorded, are no difference and never shown)."""
    from pimm.engines.state.restore import flatten_config

    def flat(cfg):
        return {k: v for k, v in flatten_config(cfg).items()
                if k.split(".")[0] not in _LOCAL_KEYS and not is_secret_key(k)}

    ours, theirs = flat(record), flat(resumed)
    keys = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
    shown = [f"{k}: {ours.get(k, '<unset>')} -> {theirs.get(k, '<unset>')}" for k in keys[:limit]]
    return shown + ([f"... and {len(keys) - limit} more"] if len(keys) > limit else [])
