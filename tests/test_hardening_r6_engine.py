"""Issue 45 (hardening 6), the engine's share: TensorBoard histograms, values
hooks hand the writer and ``comm_info`` that are not numbers, the trainer's
reserved ``train/loss``, the first error of a failed run, upstream's hook
arguments (``DtypeOverrider``, ``InformationWriter``,
``ResourceUtilizationLogger``), ``SemSegEvaluator``'s published metric, one
progress bar, the end-of-run summary's ``evaluate:`` line,
``$PIMM_SIMULATE_CRASH_STEP`` and a ``PushToHub`` checkpoint typo."""

from __future__ import annotations

import logging
import struct
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from pimm.engines.hooks.base import EvalRun, HookBase
from pimm.engines.loop.hook_contract import CommInfo, take_published_metric
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.observe.writers import MetricsWriter
from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError, UserError
from tests.support import fake_wandb
from tests.support.inprocess import hook_of, make_trainer, records

LOG_EVERY_STEP = "default_hooks = dict(information_writer=dict(log_frequency=1))\n"


def _events(logdir: Path):
    from tensorboardX.proto.event_pb2 import Event

    out = []
    for path in sorted(logdir.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            out.append(Event.FromString(data[at + 12:at + 12 + length]))
            at += 12 + length + 4
    return out


class _Caller(HookBase):
    """A hook that makes one call on the trainer when asked (for the error lines)."""

    origin = "hooks[3]"

    def __init__(self, call):
        self.call = call

    def after_step(self):
        self.call(self.trainer)


def _writer(tmp_path) -> MetricsWriter:
    writer = MetricsWriter(tmp_path / "run", enable_tensorboard=True)
    writer.channel = MetricChannel(sink=writer.write)
    return writer


# ----------------------------------------------------------------------------- 1. add_histogram


def test_add_histogram_with_tensorboard_on_writes_a_histogram_event(tmp_path):
    writer = _writer(tmp_path)
    values = torch.linspace(-2.0, 3.0, 101)
    writer.add_histogram("weights/head", values, 7)  # upstream's call: TensorBoard's default bins="tensorflow"
    writer.add_histogram("weights/auto", np.arange(10.0), 8, bins="auto")
    writer.close()
    histos = {v.tag: (e.step, v.histo) for e in _events(tmp_path / "run" / "tensorboard")
              for v in e.summary.value if v.HasField("histo")}
    step, histo = histos["weights/head"]
    assert step == 7 and histo.num == 101 and sum(histo.bucket) == 101
    assert histo.min == pytest.approx(-2.0) and histo.max == pytest.approx(3.0)
    assert histo.sum == pytest.approx(float(values.sum()), abs=1e-4)
    assert histos["weights/auto"][0] == 8 and sum(histos["weights/auto"][1].bucket) == 10


def test_add_histogram_leaves_out_non_finite_values_and_refuses_what_is_not_numbers(tmp_path):
    writer = _writer(tmp_path)
    writer.add_histogram("h", torch.tensor([1.0, float("nan"), 2.0]), 1)
    writer.add_histogram("all_nan", torch.tensor([float("nan")]), 2)  # nothing to draw: no event
    hook = _Caller(lambda trainer: trainer.writer.add_histogram("bad", ["a", "b"], 3))
    hook.trainer = SimpleNamespace(writer=writer)
    with pytest.raises(UserError, match=r"^_Caller \(hooks\[3\]\): trainer.writer.add_histogram\('bad', ...\)"):
        hook.after_step()
    writer.close()
    histos = {v.tag: v.histo for e in _events(tmp_path / "run" / "tensorboard") for v in e.summary.value
              if v.HasField("histo")}
    assert set(histos) == {"h"} and histos["h"].num == 2


# ----------------------------------------------------------------------------- 2. values that are not numbers


@pytest.mark.parametrize("call, culprit", [
    (lambda t: t.writer.add_scalar("my/value", "0.5", 3),
     r"trainer.writer.add_scalar\('my/value', ...\) got '0.5'"),
    (lambda t: t.writer.add_scalar("my/value", torch.ones(3), 3),
     r"trainer.writer.add_scalar\('my/value', ...\) got .* of shape"),
    (lambda t: t.writer.add_scalars("my", {"a": 1.0, "b": None}, 3),
     r"trainer.writer.add_scalar\('my/b', ...\) got None"),
    (lambda t: t.writer.add_image("my/img", "a picture", 3),
     r"trainer.writer.add_image\('my/img', ...\) got 'a picture'"),
    (lambda t: t.writer.add_image("my/img", np.zeros((5, 4, 4)), 3),
     r"trainer.writer.add_image\('my/img', ...\).*shape \(5, 4"),
    (lambda t: t.comm_info.__setitem__("current_metric_value", "0.9"),
     r"trainer.comm_info\['current_metric_value'\] = ... got '0.9'"),
    (lambda t: t.comm_info.__setitem__("current_metric_greater_is_better", "False"),
     r"trainer.comm_info\['current_metric_greater_is_better'\] = ... got 'False' \(a str\); it takes True or False"),
    (lambda t: t.comm_info.__setitem__("current_metric_name", 3), r"trainer.comm_info\['current_metric_name'\]"),
    (lambda t: setattr(t, "best_metric_value", "high"), r"trainer.best_metric_value = ... got 'high'"),
])
def test_a_value_a_hook_hands_over_that_is_not_a_number_is_one_line_naming_the_tag_and_the_hook(
        tmp_path, call, culprit):
    from pimm.engines.loop.hook_contract import UpstreamTrainerView

    class Trainer(UpstreamTrainerView):
        global_step = 3

    trainer = Trainer()
    trainer.metrics = MetricChannel()
    trainer.writer, trainer.comm_info = _writer(tmp_path), CommInfo()
    hook = _Caller(call)
    hook.trainer = trainer
    with pytest.raises(UserError, match=r"^_Caller \(hooks\[3\]\): " + culprit) as raised:
        hook.after_step()
    assert "\n" not in str(raised.value)
    trainer.writer.close()


def test_the_values_upstream_hooks_hand_over_still_go_through(tmp_path):
    writer = _writer(tmp_path)
    writer.add_scalar("a", torch.tensor(0.5), 1)
    writer.add_scalar("b", np.float32(0.25), 1)
    writer.add_scalar("c", np.array([2]), 1)
    writer.add_image("img", torch.rand(3, 4, 5), 1)
    writer.add_image("gray", np.ones((4, 5)), 1, dataformats="HW")
    info = CommInfo()
    info["current_metric_value"], info["current_metric_greater_is_better"] = torch.tensor(0.75), np.bool_(False)
    writer.channel.flush()
    writer.close()
    assert {k: v for r in records(tmp_path / "run") for k, v in r.items()} == {"step": 1, "epoch": 0, "a": 0.5,
                                                                                "b": 0.25, "c": 2.0}
    assert {v.tag for e in _events(tmp_path / "run" / "tensorboard") for v in e.summary.value
            if v.HasField("image")} == {"img", "gray"}


# ----------------------------------------------------------------------------- 3. the trainer's train/loss


@HOOKS.register_module(force=True)
class R6LossMirror(HookBase):
    """Upstream's InformationWriter habit: the epoch's mean loss as ``train/loss``."""

    def __init__(self, dense: bool = False):
        self.dense = dense

    def after_epoch(self):
        if self.dense:
            self.trainer.metrics.publish({"train/loss": 123.0}, dense=True)
        else:
            self.trainer.writer.add_scalar("train/loss", 123.0, self.trainer.global_step)


@pytest.mark.parametrize("dense", [False, True])
def test_a_hook_publishing_the_trainers_own_loss_is_refused_naming_it(tmp_path, dense):
    trainer = make_trainer(tmp_path, f"[dict(type='R6LossMirror', dense={dense})]", epoch=1)
    with pytest.raises(UserError, match=r"^R6LossMirror \(hooks\[0\]\): publishes 'train/loss' \(at step 4\), "
                                        r"which is DefaultTrainer's own per-step series"):
        trainer.train()
    assert all(r["train/loss"] != 123.0 for r in records(tmp_path / "run") if "train/loss" in r)


def test_the_trainer_publishes_its_reserved_loss_every_step_and_other_tags_stay_open(tmp_path):
    channel = MetricChannel()
    channel.reserve("train/loss", "the trainer's own per-step series")
    for step in (1, 2, 3):
        channel.publish({"train/loss": 0.5, "train/lr": 0.1}, dense=True, step=step)
    channel.publish({"train/epoch_loss": 0.5})
    with pytest.raises(UserError, match="publishes 'train/loss' \\(at step 3\\)"):
        channel.publish({"train/loss": 0.4}, dense=True, step=3)  # a second value at a step the trainer wrote


# ----------------------------------------------------------------------------- 4. the first error is reported


@HOOKS.register_module(force=True)
class R6BreakAtStep(HookBase):
    def after_step(self):
        if self.trainer.global_step == 2:
            raise RuntimeError("the real failure at step 2")


@HOOKS.register_module(force=True)
class R6BrokenCleanup(HookBase):
    closed = []

    def on_exception(self, exc):
        raise ValueError("on_exception broke too")

    def after_train(self):
        self.closed.append("tried")
        raise KeyError("history_of_a_key_never_put")


@HOOKS.register_module(force=True)
class R6Cleanup(HookBase):
    closed = []

    def after_train(self):
        self.closed.append(self.trainer.outcome)


def test_a_failed_runs_first_error_is_the_one_raised_when_cleanup_hooks_fail_too(tmp_path, caplog):
    R6BrokenCleanup.closed.clear()
    R6Cleanup.closed.clear()
    trainer = make_trainer(tmp_path, "[dict(type='R6BreakAtStep'), dict(type='R6BrokenCleanup'), "
                                     "dict(type='R6Cleanup')]", epoch=1)
    with caplog.at_level(logging.WARNING, logger="pimm"), \
            pytest.raises(RuntimeError, match="the real failure at step 2"):
        trainer.train()
    assert trainer.outcome == "failed"
    assert R6BrokenCleanup.closed == ["tried"] and R6Cleanup.closed == ["failed"]  # every after_train ran
    later = [r for r in caplog.records if "failed too" in r.getMessage()]
    assert [(r.levelname, r.getMessage().split(":")[0], r.exc_info is not None) for r in later] == [
        ("WARNING", "R6BrokenCleanup.on_exception failed too, after the run failed", False),
        ("ERROR", "R6BrokenCleanup.on_exception failed too, after the run failed", True),  # train.log only
        ("WARNING", "R6BrokenCleanup.after_train failed too, after the run failed", False),
        ("ERROR", "R6BrokenCleanup.after_train failed too, after the run failed", True)]
    assert "KeyError: 'history_of_a_key_never_put'" in later[2].getMessage()


def test_an_after_train_failure_of_a_run_that_trained_still_fails_it(tmp_path):
    trainer = make_trainer(tmp_path, "[dict(type='R6BrokenCleanup')]", epoch=1)
    with pytest.raises(KeyError, match="history_of_a_key_never_put"):
        trainer.train()


# ----------------------------------------------------------------------------- 5. upstream's hook arguments


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.proj(x))


