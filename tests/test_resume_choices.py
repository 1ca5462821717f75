"""Resume and retention choices (issue 23.5): resuming from a chosen checkpoint
(this run's or another run's, exact, verified, refused in one line when it
does not fit), ``validate_on_resume``, early stopping on several metrics,
``CheckpointSaver(keep="best")`` and ``scheduler_interval``.

In-process toy runs (tests/support/inprocess.py): 64 samples, batch 16, so
4 steps per epoch; dropout and random augmentation make any RNG or schedule
slip show in the weights.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from pimm.engines import HOOKS
from pimm.utils.errors import CheckpointError, ConfigError
from tests.support import inprocess
from tests.support.inprocess import committed_steps, hook_of, records
from tests.support.run import final_weights, run_tool, write_toy_config
from tests.support.toy import ScriptedEvaluator

SAVE_ALL = 'dict(type="CheckpointSaver", save_freq=2, keep="all")'
HOOKS_ALL = f'[dict(type="ClsEvaluator", num_classes=2), dict(type="InformationWriter", log_frequency=1), {SAVE_ALL}]'


def folder(save_path: Path, step: int) -> Path:
    (found,) = [p for p in (save_path / "checkpoints").iterdir() if p.name.startswith(f"step{step:09d}-")]
    return found


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = final_weights(a), final_weights(b)
    assert wa["global_step"] == wb["global_step"]
    assert wa["state_dict"].keys() == wb["state_dict"].keys()
    assert all(torch.equal(wa["state_dict"][k], wb["state_dict"][k]) for k in wa["state_dict"])


def losses(save_path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["train/loss"]) for r in records(save_path) if "train/loss" in r]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 3-epoch (12-step) run with a checkpoint every 2 steps, all kept."""
    root = tmp_path_factory.mktemp("finished")
    inprocess.make_trainer(root, HOOKS_ALL, epoch=3).train()
    return root / "run"


def copy_run(run: Path, tmp_path: Path) -> Path:
    """``run`` copied to ``tmp_path/run`` (the in-process config writes there)."""
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


# -- resume="<checkpoint folder>" -----------------------------------------------------------------
def test_resuming_this_runs_older_checkpoint_is_exact_and_sets_the_later_ones_aside(tmp_path, finished):
    run = copy_run(finished, tmp_path)
    chosen = folder(run, 6)
    trainer = inprocess.make_trainer(tmp_path, HOOKS_ALL, epoch=3, options=[f"resume={chosen / 'COMMITTED'}"])
    trainer.train()
    assert_same_weights(run, finished)
    assert losses(run) == losses(finished)  # each step once, as the uninterrupted run logged it
    aside = run / "checkpoints" / f"superseded-{chosen.name}"
    assert sorted(p.name[:13] for p in aside.iterdir()) == [f"step{s:09d}" for s in (8, 10, 12)]
    assert committed_steps(run) == [2, 4, 6, 8, 10, 12]  # the new continuation's own checkpoints
    # resume=True now continues the new continuation (here: finished, nothing to do).
    again = inprocess.make_trainer(tmp_path, HOOKS_ALL, epoch=3, options=["resume=True"])
    again.train()
    assert again.global_step == 12


def test_another_runs_checkpoint_continues_in_a_new_save_path(tmp_path, finished):
    before = sorted(p.name for p in (finished / "checkpoints").iterdir())
    trainer = inprocess.make_trainer(tmp_path, HOOKS_ALL, epoch=3, options=[f"resume={folder(finished, 6)}"])
    trainer.train()
    assert_same_weights(tmp_path / "run", finished)
    assert losses(tmp_path / "run") == [(s, v) for s, v in losses(finished) if s > 6]  # its own log starts there
    assert committed_steps(tmp_path / "run") == [8, 10, 12]
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == before  # the other run is only read


