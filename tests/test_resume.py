"""Exact resume and crash safety, end to end through ``tools/train.py``.

Every test runs the real command line in processes of its own (forked from
the tests' warm server, tests/support/forkserver.py) on the toy task of
``tests/support/toy.py`` (random augmentation from the global numpy and
torch generators, dropout), kills it in some way — SIGKILL between steps,
SIGKILL in the middle of writing a checkpoint, SIGTERM pre-emption, damaged
files — resumes with ``resume=True`` and compares with an uninterrupted run:
``model/model_last.pth`` must be bit-identical (``torch.equal``) and
``metrics.jsonl`` must read as one clean run.

Toy run: 160 samples, batch 16 -> 10 steps per epoch, 3 epochs (30 steps),
a checkpoint every 5 steps and at each epoch end (steps 5, 10, ..., 30),
``train/loss`` flushed to metrics.jsonl every 4 steps, at epoch ends and at
every checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from pimm.engines.state.manager import CheckpointManager
from tests.support import forkserver
from tests.support.run import ROOT, env, final_weights, train_losses, write_toy_config

STEPS_PER_EPOCH, EPOCHS = 10, 3
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS
CHECKPOINT_STEPS = set(range(5, TOTAL_STEPS + 1, 5))
NEVER = 10**9
SIGKILLED = -9
PREEMPTED = 75
# A run whose train.log stops growing for STALL_S once training has started is
# deadlocked (a healthy toy run logs several lines a second); start-up (imports,
# process group) may take up to STARTUP_S on a loaded machine.
STALL_S, STARTUP_S = 30, 180

# Every run of this module uses the same hook list (kill and crash points are
# set per run with --options), so resumes never see a different hook layout.
HOOKS = '''
custom_imports = ["tests.support.toy", "tests.support.crash"]
num_worker = {num_worker}
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2, every_n_steps={eval_every}),
    dict(type="CheckpointSaver", save_freq=5, keep_last=2),
    dict(type="RecordingHook"),
    dict(type="KillAtStep", step={never}, signal_name="SIGKILL"),
    dict(type="CrashDuringSave", step={never}, file="common.pth", signal_name="SIGKILL"),
]
'''


class Run:
    """One save_path and its config; ``train`` runs tools/train.py on it."""

    _count = 0
    stall_s = STALL_S  # a run that compiles at its first step raises it (see tests/test_compile.py)

    def __init__(self, root: Path, name: str, num_worker: int = 0, eval_every: int | None = None):
        Run._count += 1
        config_dir = Path(root) / f"cfg{Run._count}-{name}"
        config_dir.mkdir(parents=True)
        self.save = Path(root) / name
        self.cfg = write_toy_config(config_dir, self.save, HOOKS.format(
            num_worker=num_worker, eval_every=eval_every, never=NEVER))
        self.output = config_dir / "output.txt"

    def train(self, *options: str, expect: int = 0, num_gpus: int = 1) -> None:
        """Run tools/train.py in its own process group; a run that stalls is killed
        with all its ranks and data workers (never left behind) and fails the test."""
        cmd = [sys.executable, str(ROOT / "tools" / "train.py"), "--config-file", str(self.cfg)]
        cmd += ["--num-gpus", str(num_gpus)] if num_gpus != 1 else []
        cmd += ["--options", *options] if options else []
        log = self.save / "train.log"
        proc = forkserver.popen(cmd, stdout=self.output, env=env(), cwd=ROOT, start_new_session=True)
        initial_size = last_size = log.stat().st_size if log.exists() else 0
        last_change = time.monotonic()
        while proc.poll() is None:
            size = log.stat().st_size if log.exists() else 0
            if size != last_size:
                last_size, last_change = size, time.monotonic()
            limit = self.stall_s if last_size > initial_size else STARTUP_S
            if time.monotonic() - last_change > limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                pytest.fail(f"tools/train.py --options {' '.join(options)} (num_gpus={num_gpus}) made no "
                            f"progress for {limit}s (deadlock?); killed.\n--- train.log ---\n{self.log()[-3000:]}")
            time.sleep(0.1)
        try:  # data workers of a SIGKILLed run may outlive it for a moment
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if proc.returncode != expect:
            pytest.fail(f"tools/train.py --options {' '.join(options)} exited {proc.returncode}, expected {expect}\n"
                        f"--- output ---\n{self.output.read_text()[-3000:]}\n--- train.log ---\n{self.log()[-4000:]}")

    def log(self) -> str:
        path = self.save / "train.log"
        return path.read_text() if path.exists() else ""

    def records(self, name: str = "metrics.jsonl") -> list[dict]:
        path = self.save / name
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def committed(self) -> list[int]:
        """Steps of the committed checkpoints, oldest first."""
        return [int(re.match(r"step(\d+)", p.name).group(1))
                for p in CheckpointManager(self.save / "checkpoints").committed()]

    def tmp_folders(self) -> list[str]:
        return sorted(p.name for p in (self.save / "checkpoints").glob(".tmp-*"))

    def copy_from(self, other: "Run") -> None:
        shutil.copytree(other.save, self.save)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, made once per module and per (world size, workers)."""
    made: dict[tuple[int, int], Run] = {}

    def get(num_worker: int = 0, num_gpus: int = 1) -> Run:
        key = (num_worker, num_gpus)
        if key not in made:
            run = Run(tmp_path_factory.mktemp("ref"), f"ref-w{num_worker}-g{num_gpus}", num_worker=num_worker)
            run.train(num_gpus=num_gpus)
            made[key] = run
        return made[key]

    return get