def _model() -> nn.Module:
    return nn.Sequential(_Block(), _Block())


def _pin(model, caplog, **options):
    from pimm.engines.hooks import DtypeOverrider

    hook = DtypeOverrider(dtype="float64", **options)
    hook.trainer = SimpleNamespace(model_without_ddp=model, logger=logging.getLogger("pimm"), global_step=0)
    with caplog.at_level(logging.INFO, logger="pimm"):
        hook.before_train()
    return hook


def test_dtype_overrider_patterns_match_dotted_module_names_and_alone_leave_class_names_out(caplog):
    model = _model()
    hook = _pin(model, caplog, patterns=[r"^1\.proj$"])
    assert model[1].proj.weight.dtype == torch.float64 and model[0].proj.weight.dtype == torch.float32
    assert model[0].norm.weight.dtype == torch.float32  # patterns alone: no LayerNorm by class (upstream's)
    assert model[1].proj(torch.ones(2, 4)).dtype == torch.float64 and hook.wrapped == 1
    both = _model()
    _pin(both, caplog, patterns=[r"^0\.proj$"], class_patterns=["LayerNorm"])
    assert [m.weight.dtype for m in (both[0].proj, both[0].norm, both[1].proj, both[1].norm)] == \
        [torch.float64, torch.float64, torch.float32, torch.float64]
    default = _model()
    _pin(default, caplog)  # neither: pimm's default, LayerNorm by class
    assert default[0].norm.weight.dtype == torch.float64 and default[0].proj.weight.dtype == torch.float32


