"""Start ``python SCRIPT ...`` as a fork of this process: a warm start.

A rank that ``--num-gpus N`` starts as a fresh interpreter spends its first
~2 CPU seconds importing torch and pimm, which its launcher has already
imported; on a CPU-only machine that start-up is most of a short run. A fork
of the launcher skips it: :func:`fork_main` forks, and the child becomes
``python argv...`` the way an interpreter would: numpy's global generator
and torch's default generator reseeded from the OS, as at start-up
(``random`` reseeds itself after a fork), ``sys.argv`` / ``sys.path[0]`` / ``os.environ`` / the standard
streams as the interpreter sets them, the script run as ``__main__``, then
the interpreter's own shutdown (wait for non-daemon threads, ``atexit``
handlers, flush) and its exit code (1 and a traceback for an uncaught
exception, death by SIGINT for an uncaught ``KeyboardInterrupt``).

What a fork keeps from its parent: the modules already imported (with what
they read from the environment at import), the string-hash seed, and the
parent's ``atexit`` handlers (those of pimm's objects are fork-aware: a run
lock disowns itself in a child). Only the forking thread exists in the
child. A CUDA context cannot cross a fork, nor can GNU OpenMP's thread
team, so :func:`can_fork_ranks` allows it only where no GPU is visible and a
canary child can still run a parallel op; otherwise (GPU runs included)
ranks start as fresh interpreters, as ever.
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import time
import warnings

__all__ = ["can_fork_ranks", "fork_main", "run_as_main", "ForkedProcess"]


def can_fork_ranks(argv: list[str], canary_timeout_s: float = 3.0) -> bool:
    """Whether ranks running ``argv`` may be forked from this process: Linux,
    CPU only, a script or ``-c`` (not ``-m``), not turned off with
    ``PIMM_RANK_START=exec``, and a forked child can still run torch's
    parallel ops (see :func:`_parallel_ops_survive_a_fork`)."""
    if os.environ.get("PIMM_RANK_START", "fork") == "exec" or not sys.platform.startswith("linux"):
        return False
    if not argv or argv[0] == "-m" or (argv[0] != "-c" and not os.path.isfile(argv[0])):
        return False
    torch = sys.modules.get("torch")
    if torch is None:
        return True  # nothing imported, nothing initialised
    if torch.cuda.is_initialized():
        return False
    # device_count() asks NVML, which a fork survives; is_available() may initialise the driver.
    if torch.backends.cuda.is_built() and torch.cuda.device_count() > 0:
        return False
    return _parallel_ops_survive_a_fork(canary_timeout_s)


def _parallel_ops_survive_a_fork(timeout_s: float) -> bool:
    """Fork a canary that runs a parallel op and an OpenMP matmul. GNU
    OpenMP's thread team does not survive a fork: once this process has run
    a parallel op (a user's config or plug-in may have), a forked child hangs
    at its first one. No API says whether the team exists, so try it (tens
    of milliseconds); a canary that is not done in ``timeout_s`` is killed."""
    import torch

    pid = _fork()
    if pid == 0:
        try:
            x = torch.ones(1 << 18)
            (x * 2).sum()
            (torch.ones(64, 64) @ torch.ones(64, 64)).sum()
        finally:
            os._exit(0)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.002)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False


def _fork() -> int:
    with warnings.catch_warnings():
        # Python >= 3.12 warns when other threads run (a run lock's heartbeat
        # here): the child touches none of their locks, and its own code is a
        # script that starts from imports.
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


class ForkedProcess:
    """The parent's handle on a forked child: ``subprocess.Popen``'s ``pid``,
    ``stderr``, ``returncode``, ``poll()``, ``wait()``, ``send_signal()`` and
    ``kill()``."""

    def __init__(self, pid: int, stderr) -> None:
        self.pid = pid
        self.stderr = stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # never signal a pid that was reaped (and may be reused)
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_main(argv: list[str], env: dict, *, new_process_group: bool = True, in_child=None) -> ForkedProcess:
    """Fork; the child runs ``python argv...`` with environment ``env`` and
    its stderr into a pipe that the returned handle reads. ``in_child`` (no
    arguments) runs in the child first, e.g. to set a death signal."""
    read_fd, write_fd = os.pipe()
    for stream in (sys.stdout, sys.stderr):  # else what they buffered is written twice
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    pid = _fork()
    if pid == 0:
        try:
            os.close(read_fd)
            if new_process_group:
                os.setpgid(0, 0)
            if in_child is not None:
                in_child()
            os.dup2(write_fd, 2)
            os.close(write_fd)
        except BaseException:  # noqa: BLE001 - never return into the parent's code
            os._exit(1)
        run_as_main(argv, env)
    os.close(write_fd)
    return ForkedProcess(pid, os.fdopen(read_fd, "rb"))


def _reset_signals() -> None:
    """The dispositions a fresh interpreter starts with (SIGPIPE stays ignored, as Python sets it)."""
    try:
        signal.set_wakeup_fd(-1)
    except (ValueError, OSError):
        pass
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP, getattr(signal, "SIGPIPE", None)):
            continue
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _fresh_std_streams() -> None:
    """Text streams over fds 1 and 2 as ``python`` builds them (with
    ``PYTHONUNBUFFERED`` from the child's environment): the parent's may be
    something else (a test's capture) or be buffered differently."""
    encoding = getattr(sys.__stderr__, "encoding", None) or "utf-8"
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    for fd, name, errors in ((1, "stdout", "strict"), (2, "stderr", "backslashreplace")):
        try:
            raw = io.FileIO(fd, "w", closefd=False)
        except OSError:
            continue
        stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=encoding, errors=errors,
                                  line_buffering=not unbuffered and (name == "stderr" or os.isatty(fd)),
                                  write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _fresh_generators() -> None:
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()  # from the OS, as at start-up
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.default_generator.seed()  # from the OS, as at start-up


def _exit_code(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def run_as_main(argv: list[str], env: dict | None = None) -> None:
    """In a forked child: become ``python argv...`` (``sys.path[0]`` set as
    the interpreter sets it, the rest of ``sys.path`` left) and never return."""
    import atexit
    import runpy
    import traceback

    code = 1
    try:
        _reset_signals()
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        _fresh_std_streams()
        _fresh_generators()
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:  # noqa: BLE001 - an uncaught exception: traceback and exit 1, like python
        traceback.print_exc()
        code = 1
    try:  # the interpreter's own shutdown order: threads, then atexit, then the streams
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:  # noqa: BLE001
        pass
    if code < 0:  # died of Ctrl-C, as python does for an uncaught KeyboardInterrupt
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)
