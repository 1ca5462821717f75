"""Upstream pimm's runtime keys, default hooks and testers, with their meanings
(docs/migration.md): each one does what it says, through the engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.datasets  # noqa: E402,F401
import pimm.evaluation  # noqa: E402,F401
import pimm.models  # noqa: E402,F401
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.utils.errors import ConfigError, RegistryError  # noqa: E402
from tests.support.run import run_tool, write_toy_config  # noqa: E402

SMALL = """
epoch = 4
data = dict(num_classes=2, names=["neg", "pos"],
            train=dict(type="ToyDataset", num_samples=64),
            val=dict(type="ToyDataset", num_samples=32, seed=1),
            test=dict(type="ToyDataset", num_samples=48, seed=2))
hooks = [dict(type="CheckpointLoader"), dict(type="InformationWriter", log_frequency=4),
         dict(type="ClsEvaluator"), dict(type="CheckpointSaver")]
"""


def make_trainer(tmp_path, extra="", options=(), mode="train"):
    cfg_path = write_toy_config(tmp_path, tmp_path / "run", SMALL + extra)
    cfg, hooks = load_config(str(cfg_path), list(options), world_size=1, mode=mode)
    return build_trainer(cfg, mode=mode, hooks=hooks)


def evaluated_steps(trainer) -> list[int]:
    rows = [json.loads(line) for line in open(trainer.save_path / "metrics.jsonl")]
    return [r["step"] for r in rows if "val/acc" in r]


def test_eval_epoch_sets_the_number_of_evaluations(tmp_path):
    trainer = make_trainer(tmp_path, "eval_epoch = 2\n")
    trainer.train()
    assert evaluated_steps(trainer) == [8, 16]  # every 4 // 2 = 2 epochs of 4 steps



@pytest.mark.parametrize("extra, options, steps", [
    ("eval_epoch = 20\n", ["epoch=2"], [4, 8]),  # upstream's `--options epoch=10` on eval_epoch=20: every epoch
    ("eval_epoch = 3\n", [], [4, 8, 12, 16]),  # 4 // 3 = 1: every epoch (at least 3 evaluations)
    ("eval_epoch = 3\n", ["epoch=7"], [8, 16, 24, 28]),  # 7 // 3 = 2 epochs, and the final weights
])
def test_eval_epoch_accepts_upstreams_configs(tmp_path, extra, options, steps):
    trainer = make_trainer(tmp_path, extra, options=options)
    trainer.train()
    assert evaluated_steps(trainer) == steps


def test_process_settings_anomaly_mode_and_model_hook(tmp_path):
    previous = torch.get_float32_matmul_precision()
    try:
        trainer = make_trainer(tmp_path, "matmul_precision = 'medium'\ndetect_anomaly = True\nepoch = 1\n"
                                         "model = dict(type='HookedToyMLP')\nhooks = hooks + [dict(type='ModelHook')]\n")
        assert torch.get_float32_matmul_precision() == "medium"
        trainer.train()
        model = trainer.model_without_ddp
        assert model.phases[0] == ("before_train", 0) and model.phases[-1] == ("after_step", 4)
        assert model.anomaly_mode is True and not torch.is_anomaly_enabled()
    finally:
        torch.set_float32_matmul_precision(previous)


def test_deterministic_turns_on_deterministic_algorithms(tmp_path):
    try:
        trainer = make_trainer(tmp_path, "deterministic = True\nepoch = 1\n")
        assert torch.are_deterministic_algorithms_enabled()
        trainer.close()
    finally:
        torch.use_deterministic_algorithms(False)


def test_empty_cache_hooks_and_prefetch_factor(tmp_path):
    trainer = make_trainer(tmp_path, "empty_cache = True\nnum_worker = 2\nprefetch_factor = 4\n")
    owners = {phase: [type(fn.__self__).__name__ for fn in fns] for phase, fns in trainer._dispatch.items()}
    assert owners["after_step"][-1] == "EmptyCache" and "EmptyCache" not in owners["after_epoch"]
    assert trainer.train_loader.prefetch_factor == 4
    trainer.close()


def test_mix_prob_needs_a_collate_that_mixes(tmp_path):
    with pytest.raises(ConfigError, match="mix_prob=0.5 needs a train collate function that mixes events"):
        make_trainer(tmp_path, "mix_prob = 0.5\n")


def test_final_evaluator_scores_the_best_model_with_the_tester(tmp_path):
    trainer = make_trainer(tmp_path, "test = dict(type='ClsTester', verbose=True)\n"
                                     "hooks = hooks + [dict(type='FinalEvaluator')]\n")
    trainer.train()
    result = json.loads((trainer.save_path / "test_metrics.json").read_text())
    assert result["weight"].endswith("model/model_best.pth")
    metrics = result["metrics"]["ClsEvaluator"]
    assert metrics["confusion"] and sum(map(sum, metrics["confusion"])) == 48  # every test sample, once


@pytest.mark.slow
def test_test_only_scores_weights_without_training(tmp_path):
    cfg = write_toy_config(tmp_path, tmp_path / "run", SMALL + "epoch = 1\n")
    assert run_tool("train", cfg).returncode == 0
    weight = tmp_path / "run" / "model" / "model_last.pth"
    before = (tmp_path / "run" / "metrics.jsonl").read_text()
    result = run_tool("train", cfg, "test_only=True", f"weight={weight}", "test={'type': 'ClsTester'}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == before  # no training happened
    assert "ClsEvaluator" in json.loads((tmp_path / "run" / "test_metrics.json").read_text())["metrics"]
    assert "Test ClsEvaluator" in (tmp_path / "run" / "test.log").read_text()


def test_upstream_hooks_pimm_does_not_ship_say_what_to_use(tmp_path):
    with pytest.raises(RegistryError, match="'RuntimeProfilerV2' is not available in pimm: upstream's configs"):
        make_trainer(tmp_path, "hooks = hooks + [dict(type='RuntimeProfilerV2')]\n")


def _recorded_seed(save_path: Path):
    from pimm.utils.config import Config
    return Config.fromfile(str(save_path / "config.py")).seed


@pytest.mark.slow
def test_seed_none_is_drawn_recorded_and_reused_on_resume(tmp_path):
    """``seed=None``: a new run draws a seed and config.py records it; a resumed
    run with ``seed=None`` reuses the recorded one (not a new draw), so the
    resumed run's random streams are the original run's."""
    cfg = write_toy_config(tmp_path, tmp_path / "run", SMALL + "seed = None\nepoch = 1\n")
    first = run_tool("train", cfg)
    assert first.returncode == 0, first.stderr
    seed = _recorded_seed(tmp_path / "run")
    assert isinstance(seed, int) and 0 <= seed < 2**31
    resumed = run_tool("train", cfg, "resume=True", "epoch=2")
    assert resumed.returncode == 0, resumed.stderr
    assert _recorded_seed(tmp_path / "run") == seed
    assert (tmp_path / "run" / "train.log").read_text().count(f"seed {seed})") == 2  # both attempts
    (tmp_path / "o").mkdir()
    other = run_tool("train", write_toy_config(tmp_path / "o", tmp_path / "other", SMALL + "seed = None\nepoch = 1\n"))
    assert other.returncode == 0, other.stderr
    assert _recorded_seed(tmp_path / "other") != seed  # a fresh draw (equal with probability 2**-31)


def test_batch_size_test_sizes_the_test_loader_only(tmp_path):
    """``batch_size_test`` (upstream's key) is the test loader's global batch
    size; validation keeps batch_size_val / batch_size."""
    trainer = make_trainer(tmp_path, options=["batch_size_test=5", "batch_size_val=8"])
    assert len(trainer.test_loader) == 10  # 48 test samples / 5, the last batch short
    assert len(trainer.val_loader) == 4  # 32 val samples / 8