def test_dtype_overrider_verbose_names_each_wrap_and_cast(caplog):
    _pin(_model(), caplog, class_patterns="LayerNorm", verbose=True)
    text = caplog.text
    assert "DtypeOverrider: 0.norm.weight torch.float32 -> torch.float64" in text
    assert "DtypeOverrider: 1.norm.forward (LayerNorm) runs in torch.float64" in text
    caplog.clear()
    _pin(_model(), caplog, class_patterns="LayerNorm")
    assert "0.norm.weight" not in caplog.text and "2 module(s) run in torch.float64" in caplog.text


def test_dtype_overrider_check_interval_reports_a_pin_undone_later_once(caplog):
    model = _model()
    hook = _pin(model, caplog, class_patterns="LayerNorm", check_interval=3)
    model[1].norm.to(torch.float16)  # something casts the model after before_train
    with caplog.at_level(logging.WARNING, logger="pimm"):
        for step in range(1, 10):
            hook.trainer.global_step = step
            hook.after_step()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["DtypeOverrider: 1.norm.weight is torch.float16 at step 3, no longer torch.float64: "
                        "something cast the model after before_train, undoing the pin",
                        "DtypeOverrider: 1.norm.bias is torch.float16 at step 3, no longer torch.float64: "
                        "something cast the model after before_train, undoing the pin"]


