"""Run ``python SCRIPT ...`` / ``python -m MODULE ...`` as real processes that
skip the interpreter's start-up and the imports of torch and pimm.

A toy training run costs about 3 CPU seconds of start-up before its first
step: importing torch, pimm, and torch._dynamo (which every torch optimizer
imports at its first ``add_param_group`` and ``step``: half of it). Each pytest
worker therefore keeps two server processes that imported them once (nothing
else: a server never runs a torch op, so it holds no thread pool) and fork a
child per run, taking turns. The child is a real process with its own pid
(it can be signalled or SIGKILLed, with its own session and process group
when asked), exit code, stdout and stderr (files), current directory and
environment; it reseeds numpy's global generator from the OS as a fresh
interpreter does, runs the script as ``__main__``, then ends the
way an interpreter does (all of that is ``pimm.distributed.forked_main``'s
``run_as_main``, which ``--num-gpus N`` uses to fork its ranks).

What a fresh interpreter would do differently: a module the server imported
stays imported (so ``PYTHONPATH`` cannot hide or replace torch, pimm or
tensorboardX; it does reach everything else), environment variables that a
module reads at import time keep the server's values (the server starts with
``run.env()``'s, the ones every tool run gets), and the children of one
server share its string-hash seed (consecutive runs come from different
servers, so a run and its resume hash strings differently). A test of the
interpreter's own start-up (``python -m pimm``, torchrun, a terminal) keeps
``subprocess``.

Set ``PIMM_TESTS_FRESH_PROCESSES=1`` to run them all as fresh interpreters instead.

``run(argv, ...)`` has ``subprocess.run``'s signature for what the tests use
(``capture_output``, ``text``, ``timeout``, ``env``, ``cwd``) and returns a
``CompletedProcess``; ``popen(argv, stdout=PATH, ...)`` starts one and returns
a ``Process`` with ``subprocess.Popen``'s ``pid``, ``poll()``, ``wait()`` and
``returncode``. argv must start with ``sys.executable``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Imported once by the server; what a toy run of tools/train.py would import.
PRELOAD = ("torch", "torch._dynamo", "pimm.cli", "pimm.engines.launch", "tests.support.toy", "tensorboardX")


# --------------------------------------------------------------------------- server side


def _child(request: dict, protocol_fds: tuple[int, int]) -> None:
    """In the forked child: become ``python argv...`` and never return."""
    from pimm.distributed.forked_main import run_as_main

    try:
        if request.get("new_session"):
            os.setsid()
        for fd in protocol_fds:
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            if path is None:  # stderr into stdout, as subprocess.STDOUT
                os.dup2(1, fd)
                continue
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.chdir(request["cwd"])
        # sys.path as the interpreter builds it: the script's folder (run_as_main), then $PYTHONPATH, then the rest.
        server_pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        rest = [p for p in sys.path[1:] if p not in server_pythonpath]
        sys.path[1:] = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p] + rest
    except BaseException:  # noqa: BLE001 - never return into the server's loop
        os._exit(1)
    run_as_main(request["argv"][1:], request["env"])


def serve() -> None:
    """Read one JSON request a line on stdin, fork a child for each, answer
    ``{"id", "pid"}`` at once and ``{"id", "status"}`` when it ends."""
    import select

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as tools/train.py, before torch is imported
    for name in PRELOAD:
        __import__(name)
    import pimm.cli

    pimm.cli.register_all()
    requests_fd, answers_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    answers = os.fdopen(answers_fd, "w", buffering=1)
    running: dict[int, str] = {}
    pending = b""
    answers.write('{"ready": true}\n')
    while True:
        readable, _, _ = select.select([requests_fd], [], [], 0.02 if running else 1.0)
        if readable:
            chunk = os.read(requests_fd, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request, (requests_fd, answers_fd))
                running[pid] = request["id"]
                answers.write(json.dumps({"id": request["id"], "pid": pid}) + "\n")
        while running:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            answers.write(json.dumps({"id": running.pop(pid), "status": os.waitstatus_to_exitcode(status),
                                      "cpu_s": usage.ru_utime + usage.ru_stime}) + "\n")


# --------------------------------------------------------------------------- client side


class _Server:
    """A server: this process's two (started on first use, ended with the
    process), or one that :func:`server_in` starts in another checkout."""

    def __init__(self, root: Path = ROOT, env: dict | None = None) -> None:
        from tests.support.run import env as tool_env

        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.forkserver"], cwd=root,
                                     env=env if env is not None else tool_env(),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        if "ready" not in json.loads(self.proc.stdout.readline() or '{"failed": 1}'):
            raise RuntimeError("the fork server did not start")
        self.lock = threading.Lock()
        self.next_id = 0
        self.waiting: dict[str, dict] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (its stdin closes); waiting for it counts its CPU time in this process's children."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()

    def _read(self) -> None:
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.lock:
                slot = self.waiting[answer["id"]]
                slot.update(answer)
                if "status" in answer:
                    slot["done"].set()
                elif "pid" in answer:
                    slot["started"].set()
        with self.lock:  # the server died: nobody waits forever
            for slot in self.waiting.values():
                slot.setdefault("status", None)
                slot["started"].set()
                slot["done"].set()

    def start(self, request: dict) -> dict:
        with self.lock:
            self.next_id += 1
            request["id"] = str(self.next_id)
            slot = self.waiting[request["id"]] = {"started": threading.Event(), "done": threading.Event()}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        slot["started"].wait()
        return slot

    def finish(self, slot: dict) -> None:
        with self.lock:
            self.waiting.pop(slot["id"], None)
        global last_cpu_s
        last_cpu_s = slot.get("cpu_s")


last_cpu_s: float | None = None  # CPU seconds of the latest child (for measuring)
_servers: list[_Server | None] = [None, None]
_server_lock = threading.Lock()
_runs = 0


def _next_server() -> _Server:
    """The servers take turns: each has its own string-hash seed (an interpreter
    picks one at start-up), so a run and the run that resumes it hash strings
    differently, as two fresh interpreters would."""
    global _runs
    with _server_lock:
        _runs += 1
        index = _runs % len(_servers)
        server = _servers[index]
        if server is None or server.proc.poll() is not None:
            server = _servers[index] = _Server()
        return server


@contextlib.contextmanager
def server_in(root: str | os.PathLike, env: dict):
    """A server of its own whose torch, pimm and tests come from the checkout
    ``root`` (a copy, as the README's test makes): ``env`` must put ``root``
    first on ``PYTHONPATH``. Pass it to :func:`run` as ``server=``. None when
    ``PIMM_TESTS_FRESH_PROCESSES=1`` (then ``run`` starts fresh interpreters)."""
    if os.environ.get("PIMM_TESTS_FRESH_PROCESSES") == "1":
        yield None
        return
    server = _Server(Path(root), dict(env))
    try:
        yield server
    finally:
        atexit.unregister(server.close)
        server.close()


def run(argv: list[str], *, capture_output: bool = True, text: bool = True, timeout: float | None = None,
        env: dict | None = None, cwd: str | os.PathLike | None = None,
        server: _Server | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, ...)`` through the fork server
    (``server``: one from :func:`server_in`; else this process's, taking turns)."""
    if argv[0] != sys.executable or not capture_output:
        raise ValueError("forkserver.run: argv must start with sys.executable, output captured")
    from tests.support.run import env as tool_env

    if os.environ.get("PIMM_TESTS_FRESH_PROCESSES") == "1":  # check the suite without the fork server
        return subprocess.run(argv, capture_output=True, text=text, timeout=timeout,
                              env=env if env is not None else tool_env(), cwd=cwd)

    server = server or _next_server()
    with tempfile.TemporaryDirectory(prefix="pimm-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        slot = server.start({"argv": [str(a) for a in argv], "cwd": str(Path(cwd or os.getcwd()).resolve()),
                             "env": dict(env if env is not None else tool_env()), "stdout": str(out),
                             "stderr": str(err)})
        try:
            if not slot["done"].wait(timeout):
                if slot.get("pid"):
                    os.kill(slot["pid"], 9)
                slot["done"].wait(30)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_bytes(), err.read_bytes())
        finally:
            server.finish(slot)
        if slot.get("status") is None:
            raise RuntimeError("the fork server died during a run")
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if text:  # as subprocess's text mode: locale encoding, universal newlines
        stdout, stderr = (io.TextIOWrapper(io.BytesIO(data)).read() for data in (stdout, stderr))
    return subprocess.CompletedProcess(argv, slot["status"], stdout, stderr)


