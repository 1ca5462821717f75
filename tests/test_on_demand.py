"""OnDemandValidation: a signal evaluates the current weights at the next step
boundary, metrics only, without changing training."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.cli import register_all  # noqa: E402
from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.hooks.on_demand import OnDemandValidation  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.utils.errors import ConfigError  # noqa: E402
from tests.support import forkserver  # noqa: E402
from tests.support.run import ROOT as REPO, env, final_weights, write_toy_config  # noqa: E402

register_all()  # models, data sets, evaluators

@HOOKS.register_module(force=True)
class BestProbe(HookBase):
    """Records, after each evaluation, its kind and the best model's step."""

    events = []

    def after_val(self, metrics, run):
        self.events.append((self.trainer.global_step, run.kind, self.trainer.metrics.best.step))


SMALL = """
epoch = 2
data = dict(
    train=dict(type="ToyDataset", num_samples=64, noise_aug=0.1),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
)
"""


def make_trainer(directory: Path, hooks: str, options=()):
    directory.mkdir(parents=True, exist_ok=True)
    cfg_path = write_toy_config(directory, directory / "run", SMALL + f"hooks = [{hooks}]\n")
    cfg, built = load_config(str(cfg_path), list(options), world_size=1)
    return build_trainer(cfg, hooks=built)


def val_steps(trainer) -> list[int]:
    return [r["step"] for r in map(json.loads, open(trainer.save_path / "metrics.jsonl")) if "val/acc" in r]


def test_a_signal_evaluates_at_the_next_step_and_training_stays_bit_identical(tmp_path):
    # The evaluator's own schedule never fires (every 1000 steps): what is evaluated before the
    # end of training is the on-demand evaluation only.
    evaluator = 'dict(type="ClsEvaluator", num_classes=2, every_n_steps=1000)'
    plain = make_trainer(tmp_path / "plain", f'{evaluator}, dict(type="CheckpointSaver")')
    plain.train()
    signaled = make_trainer(tmp_path / "signaled", f'{evaluator}, dict(type="OnDemandValidation"), '
                                                   'dict(type="CheckpointSaver"), dict(type="SignalAtStep", step=3), '
                                                   'dict(type="BestProbe")')
    BestProbe.events.clear()
    signaled.train()
    assert val_steps(plain) == [8]
    assert val_steps(signaled) == [3, 8]  # on demand, then the final weights (still evaluated)
    for (name, a), b in zip(plain.model_without_ddp.state_dict().items(),
                            signaled.model_without_ddp.state_dict().values()):
        assert torch.equal(a, b), name
    # Metrics only: the on-demand result never became the best model.
    assert BestProbe.events == [(3, "on_demand", None), (8, "final", 8)]
    assert torch.load(signaled.save_path / "model" / "model_best.pth", weights_only=True)["global_step"] == 8


def test_signals_before_training_and_repeated_ones(tmp_path):
    hooks = ('dict(type="ClsEvaluator", num_classes=2, every_n_steps=2), dict(type="OnDemandValidation"), '
             'dict(type="SignalAtStep", step=2), dict(type="SignalAtStep", step=5), '
             'dict(type="SignalAtStep", step=5)')
    trainer = make_trainer(tmp_path, hooks)
    os.kill(os.getpid(), signal.SIGUSR1)  # during start-up: served at the first step boundary
    trainer.train()
    # Step 1: the start-up signal. Step 2: the scheduled evaluation already scored these
    # weights, so the signal adds nothing. Step 5: two signals, one evaluation.
    assert val_steps(trainer) == [1, 2, 4, 5, 6, 8]


@pytest.mark.parametrize("name, message", [
    ("SIGFOO", r"signal='SIGFOO' is not a signal name"),
    ("USR1", r"signal='USR1' is not a signal name"),
    ("SIGKILL", r"'SIGKILL' cannot be caught"),
])
def test_bad_signal_names_are_config_errors(name, message):
    with pytest.raises(ConfigError, match=message):
        OnDemandValidation(signal=name)


def test_a_signal_that_also_pre_empts_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"SIGUSR2 is also in preempt_signals"):
        make_trainer(tmp_path, 'dict(type="OnDemandValidation", signal="SIGUSR2")',
                     options=["preempt_signals=['SIGTERM','SIGUSR2']"])