@pytest.fixture
def wandb_stand_in(monkeypatch):
    fake_wandb.reset()
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    return fake_wandb


def test_upstreams_hook_arguments_train_with_upstreams_meaning(tmp_path, wandb_stand_in, caplog):
    hooks = ("[dict(type='DtypeOverrider', patterns=['net\\\\.0'], verbose=True, check_interval=2), "
             "dict(type='ResourceUtilizationLogger', log_frequency=2, per_process=True), "
             "dict(type='ResourceUtilizationLogger', log_frequency=2, prefix='machine', per_process=False)]")
    extra = "use_wandb = True\ndefault_hooks = dict(information_writer=dict(log_frequency=1, step_offset=100))\n"
    trainer = make_trainer(tmp_path, hooks, extra=extra, epoch=1)
    assert trainer.cfg.log_step_offset == 100
    with caplog.at_level(logging.INFO, logger="pimm"):
        trainer.train()
    # InformationWriter(step_offset): W&B's x-axis continues at 100; metrics.jsonl keeps the run's steps.
    run = wandb_stand_in.runs[-1]
    assert [step for step, _ in wandb_stand_in.history(run.id, "train/loss")] == [101, 102, 103, 104]
    assert [r["step"] for r in records(tmp_path / "run") if "train/loss" in r] == [1, 2, 3, 4]
    # DtypeOverrider(patterns=...): the module named net.0 only, each wrap named (verbose).
    log = caplog.text
    assert "DtypeOverrider: net.0.forward (Linear) runs in torch.float32" in log
    assert "DtypeOverrider: 1 module(s) run in torch.float32" in log
    # ResourceUtilizationLogger(per_process): this process only, or the machine's too.
    logged = set().union(*(r.keys() for r in records(tmp_path / "run")))
    assert {"resources/cpu_percent", "resources/process_rss_gb"} <= logged
    assert not {k for k in logged if k.startswith("resources/") and ("system" in k or "load" in k)}
    assert {"machine/system_memory_percent", "machine/cpu_count", "machine/load_per_cpu"} <= logged


