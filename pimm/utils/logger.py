"""The ``pimm`` logger: rank 0 writes ``save_path/train.log`` and the console
(stderr, as Python's logging does); other ranks report warnings and errors to
the console, and their errors (a failing rank's own traceback) to
``train.log`` too, marked ``[rankN]``. While a tqdm progress bar is on the
terminal, a console line clears it, prints on a line of its own and redraws
it, so a log line never shares a line with the bar."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

__all__ = ["setup_logger", "FILE_ONLY", "LOG_PREFIX_WIDTH"]

#: ``logger.error(..., exc_info=True, extra=FILE_ONLY)``: a traceback for
#: ``train.log`` only, behind a one-line error the user already sees.
FILE_ONLY = {"file_only": True}


class _NotFileOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not getattr(record, "file_only", False)

_FORMAT = "[%(asctime)s %(levelname)s] %(message)s"
#: characters the console format puts before a message ("[2026-01-31 12:00:00 INFO] ")
LOG_PREFIX_WIDTH = 27


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
    console.setFormatter(formatter)
    console.addFilter(_NotFileOnly())
    logger.addHandler(console)
    if save_path is not None:
        Path(save_path).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(save_path) / log_name, mode="a")
        file_handler.setLevel(logging.INFO if rank == 0 else logging.ERROR)
        file_handler.setFormatter(formatter)
        logger.addHandler(file_handler)
    return logger
