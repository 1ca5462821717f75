"""LiveControl: ``save_path/control.json`` read every ``poll_every`` steps.

In-process trainers (64 samples, batch 16: 4 steps per epoch, 2 epochs unless
said otherwise) for what is applied when, and how; real processes
(tools/train.py, SIGKILL, resume) for the exact-resume guarantee.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import register_all  # noqa: E402
from pimm.engines import scale_lr  # noqa: E402
from pimm.engines.hooks.live_control import AUDIT_FILE, parse_control  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.optim import build_optimizer  # noqa: E402
from pimm.engines.optim.scheduler import build_scheduler  # noqa: E402
from tests.support.run import final_weights, run_tool, train_losses, write_toy_config  # noqa: E402

register_all()  # models, data sets, evaluators

SMALL = """
epoch = {epoch}
data = dict(
    train=dict(type="ToyDataset", num_samples=64, noise_aug=0.1),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
)
"""
HOOKS = ('dict(type="InformationWriter", log_frequency=4), dict(type="ClsEvaluator", num_classes=2), '
         'dict(type="LiveControl", poll_every={poll}), dict(type="CheckpointSaver", save_freq={save_freq}, keep_last=10)')


def make_trainer(directory: Path, extra_hooks: str = "", poll: int = 2, epoch: int = 2, save_freq=None,
                 options=(), control: dict | None = None):
    directory.mkdir(parents=True, exist_ok=True)
    hooks = HOOKS.format(poll=poll, save_freq=save_freq) + (", " + extra_hooks if extra_hooks else "")
    cfg_path = write_toy_config(directory, directory / "run", SMALL.format(epoch=epoch) + f"hooks = [{hooks}]\n")
    cfg, built = load_config(str(cfg_path), list(options), world_size=1)
    if control is not None:
        write_control(directory / "run", control)
    return build_trainer(cfg, hooks=built)


def write_control(save_path: Path, content) -> None:
    save_path.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (save_path / "control.json").write_text(text)


def records(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in open(save_path / "metrics.jsonl")]


def audit(save_path: Path) -> list[dict]:
    path = save_path / AUDIT_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def series(save_path: Path, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records(save_path) if key in r}


def writes(*entries) -> str:
    """WriteFileAtStep hooks writing control.json: (step, content) pairs."""
    return ", ".join(f"dict(type='WriteFileAtStep', step={step}, name='control.json', "
                     f"text={content if isinstance(content, str) else json.dumps(content)!r})"
                     for step, content in entries)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The same run without any control file."""
    trainer = make_trainer(tmp_path_factory.mktemp("plain"))
    trainer.train()
    return trainer.save_path


# ----------------------------------------------------------------------------- applying