def test_information_writer_step_offset_contradicting_log_step_offset_is_refused(tmp_path):
    extra = "log_step_offset = 5\ndefault_hooks = dict(information_writer=dict(step_offset=100))\n"
    with pytest.raises(ConfigError, match=r"InformationWriter\(step_offset=100\) contradicts log_step_offset=5"):
        make_trainer(tmp_path, "[]", extra=extra, epoch=1)


def test_semseg_evaluator_publishes_its_metric_in_comm_info_as_upstreams_does():
    from pimm.evaluation.semseg import SemSegEvaluator

    evaluator = SemSegEvaluator(num_classes=2)
    evaluator.trainer = SimpleNamespace(comm_info=CommInfo())
    for run in (EvalRun("on_demand", "val", 3, evaluators=(evaluator,)),
                EvalRun("scheduled", "val_ema", 3, evaluators=(evaluator,), weights="ema"),
                EvalRun("scheduled", "val", 3, evaluators=())):
        evaluator.after_val({f"{run.prefix}/mIoU": 0.4}, run)
    assert "current_metric_value" not in evaluator.trainer.comm_info
    evaluator.after_val({"val/mIoU": 0.625, "val/mAcc": 0.7}, EvalRun("scheduled", "val", 3,
                                                                        evaluators=(evaluator,)))
    assert dict(evaluator.trainer.comm_info) == {"current_metric_value": 0.625, "current_metric_name": "mIoU",
                                                 "current_metric_greater_is_better": True}


def test_semsegs_published_metric_does_not_contest_the_metric_that_selects_model_best(caplog):
    channel = MetricChannel()
    channel.declare("val/acc", "max")
    channel.track_best("val/acc")
    channel.declare("val/mIoU", "max")
    channel.publish({"val/acc": 0.9, "val/mIoU": 0.5})
    trainer = SimpleNamespace(comm_info=CommInfo(current_metric_value=0.5, current_metric_name="mIoU",
                                                 current_metric_greater_is_better=True),
                              metrics=channel, logger=logging.getLogger("pimm"), global_step=4)
    with caplog.at_level(logging.WARNING, logger="pimm"):
        assert take_published_metric(trainer) is False
    assert not caplog.records and "current_metric_value" not in trainer.comm_info


# ----------------------------------------------------------------------------- 6. one progress bar


def test_a_default_given_another_services_type_replaces_that_service(tmp_path):
    from pimm.engines.run.launch import load_config
    from tests.support.run import write_toy_config

    path = write_toy_config(tmp_path, tmp_path / "run")
    cfg, hooks = load_config(str(path), ["default_hooks.information_writer=dict(type='ProgressBar', force=True)"],
                             world_size=1, check_save_path=False)
    bars = [(h.origin, h.force) for h in hooks if type(h).__name__ == "ProgressBar"]
    assert bars == [("default_hooks.information_writer", True)]
    with pytest.raises(ConfigError, match=r"default_hooks.information_writer and default_hooks.progress_bar are "
                                          r"both ProgressBar hooks"):
        load_config(str(path), ["default_hooks.information_writer=dict(type='ProgressBar')",
                                "default_hooks.progress_bar.force=True"], world_size=1, check_save_path=False)


# ----------------------------------------------------------------------------- 7. the summary's evaluate line


