"""Multi-node torchrun, as far as one machine allows: two "nodes" are two
``torchrun --nnodes 2 --rdzv-backend c10d`` invocations on localhost (gloo),
pre-empted by a SIGTERM to both torchruns at a known step
(``tests/support/preempt.py`` holds the ranks there until the signal has
reached them), resumed with ``resume=True``, and compared bit for bit with
an uninterrupted two-process run.

torchrun forwards the SIGTERM to its workers, which agree on a step, commit
a checkpoint and exit 75; torchrun itself then exits 1 (it reports every
non-zero worker exit, 75 included, as a failure), so the test reads the
outcome from ``train.log``, not from torchrun's exit code. ``pimm torchrun``
(:mod:`pimm.distributed.torchrun`) runs the same launcher with the signals
forwarded by pimm and exits 75 on both nodes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support import forkserver  # noqa: E402
from tests.support.run import env as tool_env  # noqa: E402
from tests.support.run import final_weights, train_losses, write_toy_config  # noqa: E402

pytestmark = pytest.mark.slow

PAUSE = 7  # with stop_check_every=4 the ranks stop at step 8 (mid-epoch)
LIMIT_S = 240


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _nodes(cfg: Path, save_path: Path, log_dir: Path, *options: str,
           launcher: str = "torch.distributed.run") -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for node_rank in range(2):
        cmd = [sys.executable, "-m", launcher, "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=pimm-test-{port}", "--max-restarts=0", str(ROOT / "tools" / "train.py"),
               "--config-file", str(cfg), "--options", f"save_path={save_path}", *options]
        with open(log_dir / f"node{node_rank}-{len(options)}.txt", "w") as out:
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=tool_env(), cwd=ROOT,
                                          start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], until=lambda: False) -> list[int] | None:
    """Exit codes once both torchruns ended (None as soon as ``until()``); kills both past LIMIT_S."""
    deadline = time.monotonic() + LIMIT_S
    while any(p.poll() is None for p in procs):
        if until():
            return None
        if time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail("the two torchrun nodes did not finish in time")
        time.sleep(0.1)
    return [p.returncode for p in procs]


def test_two_torchrun_nodes_sigterm_then_resume_is_bit_identical(tmp_path):
    markers = tmp_path / "markers"
    cfg = write_toy_config(tmp_path, tmp_path / "unused", f'''
custom_imports = ["tests.support.toy", "tests.support.preempt"]
train = dict(type="DefaultTrainer", stop_check_every=4)
hooks.append(dict(type="PauseForSignal", steps=[{PAUSE}], signals=["SIGTERM"], directory={str(markers)!r}))
''')
    reference = tmp_path / "reference"
    ref = forkserver.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(cfg), "--num-gpus",
                          "2", "--options", f"save_path={reference}", "hooks.PauseForSignal.steps=[]"],
                         capture_output=True, text=True, env=tool_env(), cwd=ROOT, timeout=LIMIT_S)
    assert ref.returncode == 0, ref.stderr[-3000:]

    save_path = tmp_path / "run"
    procs = _nodes(cfg, save_path, tmp_path)
    try:
        codes = _wait(procs, until=lambda: (markers / f"paused-{PAUSE}").exists())
        assert codes is None, f"both nodes exited ({codes}) before step {PAUSE}"
        for p in procs:
            p.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to its worker
        codes = _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log = (save_path / "train.log").read_text()
    assert codes == [1, 1], log[-3000:]
    assert "Pre-empted by SIGTERM at step 8" in log
    assert "exiting with code 75" in log

    procs = _nodes(cfg, save_path, tmp_path, "resume=True")
    codes = _wait(procs)
    log = (save_path / "train.log").read_text()
    assert codes == [0, 0], log[-3000:]
    assert "Resumed from step000000008" in log and "world size 2" in log

    done, expected = final_weights(save_path), final_weights(reference)
    assert done["global_step"] == expected["global_step"] == 30
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(done["state_dict"][key], tensor), key
    assert train_losses(save_path) == train_losses(reference)


def test_pimm_torchrun_on_two_nodes_exits_75_when_both_are_preempted(tmp_path):
    markers = tmp_path / "markers"
    cfg = write_toy_config(tmp_path, tmp_path / "unused", f'''
custom_imports = ["tests.support.toy", "tests.support.preempt"]
train = dict(type="DefaultTrainer", stop_check_every=4)
hooks.append(dict(type="PauseForSignal", steps=[{PAUSE}], signals=["SIGTERM"], directory={str(markers)!r}))
''')
    save_path = tmp_path / "run"
    procs = _nodes(cfg, save_path, tmp_path, launcher="pimm.distributed.torchrun")
    try:
        codes = _wait(procs, until=lambda: (markers / f"paused-{PAUSE}").exists())
        assert codes is None, f"both nodes exited ({codes}) before step {PAUSE}"
        for p in procs:
            p.send_signal(signal.SIGTERM)  # to pimm torchrun, which forwards it to its worker
        codes = _wait(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    log = (save_path / "train.log").read_text()
    assert codes == [75, 75], log[-3000:] + "".join(p.read_text()[-2000:] for p in tmp_path.glob("node*.txt"))
    assert "Pre-empted by SIGTERM at step 8" in log
    assert (save_path / "checkpoints" / "step000000008-epoch0000" / "COMMITTED").is_file()


def test_pimm_torchrun_maps_the_workers_exits_and_refuses_its_own_signal_option():
    from pimm.distributed.torchrun import exit_code_of, main

    assert exit_code_of([75, 75]) == 75 and exit_code_of([75, 130]) == 75 and exit_code_of([130]) == 130
    assert exit_code_of([75, 1]) == 1 and exit_code_of([-9]) == 1 and exit_code_of([]) == 1
    # a worker torchrun stopped with its closing SIGTERM after another exited keeps the verdict; alone it is a failure
    assert exit_code_of([130, -15]) == 130 and exit_code_of([75, -15]) == 75 and exit_code_of([-15]) == 1
    assert main(["--signals_to_handle=SIGTERM", "--nproc_per_node=1", "train.py"]) == 2


@pytest.mark.parametrize("restart_count, given, expected", [("0", False, False), ("", False, False),
                                                             ("1", False, True), ("2", True, True)])
def test_worker_restarted_by_torchrun_resumes(monkeypatch, restart_count, given, expected):
    """torchrun --max_restarts=N reruns a failed worker with the same command
    line: the restarted worker continues its run instead of stopping at the
    save_path guard."""
    from types import SimpleNamespace

    from pimm.engines.run.launch import _resume_after_elastic_restart

    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart_count)
    cfg = SimpleNamespace(resume=given)
    _resume_after_elastic_restart(cfg)
    assert cfg.resume is expected
