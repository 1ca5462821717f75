"""The fork server that the tests start tool runs from (tests/support/forkserver.py)
behaves as a fresh interpreter where the kill/resume tests rely on it: a real
process of its own that can be SIGKILLed with its process group, its exit code
and output, its own string-hash seed and random state across consecutive runs,
and none of the start-up that every training run would pay again."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support import forkserver

pytestmark = pytest.mark.skipif(os.environ.get("PIMM_TESTS_FRESH_PROCESSES") == "1",
                                reason="the fork server is off (PIMM_TESTS_FRESH_PROCESSES=1)")

PROBE = """
import json, os, random, sys
import numpy
print(json.dumps(dict(pid=os.getpid(), sid=os.getsid(0), hash=hash("pimm"), random=random.random(),
                      numpy=float(numpy.random.random()), dynamo="torch._dynamo" in sys.modules)))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def probe(tmp_path: Path, name: str, code: int = 0) -> tuple[dict, str, int]:
    out = tmp_path / f"{name}.txt"
    proc = forkserver.popen([sys.executable, "-c", PROBE, str(code)], stdout=out, start_new_session=True)
    returncode = proc.wait(timeout=120)
    first, *rest = out.read_text().splitlines()
    return json.loads(first), "\n".join(rest), returncode


def test_popen_is_a_process_of_its_own_with_exit_code_merged_output_and_session(tmp_path):
    seen, rest, code = probe(tmp_path, "a", 3)
    assert code == 3 and rest == "to stderr"
    assert seen["pid"] != os.getpid() and seen["sid"] == seen["pid"]  # start_new_session: killpg(pid) reaches it
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    proc = forkserver.popen([sys.executable, "-c", PROBE, "0"], stdout=out, stderr=err)
    assert proc.wait(timeout=120) == 0 == proc.returncode
    assert len(out.read_text().splitlines()) == 1 and err.read_text() == "to stderr\n"
    assert json.loads(out.read_text())["sid"] == os.getsid(0)  # no new session unless asked


def test_consecutive_runs_hash_and_draw_like_separate_interpreters(tmp_path):
    runs = [probe(tmp_path, f"r{i}")[0] for i in range(4)]
    for before, after in zip(runs, runs[1:]):  # a run and the run that resumes it
        assert before["hash"] != after["hash"]
    assert len({r["random"] for r in runs}) == len({r["numpy"] for r in runs}) == 4  # even from the same server
    assert all(r["dynamo"] for r in runs)  # every optimizer imports it: the server paid for it once


def test_sigkill_of_the_pid_ends_the_run_with_minus_nine(tmp_path):
    out = tmp_path / "sleeper.txt"
    proc = forkserver.popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"],
                            stdout=out, start_new_session=True)
    deadline = time.monotonic() + 120
    while "up" not in out.read_text() if out.exists() else True:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL == proc.returncode
