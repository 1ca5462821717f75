"""EMAHook: the average itself (by hand), skipped steps, BatchNorm buffers,
``update_every``, evaluation of the averaged weights (``val_ema/*``), the
exported ``model/model_ema.pth``, checkpoint state, and two DDP ranks.

In-process trainers use the toy task (4 steps per epoch); the DDP test runs
``tools/train.py --num-gpus 2`` (gloo).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.hooks.base import build_hooks  # noqa: E402
from pimm.engines.hooks.ema import EMAHook, ema_decay  # noqa: E402
from pimm.engines.observe.metrics import MetricChannel  # noqa: E402
from pimm.engines.optim.step import StepResult  # noqa: E402
from pimm.utils.errors import ConfigError, RegistryError  # noqa: E402
from tests.support.inprocess import hook_of, make_trainer, records  # noqa: E402
from tests.support.run import run_tool, write_toy_config  # noqa: E402
from tests.support.toy import ToyMLP, WeightsRecorder  # noqa: E402


@pytest.fixture(autouse=True)
def clean_records():
    WeightsRecorder.records.clear()
    yield
    WeightsRecorder.records.clear()


def hand_ema(history, decay: float, warmup: bool = True, update_every: int = 1) -> dict:
    """The EMA of the recorded weights, computed the plain way: copy at the
    first averaged update, then ema = d * ema + (1 - d) * w."""
    ema, averaged, real = None, 0, 0
    for _, stepped, weights in history:
        if not stepped:
            continue
        real += 1
        if real % update_every:
            continue
        if ema is None:
            ema = {k: v.clone() for k, v in weights.items()}
        else:
            d = min(decay, (1 + averaged) / (10 + averaged)) if warmup else decay
            ema = {k: d * ema[k] + (1 - d) * weights[k] for k in ema}
        averaged += 1
    return ema


def assert_close_weights(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-6, atol=1e-7, msg=key)


# -- the average ------------------------------------------------------------------------
def test_decay_warmup_formula():
    assert ema_decay(0.999, 1) == pytest.approx(2 / 11)
    assert ema_decay(0.999, 90) == pytest.approx(91 / 100)
    assert ema_decay(0.9, 1000) == 0.9  # capped by decay
    assert ema_decay(0.9, 1, warmup=False) == 0.9


@pytest.mark.parametrize("warmup", [True, False])
def test_ema_equals_the_hand_computed_average_and_skips_skipped_steps(tmp_path, warmup):
    # The loss is NaN on step 3; NaNGuard skips that update: the average must not move.
    trainer = make_trainer(tmp_path, f'[dict(type="EMAHook", decay=0.8, warmup={warmup}), dict(type="NaNGuard"), '
                                     'dict(type="WeightsRecorder")]',
                           extra="model = dict(type='ToyFlakyMLP', nan_calls=[3])\n")
    trainer.train()
    history = WeightsRecorder.records
    assert [stepped for _, stepped, _ in history] == [True, True, False] + [True] * 5
    ema = hook_of(trainer, "EMAHook")
    assert ema.real_updates == 7 and int(ema.averaged.n_averaged) == 7
    assert_close_weights(ema.module.state_dict(), hand_ema(history, 0.8, warmup=warmup))
    # Including step 3 would have given another average: the skip is visible.
    unskipped = [(s, True, w) for s, _, w in history]
    differs = hand_ema(unskipped, 0.8, warmup=warmup)
    assert any(not torch.allclose(differs[k], v) for k, v in ema.module.state_dict().items())


def fake_trainer(model, stepped=True):
    return SimpleNamespace(model_without_ddp=model, evaluators=[], metrics=MetricChannel(),
                           step_result=StepResult(None, stepped, 0.1))


def test_batchnorm_statistics_are_averaged_and_counters_copied():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    hook = EMAHook(decay=0.5, warmup=False)
    hook.trainer = fake_trainer(model)
    hook.before_train()
    model.train()
    means = []
    for step in range(3):
        model(torch.randn(8, 3) + step)  # moves the running statistics
        means.append(model[1].running_mean.clone())
        hook.after_step()
    averaged_bn = hook.module[1]
    expected = 0.5 * (0.5 * means[0] + 0.5 * means[1]) + 0.5 * means[2]
    torch.testing.assert_close(averaged_bn.running_mean, expected)
    assert int(averaged_bn.num_batches_tracked) == 3  # a counter: copied, not averaged


def test_update_every_counts_real_updates_only():
    model = torch.nn.Linear(2, 1)
    hook = EMAHook(decay=0.5, warmup=False, update_every=2)
    hook.trainer = fake_trainer(model)
    hook.before_train()
    values = []
    for stepped in (True, False, True, True, False, True):
        with torch.no_grad():
            model.weight.add_(1.0)
        hook.trainer.step_result = StepResult(None, stepped, 0.1)
        hook.after_step()
        values.append(model.weight.detach().clone())
    # Real updates 1..4 happen at calls 0, 2, 3, 5; the 2nd and 4th are averaged (calls 2 and 5).
    assert hook.real_updates == 4 and int(hook.averaged.n_averaged) == 2
    torch.testing.assert_close(hook.module.weight, 0.5 * values[2] + 0.5 * values[5])


def test_options_are_checked():
    for bad in (dict(decay=1.0), dict(decay=0), dict(decay="0.9"), dict(update_every=0), dict(warmup="yes")):
        with pytest.raises(RegistryError, match=f"hook EMAHook\\({next(iter(bad))}="):
            build_hooks([dict(type="EMAHook", **bad)])


def test_fsdp_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="EMAHook does not support parallel.strategy='fsdp'"):
        make_trainer(tmp_path, '[dict(type="EMAHook")]', extra="parallel = dict(strategy='fsdp')\n")


# -- evaluation, export, checkpoints --------------------------------------------------------------
def test_ema_weights_are_evaluated_exported_and_never_the_best_model(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="InformationWriter", log_frequency=2), '
                                     'dict(type="ClsEvaluator", num_classes=2, every_n_steps=2), '
                                     'dict(type="EMAHook", decay=0.9), dict(type="CheckpointSaver", save_freq=2)]')
    trainer.train()
    rows = records(trainer.save_path)
    val_steps = [r["step"] for r in rows if "val/acc" in r]
    ema_rows = [r for r in rows if "val_ema/acc" in r]
    assert val_steps == [2, 4, 6, 8] and [r["step"] for r in ema_rows] == val_steps
    assert {"val_ema/loss", "val_ema/acc", "val_ema/mAcc"} <= set(ema_rows[-1])
    assert trainer.metrics.best.name == "val/acc"
    assert trainer.metrics.direction("val_ema/acc") == "max" and trainer.metrics.direction("val_ema/loss") == "min"

    exported = torch.load(trainer.save_path / "model" / "model_ema.pth", weights_only=True)
    last = torch.load(trainer.save_path / "model" / "model_last.pth", weights_only=True)
    assert set(exported) == set(last) == {"state_dict", "epoch", "global_step"}
    assert exported["global_step"] == last["global_step"] == 8 and exported["epoch"] == last["epoch"] == 2
    ema = hook_of(trainer, "EMAHook")
    assert_close_weights(exported["state_dict"], ema.module.state_dict())
    assert not all(torch.equal(exported["state_dict"][k], v) for k, v in last["state_dict"].items())

    # val_ema/* scored the averaged weights: the exported file gives the same loss.
    model = ToyMLP(dropout=0.1)
    model.load_state_dict(exported["state_dict"])
    evaluator = hook_of(trainer, "ClsEvaluator")
    again = evaluator.evaluate(trainer.val_loader, model)
    assert again["loss"] == pytest.approx(ema_rows[-1]["val_ema/loss"], rel=1e-6)
    trained_loss = next(r["val/loss"] for r in rows if r["step"] == 8 and "val/loss" in r)
    assert again["loss"] != pytest.approx(trained_loss, rel=1e-4)

    # The checkpoint holds the average (this hook's state), and a resume restores it.
    resumed = make_trainer(tmp_path, '[dict(type="InformationWriter", log_frequency=2), '
                                     'dict(type="ClsEvaluator", num_classes=2, every_n_steps=2), '
                                     'dict(type="EMAHook", decay=0.9), dict(type="CheckpointSaver", save_freq=2)]',
                           options=["resume=True"])
    resumed.train()  # nothing left to train: only restores
    assert_close_weights(hook_of(resumed, "EMAHook").module.state_dict(), ema.module.state_dict())
    assert hook_of(resumed, "EMAHook").real_updates == 8


@HOOKS.register_module(force=True)
class ValidationProbe(HookBase):
    """Asks for an on-demand evaluation after step ``at``; records what every
    ``after_val`` sees (this hook runs after EMAHook)."""

    seen = []

    def __init__(self, at=2):
        self.at = at

    def after_step(self):
        if self.trainer.global_step == self.at:
            self.trainer.validate(kind="on_demand")

    def after_val(self, metrics, run):
        prefixes = sorted({k.split("/")[0] for k in metrics})
        self.seen.append((self.trainer.global_step, run.prefix, run.kind, prefixes))


def test_on_demand_evaluations_also_score_the_average_and_hooks_after_it_see_the_outer_evaluation(tmp_path):
    ValidationProbe.seen.clear()
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2), dict(type="EMAHook"), '
                                     'dict(type="ValidationProbe", at=2)]', extra="epoch = 1\n")
    trainer.train()
    assert ValidationProbe.seen == [
        (2, "val_ema", "on_demand", ["val_ema"]), (2, "val", "on_demand", ["val"]),  # nested, then the outer one
        (4, "val_ema", "scheduled", ["val_ema"]), (4, "val", "scheduled", ["val"]),
    ]
    assert trainer.metrics.best.step == 4  # the on-demand evaluation never selects the best model


def test_evaluators_run_separately_have_their_average_scored_once_each(tmp_path):
    # Each evaluator's schedule calls validate([itself]): one val_ema evaluation per evaluator and step.
    trainer = make_trainer(tmp_path, '[dict(type="ClsEvaluator", num_classes=2, every_n_steps=2), '
                                     'dict(type="ScriptedEvaluator", values=[0.3], every_n_steps=4), '
                                     'dict(type="EMAHook")]', extra="epoch = 1\n")
    trainer.train()
    rows = records(trainer.save_path)
    assert [r["step"] for r in rows if "val_ema/acc" in r] == [2, 4]
    assert [(r["step"], r["val_ema/score"]) for r in rows if "val_ema/score" in r] == [(4, 0.3)]
    assert all(not ("val_ema/acc" in r and "val_ema/score" in r) for r in rows)


# -- DDP ----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_two_ranks_hold_the_same_average_and_agree_on_skipped_steps(tmp_path):
    save = tmp_path / "run"
    # Step 3's loss is NaN on rank 1 only: NaNGuard must skip it on both ranks.
    cfg = write_toy_config(tmp_path, save, """