# -- comparisons --------------------------------------------------------------
def assert_same_weights(run: Run, ref: Run) -> None:
    got, want = final_weights(run.save), final_weights(ref.save)
    assert got["global_step"] == want["global_step"] == TOTAL_STEPS
    assert got["state_dict"].keys() == want["state_dict"].keys()
    differing = [k for k in want["state_dict"] if not torch.equal(got["state_dict"][k], want["state_dict"][k])]
    assert not differing, f"model_last.pth differs from the uninterrupted run in {differing}"


def assert_clean_losses(run: Run, ref: Run | None = None, total: int = TOTAL_STEPS) -> None:
    """train/loss: steps 1..total, each once, in order (and equal to ``ref``'s)."""
    losses = train_losses(run.save)
    assert [step for step, _ in losses] == list(range(1, total + 1))
    if ref is not None:
        want = train_losses(ref.save)
        mismatches = [(a, b) for a, b in zip(losses, want) if a != b]
        assert not mismatches, f"per-step losses differ from the uninterrupted run (first: {mismatches[:3]})"


def hook_state(run: Run, hook_type: str) -> dict:
    newest = CheckpointManager(run.save / "checkpoints").committed()[-1]
    states = torch.load(newest / "rank00000.pth", weights_only=True)["hooks"]
    return next(s["state"] for s in states if s["type"] == hook_type)


def lines_after_newest_checkpoint(run: Run) -> list[dict]:
    """What a resume must move to metrics.rewound.jsonl: records logged after
    the checkpoint it will resume from."""
    newest = max(run.committed(), default=0)
    return [r for r in run.records() if r["step"] > newest]


def kill_points(seed: str) -> list[int]:
    """Three SIGKILL steps, one per epoch: between checkpoints in epoch 1; right
    after a checkpoint in epoch 2 (11: one step after the epoch-end save, 15:
    KillAtStep runs after CheckpointSaver, so it dies just after the commit,
    16: one step after it); anywhere off the checkpoints in epoch 3."""
    rng = random.Random(seed)
    first = rng.choice([6, 7, 8, 9])
    second = rng.choice([11, 15, 16])
    third = rng.choice([s for s in range(21, 30) if s not in CHECKPOINT_STEPS])
    return [first, second, third]


