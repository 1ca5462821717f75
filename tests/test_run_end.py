"""The end of a run: the summary a finished run prints (headline metric's last
and best, best checkpoint, where things are, the next commands), each
trainer's headline metric on the console line, and ``pimm test RUN_DIR``
(tools/test.py RUN_DIR), which scores a finished run's best (or last, or any)
checkpoint on its test split from the run's own config.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pimm.engines.hooks.information_writer import InformationWriter
from pimm.engines.observe.metrics import MetricChannel
from pimm.engines.loop.run_summary import headline_values
from tests.support import forkserver
from tests.support.run import ROOT, run_tool, write_toy_config
from tests.support.run import env as tool_env

TEST = ROOT / "tools" / "test.py"
TRAIN = ROOT / "tools" / "train.py"


def _test_run(*argv: str):
    import sys

    return forkserver.run([sys.executable, str(TEST), *argv], capture_output=True, text=True, env=tool_env(),
                          cwd=ROOT, timeout=300)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("finished")
    save = directory / "run"
    cfg = write_toy_config(directory, save)
    result = run_tool("train", cfg)
    assert result.returncode == 0, result.stderr[-3000:]
    return cfg, save, result.stderr


def test_a_finished_run_prints_its_summary_and_next_commands(finished_run):
    _, save, stderr = finished_run
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    losses = [(r["step"], r["train/loss"]) for r in records if isinstance(r.get("train/loss"), float)]
    best = min(losses, key=lambda pair: pair[1])
    summary = stderr[stderr.index("Run completed at step 30 (epoch 3 of 3)"):]
    assert f"train/loss: last {losses[-1][1]:.4g} (step 30), best {best[1]:.4g} (step {best[0]}; lower is better)" \
        in summary
    best_acc = max((r["val/acc"], r["step"]) for r in records if "val/acc" in r)
    assert f"best checkpoint: val/acc {best_acc[0]:.4g} at step {best_acc[1]} -> {save}/model/model_best.pth" \
        in summary
    assert f"checkpoints: {save}/checkpoints/step000000030-epoch0003 (newest of 2 kept)" in summary
    assert f"tensorboard --logdir {save}/tensorboard" in summary
    assert f"evaluate: python {TEST} {save}" in summary
    assert f"plot: pimm plot {save}" in summary
    assert f"train longer: python {TRAIN} --resume {save} --options epoch=6" in summary
    assert "Run completed" in (save / "train.log").read_text()


def test_pimm_test_run_dir_scores_the_best_checkpoint_from_the_runs_own_config(finished_run, tmp_path):
    cfg, save, _ = finished_run
    result = _test_run(str(save))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"Loaded 4/4 model tensors from {save}/model/model_best.pth" in result.stderr
    assert "Test ClsEvaluator: acc " in result.stderr
    written = json.loads((save / "test_metrics.json").read_text())
    assert written["weight"] == str(save / "model" / "model_best.pth")
    # The same numbers as the long spelling with the config and the weights named by hand.
    by_hand = tmp_path / "by_hand"
    long = _test_run("--config-file", str(cfg), "--options", f"weight={save}/model/model_best.pth",
                     f"save_path={by_hand}")
    assert long.returncode == 0, long.stderr[-3000:]
    assert json.loads((by_hand / "test_metrics.json").read_text())["metrics"] == written["metrics"]

    last = _test_run(str(save), "--checkpoint", "last")
    assert last.returncode == 0, last.stderr[-3000:]
    assert json.loads((save / "test_metrics.json").read_text())["weight"] == str(save / "model" / "model_last.pth")
    assert len(list(save.glob("test_metrics*.json"))) == 2  # the best's results were kept aside, not replaced
    folder = save / "checkpoints" / "step000000030-epoch0003"
    from_folder = _test_run(str(save), "--checkpoint", str(folder))
    assert from_folder.returncode == 0, from_folder.stderr[-3000:]
    got = json.loads((save / "test_metrics.json").read_text())["metrics"]
    assert got == json.loads(next(p for p in sorted(save.glob("test_metrics*.json"))
                                  if json.loads(p.read_text())["weight"].endswith("model_last.pth")).read_text()
                             )["metrics"]  # step 30's checkpoint holds the last weights


@pytest.mark.parametrize("argv, message", [
    (["{missing}"], "the directory does not exist"),
    (["{save}", "--checkpoint", "{missing}"], "no such file or folder"),
    (["{save}", "--config-file", "x.py"], "not both"),
    (["--checkpoint", "best"], "give the run directory too"),
])
def test_pimm_test_run_dir_bad_input_is_one_line(finished_run, tmp_path, argv, message):
    _, save, _ = finished_run
    argv = [a.format(save=save, missing=tmp_path / "missing") for a in argv]
    result = _test_run(*argv)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_run_without_an_evaluator_has_no_best_checkpoint_to_test(tmp_path):
    save = tmp_path / "run"
    cfg = write_toy_config(tmp_path, save, 'epoch = 1\nhooks = [dict(type="CheckpointSaver")]\n')
    assert run_tool("train", cfg).returncode == 0
    result = _test_run(str(save))
    assert result.returncode == 2
    assert "has no model/model_best.pth" in result.stderr and "--checkpoint last" in result.stderr


def test_headline_values_are_the_last_and_best_finite_values(tmp_path):
    lines = [{"step": 1, "train/reward_mean": 0.1}, {"step": 2, "train/reward_mean": None},
             {"step": 3, "train/reward_mean": 0.7}, {"step": 4, "val/acc": 1.0}, {"step": 5, "train/reward_mean": 0.4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "tr')
    assert headline_values(tmp_path, "train/reward_mean", "max") == {"last": (5, 0.4), "best": (3, 0.7)}
    assert headline_values(tmp_path, "train/reward_mean", "min")["best"] == (1, 0.1)
    assert headline_values(tmp_path, "val/stat_gap", "min") is None


def _console_line(headline, published: dict, latest: dict | None = None) -> str:
    """The InformationWriter's line for one step of ``published`` scalars, with
    no room for extras: only the head (loss, headline, lr) and the timings fit."""
    metrics = MetricChannel()
    for name, value in (latest or {}).items():
        metrics.record(name, value)
    metrics.publish({k: torch.tensor(v) for k, v in published.items()}, dense=True, step=1)
    lines = []
    trainer = SimpleNamespace(metrics=metrics, epoch=0, max_epoch=1, iter=1, iters_per_epoch=1, global_step=1,
                              headline_metric=headline, logger=SimpleNamespace(info=lines.append), comm_info={})
    writer = InformationWriter(log_frequency=1, max_extras=0)
    writer.trainer = trainer
    writer._flush_and_log()
    return lines[0]


def test_each_trainer_shows_its_headline_metric_on_the_console_line():
    from pimm.engines.trainers.gan import GANTrainer
    from pimm.engines.trainers.grpo import GRPOTrainer

    scalars = {"train/loss": 0.5, "train/lr": 0.01, "train/kl": 0.2, "train/reward_mean": 0.75}
    line = _console_line(GRPOTrainer.headline_metric, scalars)
    assert "loss 0.5000 reward_mean 0.75 lr" in line and "kl" not in line  # extras are cut, the headline is not
    line = _console_line(GANTrainer.headline_metric, {"train/loss": 0.5}, latest={"val/stat_gap": 0.125})
    assert "loss 0.5000 val/stat_gap 0.125" in line
