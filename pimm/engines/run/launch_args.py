"""The command line of ``tools/train.py`` / ``tools/test.py`` (``pimm train|test``):
the parser with its one-line usage errors, where the config comes from, the
``--num-gpus`` flag the workers must not see again, and the one ``error:``
line a failed run ends with. :mod:`pimm.engines.run.launch` runs what they parse.
"""

from __future__ import annotations

import argparse
import errno
import logging
import sys

from pimm.engines.run.resume_config import run_dir_options
from pimm.engines.run.run_dir import test_source
from pimm.utils.errors import UserError
from pimm.utils.logger import FILE_ONLY, log_file


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like every other bad input
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise UserError(f"{message} (usage: {usage})")


def _parser(mode: str) -> _Parser:
    parser = _Parser(prog=f"tools/{mode}.py", description=f"pimm {mode}")
    parser.add_argument("--config-file", metavar="CFG",
                        help="Python config file (pimm://NAME: one shipped in the package)" + (" (required unless --resume RUN_DIR)" if mode == "train" else
                                                     " with --options weight=PATH (or give RUN_DIR instead)"))
    if mode == "test":
        parser.add_argument("run_dir", nargs="?", metavar="RUN_DIR",
                            help="a training run's save_path: test it from its own config.py on data.test")
        parser.add_argument("--checkpoint", metavar="WHICH", default=None,
                            help="with RUN_DIR: the weights to test: best (model/model_best.pth, the default), last "
                                 "(model/model_last.pth), a weight file or a checkpoints/step... folder")
    if mode == "train":
        parser.add_argument("--resume", metavar="RUN_DIR",
                            help="continue the run in RUN_DIR from its own recorded config.py (no --config-file "
                                 "needed; --options still apply on top)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config (what the run would use) and exit without running")
    parser.add_argument("--num-gpus", type=int, default=1, metavar="N",
                        help="local worker processes to start (nccl on CUDA, gloo on CPU)")
    parser.add_argument("--options", nargs="*", action="extend", default=[], metavar="KEY=VALUE",
                        help="config overrides, e.g. optimizer.lr=0.01 default_hooks.checkpoint.save_freq=50 "
                             "(may be given several times; applied in order)")
    return parser


def _config_source(args) -> tuple[str, list[str]]:
    """The config file and options a command line names (``--resume RUN_DIR``:
    the run's recorded config, placed where it was found)."""
    run_dir = getattr(args, "run_dir", None)
    if run_dir:
        if args.config_file:
            raise UserError(f"give the run directory ({run_dir}) or --config-file, not both")
        recorded, placed = test_source(run_dir, args.checkpoint or "best")
        return recorded, [*placed, *args.options]
    if getattr(args, "checkpoint", None):
        raise UserError("--checkpoint chooses weights of a run: give the run directory too (pimm test RUN_DIR "
                        "--checkpoint best|last|PATH)")
    resume_dir = getattr(args, "resume", None)
    if resume_dir:
        recorded, placed = run_dir_options(resume_dir)
        return args.config_file or recorded, [*args.options, *placed]
    if not args.config_file:
        raise UserError("give the config with --config-file CFG" +
                        (", or continue a run with --resume RUN_DIR" if hasattr(args, "resume") else
                         ", or a training run's directory: pimm test RUN_DIR"))
    return args.config_file, args.options


def _os_error(err: BaseException) -> OSError | None:
    """The OS error (with a file name) behind ``err``, following its causes."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno is not None and err.filename:
            return err
        err = err.__cause__ or err.__context__
    return None


def _failure_line(err: Exception, mode: str) -> str:
    """The one ``error:`` line of a failure (exit 1): an OS error names the file
    and the error (ENOSPC, EROFS, EACCES, ...); the line points at the log only
    when the traceback is really in it."""
    logger = logging.getLogger("pimm")
    if not getattr(err, "_pimm_logged", False) and log_file() is not None:
        logger.error(f"{mode} failed", exc_info=err, extra=FILE_ONLY)
    os_err = _os_error(err)
    if os_err is not None:
        name = errno.errorcode.get(os_err.errno, str(os_err.errno))
        line = (f"error: cannot write {os_err.filename}: {os_err.strerror} ({name}); committed checkpoints are "
                "intact: fix the disk (space, permissions) and rerun with resume=True")
    else:
        line = f"error: {mode} failed: {err.__class__.__name__}: {err}"
    where = log_file()
    return line + (f" (traceback in {where.name})" if where is not None
                   else " (no log holds the traceback: rerun with PIMM_DEBUG=1 to see it)")


def _report_error(line: str) -> None:
    """One line on stderr (``--num-gpus`` prints a line several ranks report once)."""
    print(line, file=sys.stderr, flush=True)


def _strip_num_gpus(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
            continue
        if token == "--num-gpus":
            skip = True
            continue
        if token.startswith("--num-gpus="):
            continue
        out.append(token)
    return out