# -- SIGKILL between steps ------------------------------------------------------
@pytest.mark.parametrize("num_worker", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_sigkill_at_random_steps_then_resume_is_bit_identical(tmp_path, reference, num_worker):
    ref = reference(num_worker)
    run = Run(tmp_path, "killed", num_worker=num_worker)
    kills = kill_points(f"kill-points-{num_worker}")
    expected_rewound, resumed_from = [], []
    for step in kills:
        # resume=True from the start: on an empty save_path it starts a fresh run. Synchronous
        # writes make the commit points deterministic (the async writer is covered below).
        run.train(f"hooks.KillAtStep.step={step}", "resume=True", "hooks.CheckpointSaver.async_write=False",
                  expect=SIGKILLED)
        resumed_from.append(max(run.committed(), default=0))
        assert resumed_from[-1] <= step
        expected_rewound += lines_after_newest_checkpoint(run)
    run.train("resume=True", "hooks.CheckpointSaver.async_write=False")
    # The kill points cover resuming from an epoch-end and from a mid-epoch checkpoint.
    assert {s % STEPS_PER_EPOCH == 0 for s in resumed_from if s} == {True, False}, resumed_from
    assert run.log().count("holds no checkpoint: starting a fresh run") == 1

    assert_same_weights(run, ref)
    # The whole metrics file, not only train/loss: val/ and train/lr records too.
    assert run.records() == ref.records(), "metrics.jsonl after resumes differs from the uninterrupted run's"
    assert_clean_losses(run, ref)
    assert expected_rewound, f"kill points {kills} left nothing to rewind; the test lost its point"
    assert run.records("metrics.rewound.jsonl") == expected_rewound
    # Hook state round trip: RecordingHook counted every step exactly once across four processes.
    assert hook_state(run, "RecordingHook") == {"steps_seen": TOTAL_STEPS}
    assert hook_state(ref, "RecordingHook") == {"steps_seen": TOTAL_STEPS}
    assert run.log().count("Resumed from") == len(kills)  # the first run had nothing to resume from


@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_sigkill_right_after_an_async_save_resumes_exactly(tmp_path, reference):
    """The kill lands while the background writer may still be writing or committing
    the step-15 checkpoint: resume uses it if it was committed, else step 10, and
    either way ends bit-identical."""
    ref = reference(0)
    run = Run(tmp_path, "async-kill")
    run.train("hooks.KillAtStep.step=15", "resume=True", expect=SIGKILLED)
    assert max(run.committed()) in (10, 15)
    assert not [p for p in run.committed() if p > 15]
    run.train("resume=True")
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)


@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_sigkill_while_writing_a_checkpoint_leaves_it_ignored(tmp_path, reference):
    ref = reference(0)
    run = Run(tmp_path, "crash-in-save")
    # The epoch-end save at step 20 dies half-way through common.pth: only its .tmp folder exists.
    run.train("hooks.CrashDuringSave.step=20", expect=SIGKILLED)
    assert run.committed() == [10, 15]
    assert run.tmp_folders() == [".tmp-step000000020-epoch0002"]
    partial = run.save / "checkpoints" / ".tmp-step000000020-epoch0002"
    assert (partial / "rank00000.pth").is_file() and (partial / "common.pth").is_file()
    assert not (partial / "COMMITTED").exists()

    run.train("resume=True")
    assert "Resumed from step000000015-epoch0001" in run.log()
    assert run.tmp_folders() == [], "the partial checkpoint folder was never cleaned up"
    assert run.committed()[-1] == TOTAL_STEPS
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)


# -- SIGTERM pre-emption ---------------------------------------------------------
@pytest.mark.parametrize("num_worker,step,second_signal", [
    (0, 7, True), pytest.param(2, 13, False, marks=pytest.mark.slow)], ids=["w0-twice", "w2"])
