"""Upstream's GarbageHandler, LogitEntropyLogger and RuntimeProfiler on the
toy trainer, and the one-line answers for the hook names nothing builds."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.errors import RegistryError
from tests.support.inprocess import hook_of, make_trainer, records


def test_garbage_handler_collects_on_its_cadence_and_restores_automatic_collection(tmp_path, monkeypatch):
    import pimm.engines.hooks.upstream_diagnostics as module

    calls, enabled_during = [], []
    monkeypatch.setattr(module.gc, "collect", lambda *a: calls.append(1) or 0)
    trainer = make_trainer(tmp_path, '[dict(type="GarbageHandler", interval=2), dict(type="ProbeGc")]')
    assert gc.isenabled()
    trainer.train()
    # 2 epochs of 4 steps, every 2nd step of an epoch: 4 collections, and one after training.
    assert len(calls) == 5
    assert gc.isenabled()
    assert hook_of(trainer, "ProbeGc").seen == [False] * 8


class ProbeGc(HookBase):
    def __init__(self):
        self.seen = []

    def after_step(self):
        self.seen.append(gc.isenabled())


HOOKS.register_module("ProbeGc", module=ProbeGc, force=True)


def test_logit_entropy_is_the_softmax_entropy_at_the_temperature():
    hook = HOOKS.build(dict(type="LogitEntropyLogger", default_temperature=0.5, reduction="none"))
    logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    p = torch.softmax(logits / 0.5, dim=-1)
    expect = -(p * p.log()).sum(-1)
    torch.testing.assert_close(hook.entropy(logits), expect, rtol=1e-5, atol=1e-6)
    assert hook.entropy(torch.zeros(3, 4))[0].item() == pytest.approx(math.log(4), rel=1e-5)


def test_logit_entropy_logger_logs_every_step_and_the_epoch_mean(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="LogitEntropyLogger", logits_key="cls_logits", '
                                     'default_temperature=1.0, log_frequency=2)]')
    trainer.train()
    rows = records(tmp_path / "run")
    per_step = [(r["step"], r["train_batch/entropy"]) for r in rows if "train_batch/entropy" in r]
    assert [s for s, _ in per_step] == [2, 4, 6, 8]
    assert all(0.0 < v <= math.log(2) + 1e-6 for _, v in per_step)
    assert all(r["entropy/temperature"] == 1.0 for r in rows if "entropy/temperature" in r)
    epoch_means = [r["train/entropy"] for r in rows if "train/entropy" in r]
    assert epoch_means == pytest.approx([(per_step[0][1] + per_step[1][1]) / 2, (per_step[2][1] + per_step[3][1]) / 2])


def test_runtime_profiler_traces_the_first_steps_without_changing_the_run(tmp_path):
    plain = make_trainer(tmp_path / "plain", "[]")
    plain.train()
    profiled = make_trainer(tmp_path / "profiled", '[dict(type="RuntimeProfiler", warm_up=1, row_limit=5)]')
    profiled.train()
    assert hook_of(profiled, "RuntimeProfiler").done
    traces = list((tmp_path / "profiled" / "run" / "logdir").glob("*.json.gz"))
    assert traces, "no TensorBoard trace written"
    for (name, a), (_, b) in zip(plain.model_without_ddp.state_dict().items(),
                                 profiled.model_without_ddp.state_dict().items()):
        assert torch.equal(a, b), name  # the profiled run is the same run


def test_runtime_profiler_interrupt_stops_after_profiling(tmp_path):
    trainer = make_trainer(tmp_path, '[dict(type="RuntimeProfiler", warm_up=2, interrupt=True)]')
    trainer.train()
    assert trainer.global_step == 3 and trainer.outcome == "stopped"


@pytest.mark.parametrize("name, words", [("RuntimeProfilerV2", "use RuntimeProfiler"),
                                         ("PreciseEvaluator", "use SemSegEvaluator")])
def test_unregistered_upstream_hook_names_are_one_line(name, words):
    with pytest.raises(RegistryError, match=words):
        HOOKS.build(dict(type=name))


@pytest.mark.parametrize("cfg, words", [(dict(type="GarbageHandler", interval=0), "interval"),
                                        (dict(type="LogitEntropyLogger", reduction="max"), "reduction"),
                                        (dict(type="RuntimeProfiler", warm_up=-1), "warm_up")])
def test_bad_arguments_are_one_line(cfg, words):
    from pimm.utils.errors import ConfigError

    with pytest.raises(ConfigError, match=words):
        HOOKS.build(cfg)