def refusal(tmp_path: Path, resume: str, hooks: str = HOOKS_ALL, error=CheckpointError, **kwargs) -> str:
    with pytest.raises(error) as caught:
        inprocess.make_trainer(tmp_path, hooks, epoch=3, options=[f"resume={resume}"], **kwargs).train()
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_what_is_not_a_usable_checkpoint_is_refused_in_one_line(tmp_path, finished):
    assert "is a file, not a resumable checkpoint" in refusal(tmp_path / "a", finished / "model" / "model_last.pth")
    message = refusal(tmp_path / "b", finished)
    assert "is not a checkpoint folder" in message and "step000000012-epoch0003" in message
    assert "there is no such checkpoint" in refusal(tmp_path / "c", tmp_path / "nowhere", error=ConfigError)
    # Another run's checkpoint into a save_path that has checkpoints of its own.
    own = copy_run(finished, tmp_path / "d")
    other = copy_run(finished, tmp_path / "e")
    assert "save_path already holds checkpoints of its own" in refusal(tmp_path / "d", folder(other, 4))
    assert committed_steps(own) == [2, 4, 6, 8, 10, 12]


def test_a_damaged_chosen_checkpoint_is_refused_and_nothing_moves(tmp_path, finished):
    run = copy_run(finished, tmp_path)
    chosen = folder(run, 6)
    data = bytearray((chosen / "common.pth").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (chosen / "common.pth").write_bytes(bytes(data))
    message = refusal(tmp_path, chosen)
    assert "common.pth fails its CRC-32 check" in message and "nothing was changed" in message
    assert committed_steps(run) == [2, 4, 6, 8, 10, 12]


def test_a_checkpoint_of_another_model_does_not_fit(tmp_path, finished):
    message = refusal(tmp_path, folder(finished, 6), extra='model = dict(type="ToyMLP", hidden=16)\n')
    assert "does not fit model ToyMLP (shape-mismatched net.0.weight (32, 8) vs (16, 8)" in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_command_line_refuses_a_weights_file_as_resume_with_exit_2(tmp_path, finished):
    config = write_toy_config(tmp_path, tmp_path / "run")
    result = run_tool("train", config, f"resume={finished / 'model' / 'model_last.pth'}")
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: resume=") and "use weight=<file>" in errors[0]
    assert "Traceback" not in result.stderr


# -- validate_on_resume -----------------------------------------------------------------------------
def test_validate_on_resume_logs_val_at_the_resumed_step_and_changes_nothing(tmp_path, finished):
    plain, checked = copy_run(finished, tmp_path / "plain"), copy_run(finished, tmp_path / "checked")
    inprocess.make_trainer(tmp_path / "plain", HOOKS_ALL, epoch=3, options=[f"resume={folder(plain, 6)}"]).train()
    trainer = inprocess.make_trainer(tmp_path / "checked", HOOKS_ALL, epoch=3,
                                     options=[f"resume={folder(checked, 6)}", "validate_on_resume=True"])
    trainer.train()
    assert_same_weights(checked, plain)
    assert_same_weights(checked, finished)
    val_steps = [r["step"] for r in records(checked) if "val/acc" in r]
    assert val_steps == [4, 6, 8, 12]  # epoch ends 4, 8, 12 and the resumed weights at 6
    assert [r["step"] for r in records(plain) if "val/acc" in r] == [4, 8, 12]
    assert hook_of(trainer, "ClsEvaluator").last_step == 12


def test_validate_on_resume_needs_an_evaluator(tmp_path, finished):
    run = copy_run(finished, tmp_path)
    with pytest.raises(ConfigError, match="validate_on_resume=True needs an evaluator hook"):
        inprocess.make_trainer(tmp_path, f"[{SAVE_ALL}]", epoch=3,
                               options=[f"resume={folder(run, 6)}", "validate_on_resume=True"]).train()
    assert committed_steps(run) == [2, 4, 6, 8, 10, 12]  # refused before anything moved


# -- early stopping on several metrics ---------------------------------------------------------------
@HOOKS.register_module(force=True)
class TwoScores(ScriptedEvaluator):
    """Reports ``score`` (declared: larger is better) and ``err`` (undeclared)
    from scripts: the i-th evaluation reports the i-th values."""

    def __init__(self, score=(0.5,), err=(0.5,), every_n_steps=None):
        super().__init__(values=score, every_n_steps=every_n_steps)
        self.errs = list(err)

    def compute(self, totals):
        out = super().compute(totals)
        return {**out, "err": float(self.errs[min(self.calls, len(self.errs)) - 1])}


SCRIPT = 'dict(type="TwoScores", score=[0.5, 0.6, 0.6, 0.6, 0.6, 0.6], err=[0.5, 0.4, 0.3, 0.3, 0.3, 0.3], ' \
         'every_n_steps=2)'


def stopper_run(tmp_path: Path, stopper: str, extra_hook: str = "", options=()):
    hooks = f'[{extra_hook}{SCRIPT}, {stopper}, dict(type="CheckpointSaver", save_freq=100)]'
    trainer = inprocess.make_trainer(tmp_path, hooks, epoch=10, options=list(options))
    trainer.train()
    return trainer


def test_several_monitors_stop_on_their_oriented_sum(tmp_path):
    # score - err: 0.0, 0.2, 0.3, 0.3, ... at steps 2, 4, 6, ...: best at 6, patience 2 -> stop at 10.
    both = stopper_run(tmp_path / "both", 'dict(type="EarlyStopping", monitor=["val/score", "val/err"], '
                                          'mode=[None, "min"], patience=2)')
    stopper = hook_of(both, "EarlyStopping")
    assert both.outcome == "stopped" and both.global_step == 10
    assert stopper.monitor == "score(+val/score -val/err)" and stopper.modes == ["max", "min"]
    assert (stopper.best, stopper.best_step) == (pytest.approx(0.3), 6)
    # The score alone peaks at step 4: it stops two evaluations earlier.
    one = stopper_run(tmp_path / "one", 'dict(type="EarlyStopping", monitor="val/score", patience=2)')
    assert one.global_step == 8


def test_several_monitors_resume_exactly(tmp_path):
    stopper = 'dict(type="EarlyStopping", monitor=["val/score", "val/err"], mode=[None, "min"], patience=2)'
    first = stopper_run(tmp_path, stopper, extra_hook='dict(type="StopAtStep", step=7), ')
    assert first.global_step == 7
    resumed = stopper_run(tmp_path, stopper, extra_hook='dict(type="StopAtStep", step=1000), ',
                          options=["resume=True"])
    assert resumed.outcome == "stopped" and resumed.global_step == 10


@pytest.mark.parametrize("kwargs, message", [
    (dict(monitor=[]), "monitor=\\[\\] watches nothing"),
    (dict(monitor=["val/a", "val/a"]), "lists a metric twice"),
    (dict(monitor=["val/a", "val_ema/b"]), "mixes evaluation prefixes"),
    (dict(monitor=["val/a", "val/b"], mode="max"), "give one direction per metric"),
    (dict(monitor=["val/a", "val/b"], mode=["max"]), "one direction per monitor"),
])
def test_bad_monitor_lists_are_refused(kwargs, message):
    from pimm.engines.hooks.early_stopping import EarlyStopping

    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)


