"""The ``pimm`` logger: rank 0 writes ``save_path/train.log`` and the console
(stderr, as Python's logging does); other ranks report warnings and errors to
the console, and their errors (a failing rank's own traceback) to
``train.log`` too, marked ``[rankN]``. Tracebacks go to ``train.log``, not
the console (unless ``PIMM_DEBUG=1``). While a tqdm progress bar is on the
terminal, a console line clears it, prints on a line of its own and redraws
it, so a log line never shares a line with the bar."""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

__all__ = ["setup_logger", "get_root_logger", "FILE_ONLY", "log_file", "LOG_PREFIX_WIDTH", "CONSOLE_WIDTH",
           "fit_line"]

#: ``logger.error(..., exc_info=True, extra=FILE_ONLY)``: a traceback for
#: ``train.log`` only, behind a one-line error the user already sees.
FILE_ONLY = {"file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)

_FORMAT = "[%(asctime)s %(levelname)s] %(message)s"
#: characters the console format puts before a message ("[2026-01-31 12:00:00 INFO] ")
LOG_PREFIX_WIDTH = 27
#: the longest console line pimm writes for a metrics summary, time stamp included
CONSOLE_WIDTH = 160


def fit_line(head: str, items: list[str], tail: str = "", max_width: int = CONSOLE_WIDTH,
             max_items: int | None = None) -> str:
    """``head item item ... tail`` with as many ``items`` as fit in ``max_width``
    console characters (time stamp included); the rest are counted as
    ``(+N in metrics.jsonl)``, where every value is kept."""
    budget = max_width - LOG_PREFIX_WIDTH
    shown: list[str] = []
    for index, item in enumerate(items):
        hidden = len(items) - index - 1
        more = f" (+{hidden} in metrics.jsonl)" if hidden else ""
        if (max_items is not None and index >= max_items) or \
                len(" ".join([head, *shown, item, tail]).rstrip() + more) > budget:
            break
        shown.append(item)
    if len(shown) < len(items):
        shown.append(f"(+{len(items) - len(shown)} in metrics.jsonl)")
    return " ".join(part for part in [head, *shown, tail] if part)


class _ConsoleFormatter(logging.Formatter):
    """The console shows a failure's message; its traceback goes to ``train.log``
    only (the launcher's one ``error:`` line points there). ``PIMM_DEBUG=1``
    shows it on the console too."""

    def format(self, record: logging.LogRecord) -> str:
        if (record.exc_info or record.stack_info) and os.environ.get("PIMM_DEBUG") != "1":
            record = logging.makeLogRecord({**record.__dict__, "exc_info": None, "exc_text": None,
                                            "stack_info": None})
        # A multi-line message (a confusion table) keeps its later lines indented, so on stderr
        # they read as part of their record, never as a line of their own like the ``error:`` one.
        return super().format(record).replace("\n", "\n  ")


class _ConsoleHandler(logging.StreamHandler):
    """stderr, stepping around live tqdm bars (``tqdm.external_write_mode``)."""

    def emit(self, record: logging.LogRecord) -> None:
        tqdm_module = sys.modules.get("tqdm")  # no bar can exist unless tqdm was imported
        bars = getattr(getattr(tqdm_module, "tqdm", None), "_instances", None)
        if not bars:
            super().emit(record)
            return
        with tqdm_module.tqdm.external_write_mode(file=self.stream):
            super().emit(record)


class _LogFile(logging.FileHandler):
    """``train.log``. A record it cannot write (a full or read-only disk) is
    dropped and remembered, never reported on stderr by logging's
    "--- Logging error ---" traceback: the run's one ``error:`` line says
    what happened, and whether the log holds the traceback."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        self.failed = True


def log_file(name: str = "pimm") -> Path | None:
    """The log file of logger ``name`` when it has one and every record so far
    was written to it; None otherwise (no file yet, or a write failed)."""
    for handler in logging.getLogger(name).handlers:
        if isinstance(handler, _LogFile):
            return None if handler.failed else Path(handler.baseFilename)
    return None


def _log_thread_failures(logger: logging.Logger) -> None:
    """Route an exception that ends a background thread (tensorboardX's writer
    on a full disk, a W&B thread) to ``logger``: one log line on the console,
    its traceback in ``train.log``, instead of Python's traceback on stderr.
    A hook the user installed is left alone."""
    if threading.excepthook is not threading.__excepthook__ and \
            getattr(threading.excepthook, "__name__", "") != "_pimm_thread_failure":
        return

    def _pimm_thread_failure(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        logger.error(f"background thread {name} failed: {args.exc_type.__name__}: {args.exc_value}",
                     exc_info=(args.exc_type, args.exc_value, args.exc_traceback))

    threading.excepthook = _pimm_thread_failure


def setup_logger(save_path: str | Path | None, rank: int = 0, name: str = "pimm",
                 log_name: str = "train.log") -> logging.Logger:
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(_FORMAT if rank == 0 else f"[rank{rank}] " + _FORMAT, "%Y-%m-%d %H:%M:%S")
    console = _ConsoleHandler(sys.stderr)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(_ConsoleFormatter(formatter._fmt, formatter.datefmt))
    console.addFilter(_NotFileOnly())
    logger.addHandler(console)
    if save_path is not None:
        Path(save_path).mkdir(parents=True, exist_ok=True)
        file_handler = _LogFile(Path(save_path) / log_name, mode="a")
        file_handler.setLevel(logging.INFO if rank == 0 else logging.ERROR)
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    _log_thread_failures(logger)
    return logger


def get_root_logger(log_file: str | os.PathLike | None = None, log_level: int = logging.INFO,
                    file_mode: str = "a") -> logging.Logger:
    """Upstream pimm's name for the ``pimm`` logger. In a run, the logger the
    run set up (console and ``train.log``); outside one it first gets the
    console handler (:func:`setup_logger` without a file). ``log_file`` adds
    that file (rank 0, opened with ``file_mode``) when the logger does not write
    it yet; ``log_level`` is rank 0's level, the other ranks log errors only."""
    from pimm.utils import comm

    logger = logging.getLogger("pimm")
    rank = comm.get_rank()
    if not logger.handlers:
        setup_logger(None, rank)
    if log_file is not None and rank == 0:
        target = Path(log_file).resolve()
        if not any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == target for h in logger.handlers):
            handler = _LogFile(target, mode=file_mode)
            handler.setFormatter(logging.Formatter(_FORMAT, "%Y-%m-%d %H:%M:%S"))
            logger.addHandler(handler)
    logger.setLevel(log_level if rank == 0 else logging.ERROR)
    return logger
