"""The ``pimm`` logger: rank 0 writes ``save_path/train.log`` and the console;
other ranks report warnings and errors to the console, and their errors
(a failing rank's own traceback) to ``train.log`` too, marked ``[rankN]``."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["setup_logger", "FILE_ONLY", "log_file"]

#: ``logger.error(..., exc_info=True, extra=FILE_ONLY)``: a traceback for
#: ``train.log`` only, behind a one-line error the user already sees.
FILE_ONLY = {"file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)

_FORMAT = "[%(asctime)s %(levelname)s] %(message)s"


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


def setup_logger(save_path: str | Path | None, rank: int = 0, name: str = "pimm",
                 log_name: str = "train.log") -> logging.Logger:
    logger = logging.getLogger(name)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    formatter = logging.Formatter(_FORMAT if rank == 0 else f"[rank{rank}] " + _FORMAT, "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    console.setFormatter(formatter)
    console.addFilter(_NotFileOnly())
    logger.addHandler(console)
    if save_path is not None:
        Path(save_path).mkdir(parents=True, exist_ok=True)
        file_handler = _LogFile(Path(save_path) / log_name, mode="a")
        file_handler.setLevel(logging.INFO if rank == 0 else logging.ERROR)
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    return logger
