"""The command line behind ``tools/train.py`` and ``tools/test.py``.

Start-up reads the config once, in this order: the engine's runtime defaults,
the file with its ``_base_`` chain, ``--options``, each hook's
``modify_config``; then the config is validated and the trainer is built.

Exit codes (docs/contract.md): 0 done (also a requested early stop); 2 bad
usage, config or input (one ``error:`` line, no traceback unless
``PIMM_DEBUG=1``); 75 pre-empted — after a committed checkpoint, or during
start-up before training began (nothing is lost either way: rerun with
``resume=True``); 1 any other failure (traceback in ``train.log``); 130
interrupted from the keyboard: after the checkpoint of the step in progress
(one Ctrl-C: the line says how to resume), or at once with nothing new
committed (a second Ctrl-C, or Ctrl-C during start-up).
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

from pimm.distributed.launch import DEFAULT_TIMEOUT, launch  # noqa: F401  (upstream's pimm.engines.launch.launch)
from pimm.distributed.spawn import spawn_local
from pimm.engines.control import ABORT_NOW, STANDARD_PREEMPT, ignore_unhandled_usr1
from pimm.engines.loop.default_hooks import hook_order_lines
from pimm.engines.loop.prepare import prepare_config  # noqa: F401  (also importable from here)
from pimm.engines.registries import TRAINERS
from pimm.engines.run.record_form import forget_redacted_secrets, record_form, redacted_config
from pimm.engines.run.resume_config import differences, resume_config
from pimm.engines.run.run_dir import AttemptRecord, guard_fresh_run, write_config
from pimm.engines.run.run_records import apply_launch_command
from pimm.engines.loop.run_summary import log_summary, resume_command
from pimm.engines.run.runtime import apply_runtime_defaults
from pimm.engines.observe.tracing import build_tracer
from pimm.utils import comm
from pimm.utils.config import Config
from pimm.utils.errors import (EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_OK, EXIT_PREEMPTED, EXIT_USAGE, ConfigError,
                               TrainingInterrupted, TrainingPreempted, UserError)
from pimm.utils.logger import setup_logger
from pimm.utils.run_lock import RunLock
from pimm.engines.run.launch_args import (_config_source, _failure_line, _os_error, _parser,  # noqa: F401
                                          _report_error, _strip_num_gpus)

__all__ = ["main", "load_config", "prepare_config", "build_trainer", "build_tester", "launch", "DEFAULT_TIMEOUT"]


def load_config(config_file: str, options: list[str], world_size: int, mode: str = "train",
                check_save_path: bool = True):
    """The validated config and its built hooks (see the module docstring for the
    order). ``check_save_path``: refuse a fresh run over an earlier one's results
    (the launcher does it itself once it holds the run lock). A resume runs
    the file, the options the run was started with (recorded in its
    ``config.py``) and ``options`` (:mod:`pimm.engines.run.resume_config`)."""
    cfg = Config.fromfile(config_file)
    apply_runtime_defaults(cfg)
    cfg.merge_from_options(options)
    cfg.set_command_options(options)
    forgotten = forget_redacted_secrets(cfg)  # a record's "<redacted>" is never used as the secret
    apply_launch_command(cfg)  # PIMM_LAUNCH_COMMAND, when the config names none
    hooks = prepare_config(cfg, world_size, mode)  # the command line itself must be valid, resume or not
    record = None
    if mode == "train" and cfg.resume:
        resumed, record, note = resume_config(config_file, options, cfg, apply_runtime_defaults)
        if record is not None:
            cfg = resumed
            forgotten = forget_redacted_secrets(cfg)
            apply_launch_command(cfg)
            hooks = prepare_config(cfg, world_size, mode)
    lines = []
    if record is not None:
        # The file ignored or the options applied again, then every difference from the record: once, in the log.
        changed = differences(record, record_form(cfg))
        lines += [f"Resuming {cfg.save_path}: {note}"] if note else []
        if changed:
            lines.append("the config differs from the run's record in: " + "; ".join(changed))
    if forgotten:
        lines.append(f"{', '.join(forgotten)}: a secret, never recorded (\"<redacted>\"); left unset, so the hook's "
                     "default applies (PushToHub: the HF_TOKEN environment variable or the stored login); give it "
                     "again with --options KEY=VALUE to use another (docs/security.md)")
    object.__setattr__(cfg, "_resume_note", "; ".join(lines) or None)
    if mode == "train" and check_save_path:
        guard_fresh_run(cfg)
    elif mode == "test" and not cfg.weight:
        raise ConfigError("tools/test.py needs the weights to evaluate: --options weight=PATH/model_best.pth")
    return cfg, hooks


def build_trainer(cfg, mode: str = "train", hooks=None, tracer=None):
    """The trainer ``cfg.train`` names, built with its options (``mode="test"``:
    the :class:`~pimm.engines.loop.testers.Tester` instead, see :func:`build_tester`).
    ``hooks``: those :func:`load_config` built (None: the trainer prepares the
    config itself)."""
    if mode == "test":
        return build_tester(cfg, hooks)
    extra = {"tracer": tracer} if tracer is not None else {}
    return TRAINERS.build(dict(cfg.train, cfg=cfg, hooks=hooks, **extra))


def build_tester(cfg, hooks=None):
    """The :class:`~pimm.engines.loop.testers.Tester` for ``cfg`` (``tools/test.py``,
    ``test_only=True``), collating as the trainer ``cfg.train`` names."""
    from pimm.engines.loop.testers import Tester

    options = {k: v for k, v in dict(cfg.train).items() if k in ("collate_fn", "val_collate_fn")}
    return Tester(cfg, hooks=hooks, **options)


def _resume_after_elastic_restart(cfg) -> None:
    """torchrun restarts failed workers with the same arguments: a restarted
    worker (``TORCHELASTIC_RESTART_COUNT`` > 0) continues the run it belongs to."""
    if not cfg.resume and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        cfg.resume = True


def _resolve_seed(cfg) -> None:
    """``seed=None``: a resumed run reuses the seed its config.py recorded; a new
    run draws one (rank 0's, for every rank) and config.py records it."""
    if cfg.seed is not None:
        return
    recorded = None
    path = Path(cfg.save_path) / "config.py"
    if cfg.resume and path.is_file():
        try:
            recorded = Config.fromfile(str(path)).get("seed")
        except UserError:
            recorded = None
    cfg.seed = comm.broadcast_object(recorded if recorded is not None else random.SystemRandom().randrange(2**31))


def _preempted_during_startup(signum, frame):
    raise TrainingPreempted(f"{signal.Signals(signum).name} during start-up, before training began")


def _install_startup_signals(names) -> None:
    for name in names:
        if hasattr(signal, name):
            try:
                signal.signal(getattr(signal, name), _preempted_during_startup)
            except ValueError:  # not the main thread
                pass


def _run(args, mode: str, attempt_box: list) -> int:
    lock: list = []
    try:
        return _run_in_process_group(args, mode, attempt_box, lock)
    finally:
        for held in lock:
            held.release()
        for name in (*STANDARD_PREEMPT, "SIGUSR1", *_PREEMPT_NAMES):
            if hasattr(signal, name):
                try:
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
                except ValueError:
                    pass


# What every rank imports beyond this launcher (torch.distributed, the optimizers'
# torch._dynamo, the default writer): forked ranks find them imported once.
RANK_IMPORTS = ("torch.distributed", "torch._dynamo", "tensorboardX")
_PREEMPT_NAMES: list[str] = []
_LOCKS: list = []  # the run locks this process took (for the reason when one was lost)
_RUN: dict = {}  # save_path and world size once known, for the line an interruption prints


def _stop_writing(reason: str) -> None:
    """The run lock was taken by another run (found by its heartbeat thread):
    interrupt the main thread at once (not the graceful first Ctrl-C: nothing
    more may be written); :func:`main` reports ``reason``, exit 2."""
    import _thread

    ABORT_NOW.set()
    _thread.interrupt_main()


def _lost_lock() -> str | None:
    return next((lock.lost for lock in list(_LOCKS) if lock.lost), None)


def _take_run_lock(cfg, lock: list, mode: str = "train") -> None:
    """One run per save_path: rank 0 holds the lock for the run's life (a
    ``--num-gpus`` parent already holds it for its ranks); every rank learns
    whether it was granted, so all stop together when it was not. A test
    (``mode="test"``) writes ``test.log`` and ``test_metrics.json`` into its
    save_path, so it takes the same lock: never into a run that is training."""
    error = None
    if comm.get_rank() == 0 and not os.environ.get("PIMM_RUN_LOCK_HELD"):
        try:
            lock.append(RunLock(cfg.save_path, on_lost=_stop_writing).acquire())
            _LOCKS[:] = lock
        except UserError as err:
            error = str(err) if mode == "train" else (
                f"{err} (a test writes test.log and test_metrics.json there: --options save_path=DIR tests into "
                "another directory)")
    error = comm.broadcast_object(error)
    if error is not None:
        raise UserError(error if comm.get_rank() == 0 else "rank 0 could not lock save_path (see its error)")
    if mode == "train":
        guard_fresh_run(cfg)


def _run_in_process_group(args, mode: str, attempt_box: list, lock: list) -> int:
    started = time.monotonic()
    comm.init_distributed_from_env()
    _install_startup_signals(STANDARD_PREEMPT)
    ignore_unhandled_usr1()  # until a hook (OnDemandValidation) listens for it
    cfg, hooks = load_config(*_config_source(args), comm.get_world_size(), mode, check_save_path=False)
    if mode == "train" and cfg.test_only:
        if not cfg.weight:
            raise ConfigError("test_only=True scores weights on data.test: give them with weight=PATH")
        mode = "test"
    if mode == "test":
        _take_run_lock(cfg, lock, mode)
    if mode == "train":
        _resume_after_elastic_restart(cfg)
        _take_run_lock(cfg, lock)
        _RUN.update(save_path=os.path.abspath(cfg.save_path), world_size=comm.get_world_size(), rank=comm.get_rank())
    _install_startup_signals(cfg.preempt_signals)
    _PREEMPT_NAMES[:] = cfg.preempt_signals
    _resolve_seed(cfg)
    rank = comm.get_rank()
    # A resume rewrites config.py only once its checkpoint is restored: a
    # refused resume leaves the run's record as it was.
    defer_record = mode == "train" and bool(cfg.resume) and (Path(cfg.save_path) / "config.py").is_file()
    if rank == 0 and mode == "train" and not defer_record:
        write_config(cfg)
    logger = setup_logger(cfg.save_path, rank, log_name="train.log" if mode == "train" else "test.log")
    number = None
    if rank == 0:
        attempt = AttemptRecord(cfg.save_path, mode, comm.get_world_size())
        record = attempt.start()
        attempt_box.append(attempt)
        number = attempt.attempt
        logger.info(f"pimm {mode}: {args.config_file or cfg.filename} (save_path {cfg.save_path}, seed {cfg.seed})")
        logger.info(attempt.summary(record))
        for held in lock:
            if held.took_over:
                logger.warning(held.took_over)
        if cfg.__dict__.get("_resume_note"):
            logger.warning(cfg.__dict__["_resume_note"])
    number = comm.broadcast_object(number)
    tracer = None
    if mode == "train":
        job = os.environ.get("SLURM_JOB_ID") or os.environ.get("TORCHELASTIC_RUN_ID")
        tracer = build_tracer(cfg.structured_logging, cfg.save_path, rank, comm.get_world_size(), attempt=number,
                              job=job)
    try:
        trainer = build_trainer(cfg, mode, hooks, tracer=tracer)
        if rank == 0 and defer_record:
            _record_config_after_restore(trainer, cfg)
        if mode == "train":
            trainer.train()
        else:
            trainer.test()
    except (UserError, TrainingPreempted, TrainingInterrupted, KeyboardInterrupt):
        raise
    except BaseException as err:
        if not getattr(err, "_pimm_logged", False):
            logger.exception(f"{mode} failed")
            err._pimm_logged = True
        raise
    if mode == "train" and trainer.outcome == "stopped":
        attempt_box.append(f"stopped: {trainer.control.describe()}")
    if mode == "train" and rank == 0:
        log_summary(trainer, time.monotonic() - started)
    return EXIT_OK


def _record_config_after_restore(trainer, cfg) -> None:
    """Write ``config.py`` right after the trainer restored its checkpoint, so
    that a resume refused while restoring leaves the run's record untouched."""
    restore = trainer.restore

    def restore_then_record():
        restored = restore()
        write_config(cfg)
        return restored

    trainer.restore = restore_then_record


def _print_config(args, mode: str) -> int:
    """``--print-config``: the config the run would use, resume included; nothing is written."""
    cfg, hooks = load_config(*_config_source(args), args.num_gpus, mode, check_save_path=False)
    if cfg.__dict__.get("_resume_note"):
        print(f"# {cfg.__dict__['_resume_note']}", file=sys.stderr)
    sys.stdout.write(redacted_config(cfg).dump())  # secrets redacted: a printed config gets pasted
    sys.stdout.write("\n# The hooks this run registers, in the order they run (priority, then default_hooks "
                     "before the hooks list):\n")
    sys.stdout.write("".join(f"#   {line.rstrip()}\n" for line in hook_order_lines(hooks)) or "#   (none)\n")
    return EXIT_OK


def main(argv: list[str] | None = None, mode: str = "train") -> int:
    """The command line of ``tools/train.py`` (``mode="train"``) and
    ``tools/test.py`` (``mode="test"``): parse ``argv`` (default ``sys.argv[1:]``),
    start ``--num-gpus`` local processes or run in this one, and return the exit
    code (see the module docstring: 0, 2, 75, 1, 130). Never raises for bad
    input: it prints one ``error:`` line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("PIMM_DEBUG") == "1"
    _RUN.clear()
    _LOCKS.clear()  # a forked rank inherits its launcher's (disowned) lock: not this run's
    ABORT_NOW.clear()
    attempt_box: list = []
    code, reason = EXIT_FAILURE, "failed"
    try:
        args = _parser(mode).parse_args(argv)
        if args.num_gpus < 1:
            raise UserError(f"--num-gpus {args.num_gpus} is invalid: give 1 or more")
        if args.print_config:
            return _print_config(args, mode)
        if args.num_gpus > 1:
            if "WORLD_SIZE" in os.environ:
                raise UserError("--num-gpus starts its own processes and cannot be combined with torchrun's "
                                "WORLD_SIZE/RANK variables: use one or the other")
            # Validate once here, so bad input gives one error line rather than N.
            cfg, _ = load_config(*_config_source(args), args.num_gpus, mode, check_save_path=False)
            if mode != "train":
                return spawn_local([sys.argv[0], *_strip_num_gpus(argv)], args.num_gpus, preload=RANK_IMPORTS)
            with RunLock(cfg.save_path, on_lost=_stop_writing) as parent_lock:  # held for all its ranks
                _LOCKS[:] = [parent_lock]
                guard_fresh_run(cfg)
                return spawn_local([sys.argv[0], *_strip_num_gpus(argv)], args.num_gpus,
                                   env={"PIMM_RUN_LOCK_HELD": "1"}, log_path=str(Path(cfg.save_path) / "train.log"),
                                   abort=ABORT_NOW, preload=RANK_IMPORTS)
        code = _run(args, mode, attempt_box)
        reason = next((r for r in attempt_box if isinstance(r, str)), "completed")
        return code
    except UserError as err:
        code, reason = EXIT_USAGE, f"bad input: {err}"
        if debug:
            traceback.print_exc()
            if getattr(err, "full_text", str(err)) != str(err):
                print(err.full_text, file=sys.stderr)
        _report_error(f"error: {err}")
        return code
    except TrainingPreempted as err:
        code, reason = EXIT_PREEMPTED, f"pre-empted: {err}"
        if "start-up" in str(err):
            _report_error(f"error: pre-empted by {err}; nothing was lost: rerun with resume=True (exit code "
                          f"{EXIT_PREEMPTED})")
        return code
    except TrainingInterrupted as err:
        code, reason = EXIT_INTERRUPTED, f"interrupted: {err}"
        if _RUN.get("rank", 0) == 0:
            _report_error(f"interrupted (Ctrl-C): checkpoint committed; continue with: "
                          f"{resume_command(_RUN['save_path'], _RUN['world_size'])}")
        return code
    except KeyboardInterrupt:
        lost = _lost_lock()
        if lost is not None:  # the heartbeat interrupted us: another run took save_path
            code, reason = EXIT_USAGE, f"run lock lost: {lost}"
            _report_error(f"error: {lost}")
            return code
        code, reason = EXIT_INTERRUPTED, "interrupted"
        if "save_path" in _RUN:
            if _RUN.get("rank", 0) == 0:
                _report_error("error: aborted (Ctrl-C): no new checkpoint; the last committed one (if any) is "
                              f"resumed by: {resume_command(_RUN['save_path'], _RUN['world_size'])}")
        else:
            _report_error("error: interrupted")
        return code
    except Exception as err:
        code, reason = EXIT_FAILURE, f"failed: {type(err).__name__}: {err}"
        if debug:
            traceback.print_exc()
        _report_error(_failure_line(err, mode))
        return code
    finally:
        for attempt in attempt_box:
            if isinstance(attempt, AttemptRecord):
                attempt.end(reason, code)
        comm.destroy_distributed()