epoch = 2
model = dict(type="ToyFlakyMLP", dropout=0.0, nan_calls=[3], rank=1)
data["train"]["noise_aug"] = 0.0
hooks = [
    dict(type="InformationWriter", log_frequency=5),
    dict(type="ClsEvaluator", num_classes=2),
    dict(type="EMAHook", decay=0.9),
    dict(type="NaNGuard", check_gradients=False),
    dict(type="CheckpointSaver", save_freq=5),
]
""")
    result = run_tool("train", cfg, num_gpus=2, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    final = sorted((save / "checkpoints").glob("step*"))[-1]
    states = [torch.load(final / f"rank{r:05d}.pth", weights_only=True)["hooks"] for r in (0, 1)]
    ema = [next(s["state"] for s in hooks if s["type"] == "EMAHook") for hooks in states]
    assert ema[0]["real_updates"] == ema[1]["real_updates"] == 19  # 20 steps, one skipped on both ranks
    for key, value in ema[0]["averaged"].items():
        assert torch.equal(value, ema[1]["averaged"][key]), key
    exported = torch.load(save / "model" / "model_ema.pth", weights_only=True)["state_dict"]
    assert all(torch.equal(v, ema[0]["averaged"]["module." + k]) for k, v in exported.items())
    assert all(torch.isfinite(v).all() for v in exported.values())
    rows = records(save)
    assert [r["train/skipped_steps"] for r in rows if "train/skipped_steps" in r] == [1]
    assert any("val_ema/acc" in r for r in rows)