class Process:
    """A run started by :func:`popen`: ``subprocess.Popen``'s ``pid``,
    ``returncode`` (negative for a signal), ``poll()`` and ``wait()``."""

    def __init__(self, argv: list[str], server: _Server, slot: dict) -> None:
        self.args, self.pid, self.returncode = argv, slot["pid"], None
        self._server, self._slot = server, slot

    def poll(self) -> int | None:
        if self.returncode is None and self._slot["done"].is_set():
            self._server.finish(self._slot)
            if self._slot.get("status") is None:
                raise RuntimeError("the fork server died during a run")
            self.returncode = self._slot["status"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._slot["done"].wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()


def popen(argv: list[str], *, stdout: str | os.PathLike, stderr: str | os.PathLike | None = None,
          env: dict | None = None, cwd: str | os.PathLike | None = None,
          start_new_session: bool = False) -> Process | subprocess.Popen:
    """``subprocess.Popen(argv, stdout=open(stdout, "w"), stderr=open(stderr, "w") or STDOUT
    when None, ...)`` through the fork server: a real process of its own (its pid can be
    signalled or SIGKILLed, with its process group when ``start_new_session``), without
    the start-up."""
    if argv[0] != sys.executable:
        raise ValueError("forkserver.popen: argv must start with sys.executable")
    from tests.support.run import env as tool_env

    env = dict(env if env is not None else tool_env())
    cwd = str(Path(cwd or os.getcwd()).resolve())
    if os.environ.get("PIMM_TESTS_FRESH_PROCESSES") == "1":
        with open(stdout, "w") as out:
            err = open(stderr, "w") if stderr is not None else None
            try:
                return subprocess.Popen(argv, stdout=out, stderr=err or subprocess.STDOUT, env=env, cwd=cwd,
                                        start_new_session=start_new_session)
            finally:
                if err is not None:
                    err.close()
    server = _next_server()
    slot = server.start({"argv": [str(a) for a in argv], "cwd": cwd, "env": env, "stdout": str(stdout),
                         "stderr": None if stderr is None else str(stderr), "new_session": start_new_session})
    if slot.get("pid") is None:
        raise RuntimeError("the fork server died before starting a run")
    return Process([str(a) for a in argv], server, slot)


if __name__ == "__main__":
    serve()