def test_a_mode_list_contradicting_a_declared_direction_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="mode='min' contradicts 'val/score'"):
        stopper_run(tmp_path, 'dict(type="EarlyStopping", monitor=["val/score", "val/err"], mode=["min", "min"])')


# -- CheckpointSaver(keep="best") --------------------------------------------------------------------
def keep_best_run(tmp_path: Path, values, options=(), stop: int = 1000):
    hooks = (f'[dict(type="StopAtStep", step={stop}), dict(type="ScriptedEvaluator", values={list(values)}), '
             'dict(type="CheckpointSaver", keep="best")]')
    trainer = inprocess.make_trainer(tmp_path, hooks, epoch=len(values), options=list(options))
    trainer.train()
    return trainer


def test_keep_best_keeps_the_best_and_the_newest_for_resume(tmp_path):
    trainer = keep_best_run(tmp_path, [0.5, 0.9, 0.6, 0.7])  # checkpoints at 4, 8, 12, 16; best at 8
    assert committed_steps(trainer.save_path) == [8, 16]
    # The newest is the best: it is the only one.
    assert committed_steps(keep_best_run(tmp_path / "b", [0.5, 0.6, 0.9]).save_path) == [12]


def test_keep_best_resumes_from_the_newest_exactly(tmp_path):
    uninterrupted = keep_best_run(tmp_path / "ref", [0.5, 0.9, 0.6, 0.7])
    keep_best_run(tmp_path / "cut", [0.5, 0.9, 0.6, 0.7], stop=10)  # a stop commits a checkpoint at 10
    assert committed_steps(tmp_path / "cut" / "run") == [8, 10]
    resumed = keep_best_run(tmp_path / "cut", [0.5, 0.9, 0.6, 0.7], options=["resume=True"])
    assert resumed.global_step == 16 and committed_steps(resumed.save_path) == [8, 16]
    assert_same_weights(resumed.save_path, uninterrupted.save_path)