@pytest.mark.parametrize("name", ["SIGINFO", "SIGUSR1"])
def test_a_signal_this_platform_lacks_makes_the_hook_a_warning_and_a_no_op(tmp_path, monkeypatch, caplog, name):
    if name == "SIGUSR1":  # as on Windows
        monkeypatch.delattr(signal, "SIGUSR1")
    elif hasattr(signal, name):
        pytest.skip(f"this platform has {name}")
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, f'dict(type="ClsEvaluator", num_classes=2), '
                                     f'dict(type="OnDemandValidation", signal="{name}")')
    trainer.train()
    assert f"OnDemandValidation: this platform has no {name}; the hook does nothing" in caplog.text
    assert val_steps(trainer) == [4, 8]


# ----------------------------------------------------------------------------- two processes

TWO_PROCESS = """
custom_imports = ["tests.support.toy", "tests.support.preempt"]
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2),
    dict(type="OnDemandValidation", check_every=3),
    dict(type="LiveControl", poll_every=4),
    dict(type="CheckpointSaver", save_freq=5),
    dict(type="LrProbe"),
    dict(type="PauseForSignal", steps={pause}, directory={directory!r}, signals=("SIGUSR1",)),
]
"""


def _two_process_run(root: Path, name: str, pause) -> tuple[list[str], Path]:
    config_dir = root / f"cfg-{name}"
    config_dir.mkdir(parents=True)
    save = root / name
    cfg = write_toy_config(config_dir, save, TWO_PROCESS.format(pause=list(pause), directory=str(config_dir)))
    save.mkdir()
    (save / "control.json").write_text(json.dumps({"revision": 1, "lr": 0.002}))
    cmd = [sys.executable, str(REPO / "tools" / "train.py"), "--config-file", str(cfg), "--num-gpus", "2"]
    return cmd, save


@pytest.mark.slow
def test_two_processes_signal_to_the_launcher_evaluates_on_both_ranks_and_changes_nothing(tmp_path):
    """SIGUSR1 to the --num-gpus launcher reaches both ranks; they agree at the next check
    (every 3 steps) and evaluate together. LiveControl's change reaches both ranks too."""
    ref_cmd, ref = _two_process_run(tmp_path, "ref", pause=())
    done = forkserver.run(ref_cmd, capture_output=True, text=True, env=env(), cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    cmd, save = _two_process_run(tmp_path, "signaled", pause=(5,))
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env(),
                                cwd=REPO, start_new_session=True)
    try:
        paused = tmp_path / "cfg-signaled" / "paused-5"
        deadline = time.monotonic() + 240
        while not paused.exists():
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGUSR1)  # the launcher forwards it to both ranks
        assert launcher.wait(timeout=240) == 0, launcher.stderr.read()[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    log = (save / "train.log").read_text()
    assert "On-demand evaluation at step 6 (SIGUSR1 received)" in log
    steps = lambda path: [r["step"] for r in map(json.loads, open(path / "metrics.jsonl")) if "val/acc" in r]  # noqa
    assert steps(ref) == [10, 20, 30] and steps(save) == [6, 10, 20, 30]
    got, want = final_weights(save)["state_dict"], final_weights(ref)["state_dict"]
    assert all(torch.equal(got[k], v) for k, v in want.items())
    lrs = {(save / f"lr.rank{r}").read_text() for r in (0, 1)}
    assert len(lrs) == 1 and lrs == {(ref / "lr.rank0").read_text()}  # both ranks rebased their schedule alike
    assert len((save / "control_audit.jsonl").read_text().splitlines()) == 1  # rank 0 writes it, once


def test_without_a_validation_split_the_request_is_a_warning_not_a_crash(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="pimm")
    trainer = make_trainer(tmp_path, 'dict(type="ClsEvaluator", num_classes=2), dict(type="OnDemandValidation"), '
                                     'dict(type="SignalAtStep", step=2)', options=["evaluate=False", "data.val=None"])
    trainer.train()
    assert trainer.outcome == "completed"
    assert "On-demand evaluation at step 2 (SIGUSR1 received) skipped: data.val is not set" in caplog.text