@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_sigterm_checkpoints_at_that_step_exits_75_and_resumes_exactly(tmp_path, reference, num_worker, step,
                                                                       second_signal):
    ref = reference(num_worker)
    run = Run(tmp_path, "sigterm", num_worker=num_worker)
    # The step is off the save_freq grid, so the data loader's state is taken between its snapshots.
    options = [f"hooks.KillAtStep.step={step}", "hooks.KillAtStep.signal_name='SIGTERM'"]
    if second_signal:  # another SIGTERM arrives while the pre-emption checkpoint is being written
        options += [f"hooks.CrashDuringSave.step={step}", "hooks.CrashDuringSave.signal_name='SIGTERM'"]
    run.train(*options, expect=PREEMPTED)
    assert run.committed()[-1] == step
    assert run.tmp_folders() == []
    assert run.log().count("Pre-empted by SIGTERM") == 1
    assert f"Pre-empted by SIGTERM at step {step}" in run.log()
    loaded = CheckpointManager(run.save / "checkpoints").load_latest()  # sizes match the manifest, files load
    assert loaded.path.name.startswith(f"step{step:09d}-")
    assert loaded.common["train_state"]["global_step"] == step

    run.train("resume=True")
    assert f"Resumed from step{step:09d}" in run.log()
    assert run.records("metrics.rewound.jsonl") == [], "a pre-emption checkpoint is taken after the last log line"
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)


@pytest.mark.slow
def test_two_process_sigterm_then_resume_is_bit_identical(tmp_path, reference):
    # The reference is also the regression test for a deadlock: with log_frequency=4 the
    # scalars of steps 5, 15 and 25 are still buffered when those checkpoints are saved,
    # and flushing them is a collective that every rank must join.
    ref = reference(0, num_gpus=2)
    assert ref.committed()[-2:] == [25, 30]
    run = Run(tmp_path, "sigterm-2proc")
    # Both ranks signal themselves after step 7; ranks agree to stop at the next
    # cross-rank check (every 10 steps), here the last step of epoch 1.
    run.train("hooks.KillAtStep.step=7", "hooks.KillAtStep.signal_name='SIGTERM'", expect=PREEMPTED, num_gpus=2)
    stopped = run.committed()[-1]
    assert 7 <= stopped < 7 + 10
    assert f"Pre-empted by SIGTERM at step {stopped}" in run.log()
    manifest = json.loads((CheckpointManager(run.save / "checkpoints").committed()[-1] / "COMMITTED").read_text())
    assert manifest["world_size"] == 2 and set(manifest["files"]) == {"common.pth", "rank00000.pth", "rank00001.pth"}

    run.train("resume=True", num_gpus=2)
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)
    assert run.records() == ref.records()


# -- damaged checkpoints -----------------------------------------------------------
def test_damaged_newest_checkpoint_falls_back_to_previous(tmp_path, reference):
    """Truncated common.pth (other damage is covered in test_checkpoint_manager.py)."""
    ref = reference(0)
    run = Run(tmp_path, "damaged")
    run.copy_from(ref)
    checkpoints = run.save / "checkpoints"
    assert run.committed() == [25, 30]
    common = checkpoints / "step000000030-epoch0003" / "common.pth"
    common.write_bytes(common.read_bytes()[:1000])
    # A newer folder without a manifest (an uncommitted save) is never resumed from, and said so.
    orphan = checkpoints / "step000000035-epoch0003"
    shutil.copytree(checkpoints / "step000000025-epoch0002", orphan)
    (orphan / "COMMITTED").unlink()

    run.train("resume=True")
    log = run.log()
    assert re.search(r"WARNING.*step000000030-epoch0003 cannot be resumed from", log), log[-2000:]
    assert re.search(r"WARNING.*step000000035-epoch0003 cannot be resumed from \(no COMMITTED manifest", log)
    assert "Resumed from step000000025-epoch0002" in log
    # Reaching step 30 again heals it: the damaged copy is moved aside, a good one committed.
    assert (checkpoints / ".damaged-step000000030-epoch0003-1").is_dir()
    assert_same_weights(run, ref)
    assert_clean_losses(run, ref)