def test_keep_is_a_whole_policy():
    from pimm.engines.hooks.checkpoint import CheckpointSaver

    with pytest.raises(ValueError, match="keep must be one of 'best', 'last', 'all'"):
        CheckpointSaver(keep="newest")
    with pytest.raises(ValueError, match="drop keep_all / keep_every"):
        CheckpointSaver(keep="best", keep_every=10)
    retention = CheckpointSaver(keep="best").retention
    assert (retention.keep_last, retention.keep_best, retention.keep_all) == (1, True, False)


# -- scheduler_interval -------------------------------------------------------------------------------
SCHED_HOOKS = '[{stop}dict(type="InformationWriter", log_frequency=1), dict(type="CheckpointSaver", save_freq=100)]'
POLY = 'scheduler = dict(type="PolyLR", power=1.0)\n'


def lrs(save_path: Path) -> list[float]:
    return [r["train/lr"] for r in records(save_path) if "train/lr" in r]


def test_the_scheduler_steps_every_n_updates_over_a_schedule_of_the_right_length(tmp_path):
    trainer = inprocess.make_trainer(tmp_path, SCHED_HOOKS.format(stop=""), extra=POLY, epoch=3,
                                     options=["scheduler_interval=3"])
    trainer.train()
    assert trainer.scheduler.total_steps == 4  # 12 updates / 3
    used = lrs(trainer.save_path)
    assert len(used) == 12
    blocks = [used[i:i + 3] for i in range(0, 12, 3)]
    assert all(len(set(block)) == 1 for block in blocks)  # constant within each block of 3 updates
    assert [block[0] for block in blocks] == pytest.approx([0.01 * (1 - k / 4) for k in range(4)])


def test_scheduler_interval_resumes_exactly_from_the_middle_of_a_block(tmp_path):
    reference = inprocess.make_trainer(tmp_path / "ref", SCHED_HOOKS.format(stop=""), extra=POLY, epoch=3,
                                       options=["scheduler_interval=3"])
    reference.train()
    stop = 'dict(type="StopAtStep", step={}), '
    first = inprocess.make_trainer(tmp_path / "cut", SCHED_HOOKS.format(stop=stop.format(5)), extra=POLY, epoch=3,
                                   options=["scheduler_interval=3"])
    first.train()
    assert first.global_step == 5 and first.optim_step.updates == 5
    resumed = inprocess.make_trainer(tmp_path / "cut", SCHED_HOOKS.format(stop=stop.format(1000)), extra=POLY,
                                     epoch=3, options=["scheduler_interval=3", "resume=True"])
    resumed.train()
    assert lrs(resumed.save_path) == lrs(reference.save_path)
    assert_same_weights(resumed.save_path, reference.save_path)


def test_scheduler_interval_must_be_a_positive_integer(tmp_path):
    with pytest.raises(ConfigError, match="scheduler_interval=0 is invalid"):
        inprocess.make_trainer(tmp_path, SCHED_HOOKS.format(stop=""), options=["scheduler_interval=0"])
