"""A rank forked from its launcher behaves as the fresh interpreter it replaces
(pimm.distributed.forked_main), and --num-gpus uses it only where it may."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from pimm.distributed.forked_main import can_fork_ranks, fork_main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ranks are forked on Linux only")


def _run(argv, env=None, **kwargs):
    child = fork_main(argv, dict(os.environ, **(env or {})), **kwargs)
    stderr = child.stderr.read().decode()
    child.stderr.close()
    return child.wait(), stderr


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "script.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_forked_script_sees_the_argv_environment_and_streams_a_fresh_interpreter_would(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    script = _script(tmp_path, f"""
        import json, os, sys
        sys.stderr.write("to stderr\\n")
        json.dump(dict(argv=sys.argv, name=__name__, path0=sys.path[0], env=os.environ.get("ONLY_HERE"),
                       parent_only=os.environ.get("PARENT_ONLY"), pgid=os.getpgid(0), pid=os.getpid(),
                       stderr_fd=sys.stderr.fileno()), open({str(out)!r}, "w"))
    """)
    env = dict(os.environ, ONLY_HERE="1")
    monkeypatch.setenv("PARENT_ONLY", "yes")  # in the parent only: the child gets ``env``, nothing else
    child = fork_main([script, "--flag", "x"], env=env)
    stderr = child.stderr.read().decode()
    code = child.wait()
    seen = json.loads(out.read_text())
    assert code == 0 and stderr == "to stderr\n"
    assert seen["argv"] == [script, "--flag", "x"] and seen["name"] == "__main__"
    assert seen["path0"] == str(tmp_path) and seen["env"] == "1" and seen["parent_only"] is None
    assert seen["pid"] == child.pid != os.getpid()
    assert seen["pgid"] == child.pid  # a process group of its own, as Popen(process_group=0)
    assert seen["stderr_fd"] == 2


@pytest.mark.parametrize("body, code, message", [
    ("import sys; sys.exit(3)", 3, None),
    ("import sys; sys.exit('bad thing')", 1, "bad thing"),
    ("raise ValueError('deep inside')", 1, "ValueError: deep inside"),
    ("pass", 0, None),
])
def test_exit_codes_and_tracebacks_are_the_interpreters(tmp_path, body, code, message):
    got, stderr = _run([_script(tmp_path, body)])
    assert got == code
    if message is None:
        assert stderr == ""
    else:
        assert message in stderr


def test_an_uncaught_ctrl_c_dies_of_sigint_and_a_sigterm_kills_with_the_default_action(tmp_path):
    got, stderr = _run([_script(tmp_path, "raise KeyboardInterrupt")])
    assert got == -signal.SIGINT and "KeyboardInterrupt" in stderr
    # The parent's handlers do not follow the child: here the test's own SIGTERM handler.
    previous = signal.signal(signal.SIGTERM, lambda *a: None)
    try:
        started = tmp_path / "started"
        child = fork_main([_script(tmp_path, f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); "
                                             "time.sleep(60)")], dict(os.environ))
        while not started.exists():
            threading.Event().wait(0.02)
        child.send_signal(signal.SIGTERM)
        assert child.wait() == -signal.SIGTERM
        child.send_signal(signal.SIGTERM)  # reaped: a no-op, never a signal to a reused pid
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_shutdown_waits_for_threads_then_runs_atexit_handlers_in_that_order(tmp_path):
    log = tmp_path / "log"
    script = _script(tmp_path, f"""
        import atexit, threading, time
        def note(word):
            with open({str(log)!r}, "a") as fh:
                fh.write(word + "\\n")
        atexit.register(note, "atexit")
        threading.Thread(target=lambda: (time.sleep(0.3), note("thread"))).start()
    """)
    got, _ = _run([script])
    assert got == 0 and log.read_text().split() == ["thread", "atexit"]


def test_each_child_seeds_torch_and_numpy_from_the_os_as_a_fresh_interpreter_does(tmp_path):
    import numpy as np
    import torch

    np.random.seed(0)
    torch.manual_seed(1234)
    code = ("import json, sys, numpy, torch; json.dump(dict(torch=torch.rand(3).tolist(), "
            "numpy=numpy.random.rand(3).tolist()), open(sys.argv[1], 'w'))")
    draws = []
    for name in ("first", "second"):
        assert _run(["-c", code, str(tmp_path / name)])[0] == 0
        draws.append(json.loads((tmp_path / name).read_text()))
    parent = dict(torch=torch.rand(3).tolist(), numpy=np.random.rand(3).tolist())  # what the parent's state gives
    for source in ("torch", "numpy"):
        assert draws[0][source] != draws[1][source]
        assert parent[source] not in (draws[0][source], draws[1][source])


def test_the_death_signal_hook_runs_in_the_child_before_the_script(tmp_path):
    marker = tmp_path / "hook"
    got, _ = _run(["-c", f"import pathlib; assert pathlib.Path({str(marker)!r}).read_text() == 'hook'"],
                  in_child=lambda: marker.write_text("hook"))
    assert got == 0


def test_ranks_are_forked_only_where_no_gpu_and_no_module_form_is_involved(monkeypatch, tmp_path):
    script = _script(tmp_path, "pass")
    assert can_fork_ranks([script, "--x"]) and can_fork_ranks(["-c", "pass"])
    assert not can_fork_ranks(["-m", "pimm"])
    assert not can_fork_ranks([str(tmp_path / "missing.py")])
    monkeypatch.setenv("PIMM_RANK_START", "exec")
    assert not can_fork_ranks([script])
    monkeypatch.delenv("PIMM_RANK_START")
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert not can_fork_ranks([script])
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert not can_fork_ranks([script])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert can_fork_ranks([script])


def _in_fresh_python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter: whether ranks may be forked depends on
    what the process ran before (a pytest worker has run many tests)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, **env), cwd=str(ROOT))


def test_after_a_parallel_op_in_the_launcher_ranks_start_fresh_instead_of_hanging():
    # GNU OpenMP's team does not survive a fork: a forked child would hang at its first parallel op.
    done = _in_fresh_python("""
        import torch
        from pimm.distributed.forked_main import can_fork_ranks
        before = can_fork_ranks(["-c", "pass"], canary_timeout_s=5)
        x = torch.ones(1 << 20)
        (x + x).sum()
        print(before, can_fork_ranks(["-c", "pass"], canary_timeout_s=1))
    """, OMP_NUM_THREADS="2")  # the tests' default of one thread never starts a team
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


@pytest.mark.parametrize("start", ["fork", "exec"])
def test_spawn_local_ranks_get_their_rank_environment_and_one_error_line(tmp_path, start):
    rank_code = ("import os, sys; r = os.environ['RANK']; open(os.environ['OUT'] + r, 'w').write("
                 "os.environ['WORLD_SIZE'] + ' ' + str(os.getppid()) + ' ' + str('torch' in sys.modules)); "
                 "sys.stderr.write('error: the same for every rank\\n'); sys.exit(2 if r == '1' else 0)")
    done = _in_fresh_python(f"""
        import os, sys
        import torch
        from pimm.distributed.spawn import spawn_local
        print(os.getpid())
        sys.exit(spawn_local(["-c", {rank_code!r}], 2))
    """, PIMM_RANK_START=start, OUT=str(tmp_path / "rank"))
    assert done.returncode == 2
    assert done.stderr.count("error: the same for every rank") == 1, done.stderr
    for rank in range(2):
        world, parent, warm = (tmp_path / f"rank{rank}").read_text().split()
        assert world == "2" and parent == done.stdout.strip()
        assert warm == str(start == "fork")  # a forked rank finds torch imported; a fresh interpreter does not
