"""Upstream's pre-training hooks on small inputs: weight-decay exclusion (the
optimizer's group split and the widened max_lr), the weight-decay schedule,
run naming, and the statistics of the collapse monitors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import pimm.evaluation  # noqa: F401  (registers the evaluation hooks)
from pimm.engines.hooks.upstream_runtime import WandbNamer, WeightDecayExclusion, WeightDecayScheduler
from pimm.engines.optim import build_optimizer
from pimm.engines.optim.scheduler import build_scheduler
from pimm.evaluation.pretrain import FeatureStdMonitor, PrototypeUsageLogger, point_level_features
from pimm.utils.config import Config
from pimm.utils.errors import ConfigError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc0 = nn.ModuleDict({"block0": nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))})
        self.head = nn.Linear(4, 2)
        self.mask_token = nn.Parameter(torch.zeros(1, 4))


def test_weight_decay_exclusion_splits_each_group_at_build_time():
    cfg = Config(dict(optimizer=dict(type="AdamW", lr=0.1, weight_decay=0.04),
                      scheduler=dict(type="OneCycleLR", max_lr=[0.1, 0.05]),
                      param_dicts=[dict(keyword="enc0.block0.", lr=0.05)]))
    WeightDecayExclusion().modify_config(cfg)
    assert cfg.scheduler["max_lr"] == [0.1, 0.1, 0.05, 0.05]
    model = Tiny()
    opt = build_optimizer(cfg.optimizer, model, cfg.param_dicts)
    names = {id(p): n for n, p in model.named_parameters()}
    layout = [(g["name"], g["weight_decay"], g["lr"], sorted(names[id(p)] for p in g["params"]))
              for g in opt.param_groups]
    assert layout == [
        ("default", 0.04, 0.1, ["head.weight"]),
        ("default/no_decay", 0.0, 0.1, ["head.bias", "mask_token"]),
        ("enc0.block0.", 0.04, 0.05, ["enc0.block0.0.weight"]),
        ("enc0.block0./no_decay", 0.0, 0.05, ["enc0.block0.0.bias", "enc0.block0.1.bias", "enc0.block0.1.weight"]),
    ]
    scheduler = build_scheduler(cfg.scheduler, opt, total_steps=10)
    assert [g["max_lr"] for g in opt.param_groups] == [0.1, 0.1, 0.05, 0.05] and scheduler is not None
    only_bias = WeightDecayExclusion(exclude_norm_from_wd=False, exclude_token_from_wd=False,
                                     exclude_ndim_1_from_wd=False, exclude_gamma_from_wd=False)
    cfg = Config(dict(optimizer=dict(type="AdamW", lr=0.1, weight_decay=0.04)))
    only_bias.modify_config(cfg)
    opt = build_optimizer(cfg.optimizer, Tiny())
    assert [len(g["params"]) for g in opt.param_groups] == [4, 3]  # the three biases only
    with pytest.raises(ConfigError, match="no_weight_decay"):
        build_optimizer(dict(type="AdamW", no_weight_decay=dict(typo=True)), Tiny())


def test_weight_decay_schedule_is_upstreams_cosine():
    hook = WeightDecayScheduler(base_value=0.04, final_value=0.2, warmup_ratio=0.5)
    total = 40
    iters = np.arange(20)
    table = 0.2 + 0.5 * (0.04 - 0.2) * (1 + np.cos(np.pi * iters / 20))  # upstream's CosineScheduler, 20 steps
    np.testing.assert_allclose([hook.value(i, total) for i in range(20)], table, atol=1e-12)
    assert hook.value(20, total) == hook.value(39, total) == 0.2


def test_wandb_namer():
    cfg = Config(dict(model=dict(type="Sonata-v1m1"), data=dict(train=dict(max_len=1_000_000)), seed=0,
                      amp_dtype="bfloat16", wandb_run_name=None))
    namer = WandbNamer(keys=("model.type", "data.train.max_len", "amp_dtype", "seed", "missing.key"), extra="lin")
    namer.modify_config(cfg)
    assert cfg.wandb_run_name == "Sonata-v1m1-1M-bfloat16-0-lin"
    cfg.wandb_run_name = "mine"
    namer.modify_config(cfg)
    assert cfg.wandb_run_name == "mine"
    assert WandbNamer(keys=("n",)).name_for(dict(n=1500)) == "1.5K"


def test_wandb_namer_logs_the_name_it_chose():
    """The run's records hold the config as the hooks received it, so the
    name the hook picks is written to the log (and nothing when it picks none)."""
    from types import SimpleNamespace

    lines = []
    logger = SimpleNamespace(info=lines.append)
    cfg = Config(dict(model=dict(type="Sonata-v1m1"), seed=0, wandb_run_name=None))
    namer = WandbNamer(keys=("model.type", "seed"))
    namer.trainer = SimpleNamespace(logger=logger)
    namer.modify_config(cfg)
    namer.before_train()
    assert lines == ["WandbNamer: wandb_run_name='Sonata-v1m1-0'"]
    given = WandbNamer(keys=("seed",))
    given.trainer = SimpleNamespace(logger=logger)
    given.modify_config(Config(dict(seed=0, wandb_run_name="mine")))
    given.before_train()
    assert len(lines) == 1


def test_prototype_usage_statistics():
    logits = torch.full((6, 4), -1.0)
    logits[[0, 1, 2], 0] = 1.0
    logits[[3, 4, 5], 2] = 1.0
    stats = PrototypeUsageLogger(log_frequency=1).stats(logits)
    assert stats == pytest.approx(dict(used_count=2.0, unused_percent=50.0, tokens_per_prototype=3.0,
                                       assignment_entropy=math.log(2)), abs=1e-6)


def test_feature_std_reads_collapse():
    monitor = FeatureStdMonitor(log_frequency=1)
    healthy = monitor.stats({"feat": torch.randn(500, 8)})
    collapsed = monitor.stats({"feat": torch.ones(500, 8) * 3})
    assert healthy["global_std"] == pytest.approx(1.0, abs=0.1) and healthy["channel_min_std"] > 0.8
    assert collapsed["global_std"] == pytest.approx(0.0, abs=1e-6) and collapsed["channel_max_std"] < 1e-6
    feat = torch.randn(100, 4)
    feat[:, 1] = 0.0  # a dead channel
    assert monitor.stats({"feat": feat})["channel_min_std"] == 0.0


def test_point_level_features_concatenate_levels_onto_points():
    fine = {"feat": torch.tensor([[1.0], [2.0], [3.0]])}
    coarse = {"feat": torch.tensor([[10.0], [20.0]]), "pooling_parent": fine,
              "pooling_inverse": torch.tensor([0, 0, 1])}
    assert point_level_features(coarse).tolist() == [[1.0, 10.0], [2.0, 10.0], [3.0, 20.0]]
