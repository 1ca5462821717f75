"""Ctrl-C in a terminal: one press finishes the step, commits a checkpoint,
prints the resume command and exits 130, and that command continues the run
bit for bit; a second press aborts at once and leaves no partial checkpoint.

Every run here is a real ``tools/train.py`` in a pseudo-terminal
(:func:`tests.support.interrupt.run_in_pty`), and Ctrl-C is the byte the
terminal turns into SIGINT for its foreground process group, as at a
keyboard. ``PauseForSignal`` holds the ranks at a known step until the
SIGINT reached them, so the stop step is known; ``HoldInterruptSave`` holds
the Ctrl-C checkpoint's write until the second press, so the abort always
meets a write in flight.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from pimm.engines.state import CheckpointManager
from tests.support import forkserver
from tests.support.interrupt import run_in_pty
from tests.support.run import ROOT, env, final_weights, train_losses, write_toy_config

TRAIN = str(ROOT / "tools" / "train.py")


def _config(tmp_path: Path, markers: Path, extra: str = "", hold_save: bool = False) -> Path:
    hold = f'hooks.append(dict(type="HoldInterruptSave", directory={str(markers)!r}))\n' if hold_save else ""
    return write_toy_config(tmp_path, tmp_path / "unused", f'''
custom_imports = ["tests.support.toy", "tests.support.preempt", "tests.support.interrupt"]
hooks.append(dict(type="PauseForSignal", steps=[7], signals=["SIGINT"], directory={str(markers)!r}))
''' + hold + extra)


def _train(cfg: Path, save: Path, *options: str, num_gpus: int = 1) -> list[str]:
    gpus = ["--num-gpus", str(num_gpus)] if num_gpus > 1 else []
    return [sys.executable, TRAIN, "--config-file", str(cfg), *gpus, "--options", f"save_path={save}", *options]


def _checkpoints(save: Path) -> tuple[list[int], list[str]]:
    """The committed steps (each verified against its manifest) and every other entry of checkpoints/."""
    manager = CheckpointManager(save / "checkpoints")
    committed = []
    for path in manager.committed():
        assert manager.verify(path) == "ok", path
        committed.append(int(path.name[4:13]))
    others = sorted(p.name for p in (save / "checkpoints").iterdir() if p not in manager.committed())
    return committed, others


def _resume_line(output: str) -> str:
    lines = [line for line in output.splitlines() if "continue with:" in line]
    assert len(lines) == 1, output[-3000:]  # one line, printed once (by rank 0)
    return lines[0].split("continue with: ", 1)[1].strip()


def _assert_same_run(save: Path, reference: Path) -> None:
    done, expected = final_weights(save), final_weights(reference)
    assert done["global_step"] == expected["global_step"] == 30
    for key, tensor in expected["state_dict"].items():
        assert torch.equal(done["state_dict"][key], tensor), key
    assert train_losses(save) == train_losses(reference)


def _interrupt_once_then_resume(tmp_path: Path, num_gpus: int, stop_step: int, extra: str = "") -> None:
    markers = tmp_path / "markers"
    cfg = _config(tmp_path, markers, extra)
    reference = tmp_path / "reference"
    ref = forkserver.run(_train(cfg, reference, "hooks.PauseForSignal.steps=[]", num_gpus=num_gpus),
                         capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]

    save = tmp_path / "run"
    code, output = run_in_pty(_train(cfg, save, num_gpus=num_gpus), env(), ROOT, [markers / "paused-7"])
    assert code == 130, output[-3000:]
    log = (save / "train.log").read_text()
    assert f"Interrupted by Ctrl-C at step {stop_step}: saving a checkpoint" in log
    committed, others = _checkpoints(save)
    assert committed[-1] == stop_step and others == [], (committed, others)

    command = _resume_line(output)
    gpus = f" --num-gpus {num_gpus}" if num_gpus > 1 else ""
    assert command == f"python {TRAIN} --resume {save}{gpus}"
    argv = shlex.split(command)
    resumed = forkserver.run([sys.executable, *argv[1:]], capture_output=True, text=True, env=env(), cwd=ROOT,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Resumed from step{stop_step:09d}" in (save / "train.log").read_text()
    _assert_same_run(save, reference)


@pytest.mark.slow  # a Ctrl-C to a real training process, then a resume
def test_one_ctrl_c_commits_a_checkpoint_prints_the_resume_command_and_resumes_exactly(tmp_path):
    _interrupt_once_then_resume(tmp_path, num_gpus=1, stop_step=7)


def _interrupt_twice(tmp_path: Path, num_gpus: int, extra: str = "") -> None:
    markers = tmp_path / "markers"
    cfg = _config(tmp_path, markers, extra, hold_save=True)
    save = tmp_path / "run"
    code, output = run_in_pty(_train(cfg, save, num_gpus=num_gpus), env(), ROOT,
                              [markers / "paused-7", markers / "writing-rank0"])
    assert code == 130, output[-3000:]
    assert re.search(r"error: aborted \(Ctrl-C\): no new checkpoint", output), output[-3000:]
    assert "continue with:" not in output
    log = (save / "train.log").read_text()
    assert "Aborted at epoch 1" in log and "Checkpoint committed" not in log
    # The interrupted step's save was in flight: abandoned, its temporary folder gone; step 5's stays intact.
    committed, others = _checkpoints(save)
    assert committed == [5] and others == [], (committed, others)
    assert (markers / "writing-rank0").exists()


def test_a_second_ctrl_c_aborts_the_save_in_flight_and_leaves_no_partial_checkpoint(tmp_path):
    _interrupt_twice(tmp_path, num_gpus=1)


@pytest.mark.slow
def test_ctrl_c_under_num_gpus_stops_every_rank_at_one_step_and_resumes_exactly(tmp_path):
    # The parent forwards the one SIGINT to its ranks (in a process group of their own, so each gets it
    # once); they agree on the stop at the next check (every 4 steps: step 8).
    _interrupt_once_then_resume(tmp_path, num_gpus=2, stop_step=8,
                                extra='train = dict(type="DefaultTrainer", stop_check_every=4)\n')


@pytest.mark.slow
def test_a_second_ctrl_c_under_num_gpus_aborts_every_rank(tmp_path):
    _interrupt_twice(tmp_path, num_gpus=2, extra='train = dict(type="DefaultTrainer", stop_check_every=4)\n')


def test_the_stop_control_turns_a_first_sigint_into_a_stop_and_a_second_into_an_abort():
    import os
    import signal

    from pimm.engines.control import ABORT_NOW, StopControl

    # (A process started under nohup inherits SIGINT ignored: uninstall restores
    # whatever was there, so compare with that.)
    before = signal.getsignal(signal.SIGINT)
    control = StopControl()
    control.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert control.interrupted and control.pending and not control.preempted
        assert control.should_stop(1) and control.describe() == "interrupted by Ctrl-C (SIGINT)"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        control.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
    # A lost run lock interrupts the main thread: that stops at once, even as a first interrupt.
    control = StopControl()
    control.install()
    ABORT_NOW.set()
    try:
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        ABORT_NOW.clear()
        control.uninstall()


def test_abort_stops_a_background_write_in_flight_and_commits_nothing(tmp_path):
    import threading

    from tests.support.interrupt import _HeldPickle

    manager = CheckpointManager(tmp_path / "checkpoints", async_write=True)

    class State:
        def __init__(self):
            self.value, self.held = 1, None

        def state_dict(self):
            return {"value": self.value, **({"held": self.held} if self.held is not None else {})}

        def load_state_dict(self, state):
            self.value = state["value"]

    state = State()
    manager.register("state", state)
    manager.save(5, 0)
    manager.wait()
    state.held = _HeldPickle(str(tmp_path), 0, manager._abort, timeout_s=60)
    manager.save(7, 0)
    deadline = threading.Event()
    while not (tmp_path / "writing-rank0").exists():
        assert not deadline.wait(0.01) and manager._writer.is_alive()
    manager.abort()
    assert not manager._writer and [p.name for p in manager.committed()] == ["step000000005-epoch0000"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step000000005-epoch0000"]
    assert manager.load_latest().common["state"]["value"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("launcher, launcher_exit", [("pimm.distributed.torchrun", 130),
                                                     ("torch.distributed.run", 1)], ids=["pimm-torchrun", "torchrun"])
def test_ctrl_c_under_torchrun_commits_a_checkpoint_on_every_rank(tmp_path, launcher, launcher_exit):
    # torchrun starts its workers in sessions of their own: the terminal's SIGINT reaches the launcher only,
    # which passes it on (plain torchrun through its SignalException, then exits 1; pimm torchrun exits 130).
    markers = tmp_path / "markers"
    cfg = _config(tmp_path, markers, 'train = dict(type="DefaultTrainer", stop_check_every=4)\n')
    save = tmp_path / "run"
    argv = [sys.executable, "-m", launcher, "--standalone", "--nproc_per_node=2", "--max_restarts=0", TRAIN,
            "--config-file", str(cfg), "--options", f"save_path={save}"]
    code, output = run_in_pty(argv, env(), ROOT, [markers / "paused-7"])
    assert code == launcher_exit, output[-3000:]
    log = (save / "train.log").read_text()
    assert "Interrupted by Ctrl-C at step 8: saving a checkpoint" in log and "exiting with code 130" in log
    assert _resume_line(output) == "the same torchrun command with --options resume=True"
    committed, others = _checkpoints(save)
    assert committed[-1] == 8 and others == [], (committed, others)


def test_a_lost_run_lock_kills_the_num_gpus_ranks_instead_of_passing_a_ctrl_c_on(tmp_path):
    import _thread
    import threading

    from pimm.distributed.spawn import spawn_local

    started = tmp_path / "started"
    code = f"import pathlib, time; pathlib.Path({str(started)!r} + '-' + __import__('os').environ['RANK']).touch(); " \
           "time.sleep(120)"
    abort = threading.Event()

    def lose_the_lock():  # what the parent's heartbeat does (pimm.engines.launch._stop_writing)
        while not all((tmp_path / f"started-{rank}").exists() for rank in range(2)):
            threading.Event().wait(0.05)
        abort.set()
        _thread.interrupt_main()

    threading.Thread(target=lose_the_lock, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        spawn_local(["-c", code], 2, abort=abort)