def _summary(trainer) -> list[str]:
    from pimm.engines.loop.run_summary import end_of_run_summary

    return end_of_run_summary(trainer, 1.0)


def test_the_summary_evaluates_weights_that_exist(tmp_path):
    trainer = make_trainer(tmp_path / "plain", "[]", epoch=1)  # no evaluator: no model_best.pth
    trainer.train()
    run = tmp_path / "plain" / "run"
    assert not (run / "model" / "model_best.pth").exists()
    evaluate = [line for line in _summary(trainer) if line.startswith("  evaluate:")]
    assert evaluate == [f"  evaluate: pimm test {run.resolve()} --checkpoint last"]
    ranked = make_trainer(tmp_path / "ranked", "[dict(type='ClsEvaluator', num_classes=2)]", epoch=1)
    ranked.train()
    assert [line for line in _summary(ranked) if line.startswith("  evaluate:")] == \
        [f"  evaluate: pimm test {(tmp_path / 'ranked' / 'run').resolve()}"]


# ----------------------------------------------------------------------------- 8. the crash drill's step


@pytest.mark.parametrize("raw", ["-1", "0", "eight", ""])
def test_a_crash_step_that_is_not_a_positive_count_is_refused_when_the_hook_is_built(tmp_path, monkeypatch, raw):
    monkeypatch.setenv("PIMM_SIMULATE_CRASH_STEP", raw)
    with pytest.raises(ConfigError, match=rf"SimulateCrash: \$PIMM_SIMULATE_CRASH_STEP={raw!r} must be a positive "
                                          "number of steps"):
        make_trainer(tmp_path, "[dict(type='SimulateCrash')]", epoch=1)


def test_a_positive_crash_step_is_taken(tmp_path, monkeypatch):
    monkeypatch.setenv("PIMM_SIMULATE_CRASH_STEP", "3")
    assert hook_of(make_trainer(tmp_path, "[dict(type='SimulateCrash')]", epoch=1), "SimulateCrash").step == 3


# ----------------------------------------------------------------------------- 9. PushToHub's checkpoint


@pytest.fixture
def hub_module(monkeypatch):
    module = types.ModuleType("huggingface_hub")
    module.HfApi = object
    monkeypatch.setitem(sys.modules, "huggingface_hub", module)


def test_a_push_to_hub_checkpoint_typo_is_refused_before_training(tmp_path, hub_module):
    with pytest.raises(ConfigError, match=r"PushToHub: checkpoint='model_bset' names nothing this run writes "
                                          r"\(did you mean 'model_best'\? it takes 'model_best', 'model_last', "
                                          r"'last', a file already under"):
        make_trainer(tmp_path, "[dict(type='PushToHub', repo_id='org/toy', checkpoint='model_bset')]", epoch=1)


@pytest.mark.parametrize("checkpoint", ["model_best", "model_best.pth", "last", "model_last", "model_ema",
                                        "mine.pth", "mine", "ABSOLUTE"])
def test_push_to_hub_takes_what_the_run_writes_or_holds(tmp_path, hub_module, checkpoint):
    from pimm.evaluation.push_to_hub import PushToHub

    (tmp_path / "run" / "model").mkdir(parents=True)
    (tmp_path / "run" / "model" / "mine.pth").write_bytes(b"weights")
    (tmp_path / "elsewhere.pth").write_bytes(b"weights")
    checkpoint = str(tmp_path / "elsewhere.pth") if checkpoint == "ABSOLUTE" else checkpoint
    cfg = dict(save_path=str(tmp_path / "run"), hooks=[dict(type="EMAHook")])
    PushToHub(repo_id="org/toy", checkpoint=checkpoint).check_checkpoint(cfg)
    with pytest.raises(ConfigError, match="'model_ema'"):  # no EMAHook: no model_ema.pth
        PushToHub(repo_id="org/toy", checkpoint="model_ema").check_checkpoint(dict(save_path=str(tmp_path / "x")))