def test_a_revision_is_applied_once_at_a_poll_step_logged_published_and_audited(tmp_path, plain, caplog):
    caplog.set_level(logging.INFO, logger="pimm")
    trainer = make_trainer(tmp_path, control={"revision": 1, "lr": 0.002, "eval_every_n_steps": 3,
                                              "log_frequency": 2, "note": "test"})
    trainer.train()
    save = trainer.save_path
    # Read at step 2 (the first poll), in effect from step 3; never applied again.
    lines = [r.getMessage() for r in caplog.records if "LiveControl revision" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("LiveControl revision 1 at step 2: lr 9.505e-03 -> 2.000e-03")
    assert "eval_every_n_steps None -> 3" in lines[0] and "log_frequency 4 -> 2" in lines[0]
    [entry] = audit(save)
    assert (entry["step"], entry["revision"]) == (2, 1)
    assert entry["changes"] == {"lr": 0.002, "eval_every_n_steps": 3, "log_frequency": 2, "note": "test"}
    assert entry["previous"] == {"lr": pytest.approx(0.0095048, rel=1e-4), "eval_every_n_steps": None,
                                 "log_frequency": 4}
    control = [r for r in records(save) if "control/revision" in r]
    assert control == [{"step": 2, "epoch": 1, "control/revision": 1, "control/lr": pytest.approx(0.002),
                        "control/eval_every_n_steps": 3, "control/log_frequency": 2}]
    # The schedule is rebased: from step 3 on, the plain run's lr times the same factor.
    lr, plain_lr = series(save, "train/lr"), series(plain, "train/lr")
    assert [lr[s] for s in (1, 2)] == [plain_lr[s] for s in (1, 2)]
    scale = entry["lr_scale"]
    assert lr[3] == pytest.approx(0.002) and scale == pytest.approx(0.002 / plain_lr[3])
    assert all(lr[s] == pytest.approx(plain_lr[s] * scale, rel=1e-9) for s in range(3, 9))
    # Evaluations every 3 steps instead of at epoch ends (then the final weights at step 8).
    assert sorted(series(save, "val/acc")) == [3, 6, 8]
    assert sorted(series(plain, "val/acc")) == [4, 8]


def test_malformed_files_warn_once_per_content_and_change_nothing(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, poll=1, epoch=3, extra_hooks=writes(
        (2, "{'revision': 1"),                                   # steps 2-3: bad JSON
        (4, {"revision": 1, "learning_rate": 0.1}),               # unknown key
        (5, {"revision": 1, "lr": "fast"}),                       # wrong type
        (6, {"revision": 1.0, "lr": 0.001}),                      # the revision is not an integer
        (7, {"revision": 2, "log_frequency": 3}),                 # applied
        (8, {"revision": 2, "log_frequency": 5}),                 # steps 8-9: same revision, other content
        (10, {"revision": 1, "log_frequency": 6}),                # a lower revision
        (11, {"revision": 2, "log_frequency": 3}),                # the applied content again: silent
    ))
    trainer.train()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = [
        "control.json ignored: it is not valid JSON",
        "control.json ignored: unknown key(s) ['learning_rate']; it takes revision, note, lr",
        "control.json ignored: 'lr' must be a number from 1e-10 to 100, got 'fast'",
        "control.json ignored: 'revision' must be an integer from 1 to 9007199254740991, got 1.0",
        "control.json revision 2 ignored: it is not above the last applied revision 2; raise 'revision'",
        "control.json revision 1 ignored: it is not above the last applied revision 2",
    ]
    assert len(warnings) == len(expected), warnings
    for got, want in zip(warnings, expected):
        assert got.startswith("LiveControl: " + want), (got, want)
    entries = audit(trainer.save_path)
    assert [(e["step"], e["revision"]) for e in entries if "refused" not in e] == [(7, 2)]
    # Each warning is also a "refused" audit line (at the step it was read), never an applied one.
    assert [(e["step"], e["revision"]) for e in entries if "refused" in e] == [
        (2, None), (4, None), (5, None), (6, None), (8, 2), (10, 1)]
    assert next(h for h in trainer.hooks if type(h).__name__ == "LiveControl").revision == 2
    writer = next(h for h in trainer.hooks if type(h).__name__ == "InformationWriter")
    assert writer.log_frequency == 3


def test_no_file_is_silent(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, poll=1)
    trainer.train()
    assert not [r for r in caplog.records if "LiveControl" in r.getMessage()]
    assert not (trainer.save_path / AUDIT_FILE).exists()


def test_checkpoint_evaluate_and_stop_requests(tmp_path):
    trainer = make_trainer(tmp_path, poll=1, epoch=5, extra_hooks=writes(
        (2, {"revision": 1, "checkpoint": True, "evaluate": True}),
        (6, {"revision": 2, "stop": "good enough"}),
    ))
    trainer.train()
    save = trainer.save_path
    assert sorted(p.name for p in (save / "checkpoints").glob("step*")) == [
        "step000000002-epoch0000", "step000000004-epoch0001", "step000000006-epoch0001"]
    assert trainer.outcome == "stopped" and trainer.global_step == 6
    assert trainer.train_state.stop_reason == "control.json revision 2: good enough"
    # The on-demand evaluation at step 2 is metrics only: the epoch-end ones choose the best model.
    assert sorted(series(save, "val/acc")) == [2, 4, 6]
    assert trainer.metrics.best.step in (4, 6)


def test_lr_and_eval_changes_need_what_they_change(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pimm")
    directory = tmp_path / "x"
    directory.mkdir()
    cfg_path = write_toy_config(directory, directory / "run", SMALL.format(epoch=1) +
                                "hooks = [dict(type='LiveControl', poll_every=2)]\n")
    cfg, built = load_config(str(cfg_path), [], world_size=1)
    write_control(directory / "run", {"revision": 1, "eval_every_n_steps": 5})
    trainer = build_trainer(cfg, hooks=built)
    trainer.train()
    assert any("revision 1 ignored: 'eval_every_n_steps' needs an evaluator hook" in r.getMessage()
               for r in caplog.records)
    assert [e["refused"] for e in audit(trainer.save_path)] == [
        "ignored: 'eval_every_n_steps' needs an evaluator hook, and this run has none"]


# ----------------------------------------------------------------------------- the lr scale


@pytest.mark.parametrize("spec", [
    dict(type="CosineWarmupLR", warmup_ratio=0.2),
    dict(type="CosineWarmupLR", warmup_steps=3, eta_min=1e-4),
    dict(type="OneCycleLR", pct_start=0.25),
    dict(type="MultiStepLR", milestones=[0.3, 0.7], gamma=0.5),
    dict(type="PolyLR", power=0.9),
    dict(type="ConstantLR"),
], ids=lambda s: "-".join(f"{v}" for v in s.values()))
def test_scale_lr_scales_the_rest_of_the_schedule_for_every_group(spec):
    def build():
        model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
        optimizer = build_optimizer(dict(type="AdamW", lr=0.01), model, [dict(keyword="1.", lr_scale=0.5)])
        return optimizer, build_scheduler(dict(spec), optimizer, total_steps=20)

    optimizer, scheduler = build()
    ref_optimizer, ref_scheduler = build()
    for _ in range(6):
        optimizer.step(), scheduler.step(), ref_optimizer.step(), ref_scheduler.step()
    new_lr = 0.003
    scale = new_lr / optimizer.param_groups[0]["lr"]
    scale_lr(optimizer, scheduler, scale)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(new_lr, rel=1e-12)
    for _ in range(14):
        got = [g["lr"] for g in optimizer.param_groups]
        want = [g["lr"] * scale for g in ref_optimizer.param_groups]
        assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
        if "eta_min" not in spec:  # (an absolute floor is shared by the groups)
            assert got[1] == pytest.approx(got[0] * 0.5, rel=1e-9)  # the ratio between groups holds
        optimizer.step(), scheduler.step(), ref_optimizer.step(), ref_scheduler.step()


def test_parse_control_returns_the_revision_and_the_changes():
    assert parse_control(b'{"revision": 4, "lr": 1e-4, "stop": "done"}') == {
        "revision": 4, "changes": {"lr": 1e-4, "stop": "done"}}
    assert parse_control(b'{"revision": 5, "eval_every_n_steps": null}')["changes"] == {"eval_every_n_steps": None}
    for bad in (b"[1]", b'{"lr": 1}', b'{"revision": true}', b'{"revision": 1, "lr": 0}',
                b'{"revision": 1, "log_frequency": 2.5}', b'{"revision": 1, "stop": ""}', b"\xff"):
        with pytest.raises(ValueError):
            parse_control(bad)


# ----------------------------------------------------------------------------- resume


def _weights(save_path: Path) -> dict:
    return final_weights(save_path)["state_dict"]


def test_resume_reapplies_the_changes_in_the_checkpoint_and_replays_the_ones_after_it(tmp_path):
    """In-process: stop at step 7 (checkpoints at 4 and 7), throw away the step-7 one (as
    if killed before it was written), resume from 4: revision 1 (step 2) comes from the
    checkpoint's hook state, revision 2 (step 6) from the audit file, applied at step 6
    again although control.json meanwhile says revision 3."""
    changes = writes((1, {"revision": 1, "lr": 0.004, "eval_every_n_steps": 3}),
                     (5, {"revision": 2, "lr": 0.001, "log_frequency": 2}))
    ref = make_trainer(tmp_path / "ref", changes, epoch=3)
    ref.train()
    first = make_trainer(tmp_path / "run", changes + ", dict(type='StopAtStep', step=7)", epoch=3)
    first.train()
    save = first.save_path
    shutil.rmtree(save / "checkpoints" / "step000000007-epoch0001")
    write_control(save, {"revision": 3, "lr": 0.5})  # edited after the "kill": must not jump the queue
    resumed = make_trainer(tmp_path / "run", epoch=3, options=["resume=True"])
    resumed.train()
    revisions = [(e["step"], e["revision"], e.get("replayed", False)) for e in audit(save)]
    assert revisions == [(2, 1, False), (6, 2, False), (6, 2, True), (8, 3, False)]
    # Up to the poll at step 8 the resumed run is the uninterrupted one (the update of step 9
    # is the first with the new lr, so losses differ from step 10 on).
    ref_loss, loss = series(ref.save_path, "train/loss"), series(save, "train/loss")
    assert [loss[s] for s in range(1, 10)] == [ref_loss[s] for s in range(1, 10)]
    assert loss[10] != ref_loss[10]
    assert series(save, "train/lr")[9] > 10 * series(ref.save_path, "train/lr")[9]


def test_resume_from_a_checkpoint_holding_the_changes_is_bit_identical(tmp_path):
    """Both revisions (steps 2 and 6) are in the step-6 checkpoint: the resumed run re-applies
    them over the configured values and applies nothing twice."""
    changes = writes((1, {"revision": 1, "lr": 0.004}), (5, {"revision": 2, "lr": 0.02, "eval_every_n_steps": 3}))
    ref = make_trainer(tmp_path / "ref", changes, epoch=3, save_freq=6)
    ref.train()
    first = make_trainer(tmp_path / "run", changes + ", dict(type='StopAtStep', step=7)", epoch=3, save_freq=6)
    first.train()
    shutil.rmtree(first.save_path / "checkpoints" / "step000000007-epoch0001")  # as if killed at step 7
    resumed = make_trainer(tmp_path / "run", changes, epoch=3, save_freq=6, options=["resume=True"])
    resumed.train()
    got, want = _weights(resumed.save_path), _weights(ref.save_path)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert records(resumed.save_path) == records(ref.save_path)
    assert [(e["step"], e["revision"]) for e in audit(resumed.save_path)] == [(2, 1), (6, 2)]  # nothing re-applied


# ----------------------------------------------------------------------------- real processes

PROCESS_HOOKS = """
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2),
    dict(type="LiveControl", poll_every=4),
    dict(type="CheckpointSaver", save_freq=5, async_write=False),  # the step-15 save is committed before step 18
    dict(type="WriteFileAtStep", step=13, name="control.json",
         text='{"revision": 2, "lr": 0.001, "log_frequency": 2, "eval_every_n_steps": 3}'),
    dict(type="KillAtStep", step=10**9),
]
"""


def _process_run(root: Path, name: str) -> tuple[Path, Path]:
    config_dir = root / f"cfg-{name}"
    config_dir.mkdir(parents=True)
    save = root / name
    cfg = write_toy_config(config_dir, save, PROCESS_HOOKS)
    write_control(save, {"revision": 1, "lr": 0.003})  # applied at step 4, the first poll
    return cfg, save


@pytest.mark.slow  # a kill/signal of a real training process, then a resume
def test_sigkill_after_a_change_before_its_checkpoint_then_resume_is_bit_identical(tmp_path):
    """tools/train.py, 3 epochs of 10 steps, checkpoints every 5 steps, polls every 4: revision 2
    is written at step 13 and applied at step 16; the run is SIGKILLed at step 18, so the
    newest checkpoint (15) lacks it. The resumed run re-applies it at step 16 and ends
    bit-identical to the uninterrupted run, metrics.jsonl included."""
    ref_cfg, ref = _process_run(tmp_path, "ref")
    assert run_tool("train", ref_cfg).returncode == 0
    cfg, save = _process_run(tmp_path, "killed")
    killed = run_tool("train", cfg, "hooks.KillAtStep.step=18")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert [(e["step"], e["revision"]) for e in audit(save)] == [(4, 1), (16, 2)]

    edited = tmp_path / "edited"
    shutil.copytree(save, edited)
    resumed = run_tool("train", cfg, "resume=True")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = (save / "train.log").read_text()
    assert "Resumed from step000000015" in log and "LiveControl revision 2 at step 16 (replayed)" in log
    got, want = _weights(save), _weights(ref)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    assert records(save) == records(ref)
    assert [(e["step"], e["revision"], e.get("replayed", False)) for e in audit(save)] == [
        (4, 1, False), (16, 2, False), (16, 2, True)]

    # The same, with control.json edited before the resume: the recorded change still comes at
    # step 16, the new revision at the first poll after it (20).
    write_control(edited, {"revision": 3, "lr": 0.0001})
    resumed = run_tool("train", cfg, f"save_path={str(edited)!r}", "resume=True")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [(e["step"], e["revision"]) for e in audit(edited)] == [(4, 1), (16, 2), (16, 2), (20, 3)]
    losses, ref_losses = dict(train_losses(edited)), dict(train_losses(ref))
    assert [losses[s] for s in range(1, 21)] == [ref_losses[s] for s in range(1, 21)]
    assert all(losses[s] != ref_losses[s] for s in range(22, 31))


# ----------------------------------------------------------------------------- hostile files (issue 21)


def lc(trainer):
    return next(h for h in trainer.hooks if type(h).__name__ == "LiveControl")


def applied(save_path: Path) -> list[tuple[int, int]]:
    return [(e["step"], e["revision"]) for e in audit(save_path) if "refused" not in e]


def refused(save_path: Path) -> list[str]:
    return [e["refused"] for e in audit(save_path) if "refused" in e]


@pytest.mark.parametrize("content, reason", [
    ('{"revision": 1, "lr": 1e308}', "'lr' must be a number from 1e-10 to 100, got 1e+308"),
    ('{"revision": 1, "lr": 1e400}', "'lr' must be a number from 1e-10 to 100, got inf"),
    ('{"revision": 1, "lr": NaN}', "'lr' must be a number from 1e-10 to 100, got nan"),
    ('{"revision": 1' + "0" * 400 + ', "lr": 0.001}', "'revision' must be an integer from 1 to 9007199254740991"),
    ('{"revision": 1, "eval_every_n_steps": ' + "9" * 30 + "}", "'eval_every_n_steps' must be an integer from 1"),
    ('{"revision": 1, "note": "' + "x" * 2000 + '"}', "'note' must be a string of at most 1000 characters"),
])
def test_a_valid_looking_value_out_of_range_is_refused_and_the_run_goes_on(tmp_path, plain, caplog, content, reason):
    """Issue 21, defect 1: these killed the run (NaN lr, OverflowError) and were replayed on resume."""
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, control=content)
    trainer.train()
    assert trainer.outcome == "completed"
    assert any(reason in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert applied(trainer.save_path) == [] and len(refused(trainer.save_path)) == 1
    assert series(trainer.save_path, "train/lr") == series(plain, "train/lr")  # nothing changed
    assert all(torch.isfinite(v).all() for v in _weights(trainer.save_path).values())


def test_a_vanishing_lr_is_refused_so_later_changes_still_apply(tmp_path, caplog):
    """``"lr": 5e-324`` set the lr to 0, and every later lr change was then refused."""
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, poll=1, extra_hooks=writes((3, {"revision": 2, "lr": 0.001})),
                           control={"revision": 1, "lr": 5e-324})
    trainer.train()
    assert applied(trainer.save_path) == [(3, 2)]
    assert refused(trainer.save_path) == ["ignored: 'lr' must be a number from 1e-10 to 100, got 5e-324"]
    assert series(trainer.save_path, "train/lr")[4] == pytest.approx(0.001)


def test_an_lr_that_would_leave_the_scale_range_is_refused(tmp_path):
    """The lr is in range, but the schedule is at 1e-14 (MultiStepLR, gamma 1e-12): 100 would scale it
    by 1e16, past the schedule's scale range."""
    trainer = make_trainer(tmp_path, poll=2, control={"revision": 1, "lr": 100},
                           options=["scheduler={'type': 'MultiStepLR', 'milestones': [1], 'gamma': 1e-12}"])
    trainer.train()
    assert applied(trainer.save_path) == []
    assert refused(trainer.save_path) == ["ignored: 'lr' 100 would scale the configured schedule by 1e+16, "
                                          "outside [1e-12, 1e+12]"]
    assert trainer.scheduler.lr_scale == 1.0


def test_a_fifo_or_an_oversized_file_is_refused_without_blocking(tmp_path, caplog):
    """Issue 21, defect 5: a FIFO named control.json hung the run (and SIGTERM could not stop it)."""
    import os
    import signal

    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path / "fifo", poll=1)
    trainer.save_path.mkdir(parents=True, exist_ok=True)
    os.mkfifo(trainer.save_path / "control.json")

    def hung(signum, frame):
        raise AssertionError("the run blocked on the FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        trainer.train()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert trainer.outcome == "completed"
    assert refused(trainer.save_path) == ["ignored: it is a FIFO; LiveControl reads only a regular file"]  # once

    big = make_trainer(tmp_path / "big", poll=1, control='{"revision": 1, "lr": 0.001, "note": "' + "x" * 900 + '"}'
                       + " " * 70_000)
    big.train()
    assert refused(big.save_path) == ["ignored: it is larger than 65536 bytes"] and applied(big.save_path) == []


def test_a_change_that_broke_a_run_is_ignored_on_resume(tmp_path, caplog):
    """Issue 21: an older pimm applied ``"lr": 1e308`` (audited with its factor, inf) and every resume
    replayed it. Now the recorded change is checked again, audited as refused and skipped, and the
    resumed run ends like a run that never saw it."""
    changes = writes((1, {"revision": 1, "lr": 0.004}))
    ref = make_trainer(tmp_path / "ref", changes, epoch=3)
    ref.train()
    first = make_trainer(tmp_path / "run", changes + ", dict(type='StopAtStep', step=7)", epoch=3)
    first.train()
    save = first.save_path
    shutil.rmtree(save / "checkpoints" / "step000000007-epoch0001")  # killed after step 6: resume from 4
    [entry] = audit(save)
    poisoned = {**entry, "step": 6, "revision": 2, "changes": {"lr": 1e308}, "previous": {"lr": 0.003},
                "lr_scale": float("inf")}
    with open(save / AUDIT_FILE, "a") as fh:
        fh.write(json.dumps(poisoned) + "\n")
    write_control(save, {"revision": 1, "lr": 0.004})  # the file was fixed meanwhile
    caplog.set_level(logging.WARNING, logger="pimm")
    resumed = make_trainer(tmp_path / "run", epoch=3, options=["resume=True"])
    resumed.train()
    assert resumed.outcome == "completed"
    assert any("revision 2 recorded change ignored: 'lr' must be a number" in r.getMessage() for r in caplog.records)
    last = audit(save)[-1]
    assert last["refused"].startswith("recorded change ignored") and last["replayed"] is True
    got, want = _weights(save), _weights(ref.save_path)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    # Revision 2 left the poisoned record and its refusal, nothing applied (a refused line is never replayed).
    assert [("refused" in e) for e in audit(save) if e.get("revision") == 2] == [False, True]
    assert not any(e.get("revision") == 2 for e in lc(resumed).history)


def test_an_old_checkpoint_state_is_checked_before_it_is_re_applied(tmp_path, caplog):
    """A LiveControl state written before the scheduler kept the lr scale: its lr factors are
    re-applied through scale_lr, unless they fail today's checks (then ignored, audited)."""
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path)
    hook = lc(trainer)
    hook.load_state_dict({"revision": 3, "lineage": "old", "history": [
        {"step": 2, "revision": 1, "changes": {"lr": 0.005}, "lr_scale": 0.5},
        {"step": 4, "revision": 2, "changes": {"lr": 1e308}, "lr_scale": float("inf")},
        {"step": 6, "revision": 3, "changes": {"log_frequency": 0}, "lr_scale": None}]})
    hook.after_load_checkpoint()
    assert trainer.scheduler.lr_scale == 0.5
    assert [h["revision"] for h in hook.history] == [1]
    assert [e["revision"] for e in audit(trainer.save_path)] == [2, 3]
    assert all("restored change ignored" in e["refused"] for e in audit(trainer.save_path))