# -- evaluation inside an epoch ----------------------------------------------------
@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_mid_epoch_evaluation_does_not_perturb_training_and_resumes_exactly(tmp_path, reference):
    ref = reference(0)  # evaluates at epoch ends only
    plain = Run(tmp_path, "eval-every-3", eval_every=3)
    plain.train()
    val_steps = [r["step"] for r in plain.records() if "val/acc" in r]
    assert val_steps == list(range(3, TOTAL_STEPS + 1, 3))
    assert_same_weights(plain, ref)
    assert_clean_losses(plain, ref)

    # Killed after the evaluation at step 9 (checkpoint at 5): the resume replays 6..9, evaluations included.
    killed = Run(tmp_path, "eval-every-3-killed", eval_every=3)
    killed.train("hooks.KillAtStep.step=9", expect=SIGKILLED)
    killed.train("resume=True")
    assert_same_weights(killed, ref)
    assert killed.records() == plain.records()


# -- resume edge cases ---------------------------------------------------------------
def test_resume_of_a_finished_run_is_a_noop(tmp_path, reference):
    ref = reference(0)
    run = Run(tmp_path, "finished")
    run.copy_from(ref)
    metrics_before = (run.save / "metrics.jsonl").read_bytes()

    run.train("resume=True")
    assert "Nothing to train: 3 of 3 epochs are already done" in run.log()
    assert_same_weights(run, ref)
    assert (run.save / "metrics.jsonl").read_bytes() == metrics_before
    assert run.committed()[-1] == TOTAL_STEPS


def test_raising_epoch_on_a_finished_run_extends_it(tmp_path, reference):
    ref = reference(0)
    run = Run(tmp_path, "extended")
    run.copy_from(ref)
    run.train("resume=True", "epoch=4")
    assert re.search(r"WARNING.*scheduler total_steps: 30 -> 40", run.log())
    assert_clean_losses(run, total=TOTAL_STEPS + STEPS_PER_EPOCH)
    assert train_losses(run.save)[:TOTAL_STEPS] == train_losses(ref.save)
    assert final_weights(run.save)["global_step"] == TOTAL_STEPS + STEPS_PER_EPOCH
    assert run.committed()[-1] == TOTAL_STEPS + STEPS_PER_EPOCH


def test_resume_with_other_worker_count_and_lr_warns_and_completes(tmp_path, reference):
    ref = reference(0)
    run = Run(tmp_path, "changed")
    run.copy_from(ref)
    # As if killed before the save at step 30: resume from step 25, mid-epoch 3.
    shutil.rmtree(run.save / "checkpoints" / "step000000030-epoch0003")

    run.train("resume=True", "num_worker=2", "optimizer.lr=0.02")
    log = run.log()
    assert re.search(r"WARNING.*different layout \(num_workers_per_rank 0 -> 2\)", log), log[-2000:]
    assert re.search(r"WARNING.*optimizer\.lr: 0\.01 -> 0\.02", log), log[-2000:]
    assert "Resumed from step000000025-epoch0002" in log
    assert_clean_losses(run)
    assert final_weights(run.save)["global_step"] == TOTAL_STEPS


# -- retention -------------------------------------------------------------------------
def test_retention_keeps_the_newest_two_and_the_best(reference):
    ref = reference(0)  # keep_last=2
    evals = [(r["val/acc"], r["step"]) for r in ref.records() if "val/acc" in r]
    best_step = max(evals, key=lambda e: (e[0], -e[1]))[1]  # the first of equal values stays best
    newest_two = sorted(CHECKPOINT_STEPS)[-2:]
    assert ref.committed() == sorted(set(newest_two) | {best_step})
    assert ref.tmp_folders() == []
    for path in CheckpointManager(ref.save / "checkpoints").committed():
        manifest = json.loads((path / "COMMITTED").read_text())
        assert manifest["is_best"] == (manifest["global_step"] == best_step)
