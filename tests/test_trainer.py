"""The trainer end to end: the run directory SPEC promises, test.py, gradient
accumulation, clipping, AMP, W&B, the progress bar and failure handling.

One real ``tools/train.py`` run of the toy config (3 epochs x 10 steps) is
shared by the layout tests; the numeric features run in-process on a smaller
data set, where the trainer's state can be inspected directly.
"""

from __future__ import annotations

import json
import struct
import sys
import math
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.datasets, pimm.evaluation, pimm.models  # noqa: E402,F401,E401  (registers data sets, evaluators, models)
from pimm.engines import HOOKS, HookBase  # noqa: E402
from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.run.runtime import apply_runtime_defaults  # noqa: E402
from pimm.utils.config import Config  # noqa: E402
from tests.support.run import final_weights, non_log_lines, run_tool, train_losses, write_toy_config  # noqa: E402
from tests.support.toy import ToyMLP  # noqa: E402

EPOCHS, STEPS_PER_EPOCH = 3, 10  # the toy config: 160 samples, batch 16
TQDM_MARKERS = ("%|", "it/s]", "s/it]")

WITH_PROGRESS_BAR = """
hooks = hooks + [dict(type="ProgressBar")]
"""


# ----------------------------------------------------------------------------- helpers


def read_metrics(save_path: Path) -> tuple[list[str], list[dict]]:
    lines = (save_path / "metrics.jsonl").read_text().splitlines()
    return lines, [json.loads(line) for line in lines]


def read_tensorboard_scalars(directory: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` from every event file under ``directory``.

    Event files are TFRecord streams (u64 length, u32 crc, payload, u32 crc)
    of ``Event`` protos; tensorboardX ships the proto classes, so no
    TensorFlow or tensorboard install is needed to read them back."""
    from tensorboardX.proto.event_pb2 import Event

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset + 12 <= len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            payload = data[offset + 12: offset + 12 + length]
            offset += 12 + length + 4
            event = Event.FromString(payload)
            for value in event.summary.value:
                if not value.HasField("simple_value") and not value.tensor.float_val:
                    continue  # not a scalar (the text of a failure, an image)
                number = value.simple_value if value.HasField("simple_value") else value.tensor.float_val[0]
                scalars.setdefault(value.tag, {})[event.step] = number
    return scalars


def assert_single_error_line(stderr: str, prefix: str) -> str:
    # the log lines before the error are on stderr too (logs go to stderr, like Python's logging)
    lines = non_log_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(prefix), stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """One real training run through tools/train.py, shared by the layout tests."""
    root = tmp_path_factory.mktemp("toy_run")
    save_path = root / "run"
    cfg_path = write_toy_config(root, save_path, WITH_PROGRESS_BAR)
    result = run_tool("train", cfg_path)
    assert result.returncode == 0, result.stderr[-3000:]
    return cfg_path, save_path, result


# ----------------------------------------------------------------------------- the run directory


def test_config_py_loads_back_to_the_resolved_config(toy_run):
    cfg_path, save_path, _ = toy_run
    original = Config.fromfile(cfg_path)
    apply_runtime_defaults(original)
    saved = Config.fromfile(save_path / "config.py")
    assert saved == original
    assert saved.save_path == str(save_path) and saved.seed == 0 and saved.epoch == EPOCHS


def test_config_py_retrains_to_identical_weights(toy_run, tmp_path):
    _, save_path, _ = toy_run
    rerun = tmp_path / "rerun"
    result = run_tool("train", save_path / "config.py", f"save_path={rerun}")
    assert result.returncode == 0, result.stderr[-3000:]
    first, second = final_weights(save_path), final_weights(rerun)
    assert first["state_dict"].keys() == second["state_dict"].keys()
    for key, tensor in first["state_dict"].items():
        assert torch.equal(tensor, second["state_dict"][key]), key
    assert train_losses(save_path) == train_losses(rerun)


def test_train_log_and_no_progress_bar_in_files_or_output(toy_run):
    _, save_path, result = toy_run
    log = (save_path / "train.log").read_text()
    assert "Train: [1/3]" in log and f"step {EPOCHS * STEPS_PER_EPOCH}" in log and "Eval at step 10" in log
    assert "Traceback" not in log
    # ProgressBar is in the hooks, but neither a log file nor a pipe is a terminal.
    for text in (log, result.stdout, result.stderr):
        assert not any(marker in text for marker in TQDM_MARKERS), text[-2000:]


def test_metrics_jsonl_records_every_step_once(toy_run):
    _, save_path, _ = toy_run
    lines, records = read_metrics(save_path)
    assert all("step" in r and "epoch" in r for r in records)
    loss_records = [r for r in records if "train/loss" in r]
    total = EPOCHS * STEPS_PER_EPOCH
    assert [r["step"] for r in loss_records] == list(range(1, total + 1))  # each step exactly once, in order
    for r in loss_records:
        assert r["epoch"] == (r["step"] - 1) // STEPS_PER_EPOCH + 1
        assert isinstance(r["train/loss"], float) and isinstance(r["train/lr"], float)
    # The lr each step used, under cosine with warm-up: a short rise to 0.01, then decay towards 0.
    lrs = [r["train/lr"] for r in loss_records]
    peak = lrs.index(max(lrs))
    assert max(lrs) == pytest.approx(0.01, rel=0.05) and 0 < peak <= 4 and lrs[0] < max(lrs)
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1:])) and lrs[-1] < 0.05 * max(lrs)
    val = [r for r in records if "val/acc" in r]
    assert [(r["step"], r["epoch"]) for r in val] == [(10, 1), (20, 2), (30, 3)]
    assert all(0.0 <= r["val/acc"] <= 1.0 and "val/loss" in r for r in val)
    # Full precision: each line is exactly what json (float repr) writes back.
    assert all(json.dumps(r) == line for r, line in zip(records, lines))
    assert any(len(repr(r["train/loss"])) > 10 for r in loss_records)  # not rounded for display


def test_tensorboard_holds_the_same_scalars(toy_run):
    _, save_path, _ = toy_run
    event_files = list((save_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1 and event_files[0].stat().st_size > 0
    scalars = read_tensorboard_scalars(save_path / "tensorboard")
    assert {"train/loss", "train/lr", "val/acc", "val/loss"} <= scalars.keys()
    _, records = read_metrics(save_path)
    val = {r["step"]: r["val/acc"] for r in records if "val/acc" in r}
    assert scalars["val/acc"] == pytest.approx(val, rel=1e-6)  # float32 in TensorBoard
    # The per-step training loss reaches the dashboard condensed: each event is
    # the mean of the metrics.jsonl losses since the previous event, at the
    # window's last step; together the windows cover every step.
    losses = dict(train_losses(save_path))
    tb_steps = sorted(scalars["train/loss"])
    assert set(tb_steps) <= set(losses) and tb_steps[-1] == EPOCHS * STEPS_PER_EPOCH
    assert {10, 20} <= set(tb_steps)  # an epoch end closes a window
    previous = 0
    for step in tb_steps:
        window = [losses[s] for s in range(previous + 1, step + 1)]
        assert scalars["train/loss"][step] == pytest.approx(sum(window) / len(window), rel=1e-6), step
        previous = step


def test_model_files_load_with_weights_only(toy_run):
    _, save_path, _ = toy_run
    _, records = read_metrics(save_path)
    last = torch.load(save_path / "model" / "model_last.pth", weights_only=True)
    best = torch.load(save_path / "model" / "model_best.pth", weights_only=True)
    reference = ToyMLP(dropout=0.1).state_dict()
    for payload in (last, best):
        assert {"state_dict", "epoch", "global_step"} <= payload.keys()
        assert list(payload["state_dict"]) == list(reference)  # no "module." prefix
        ToyMLP().load_state_dict(payload["state_dict"])  # strict load works
    assert (last["epoch"], last["global_step"]) == (EPOCHS, EPOCHS * STEPS_PER_EPOCH)
    # The best metric is the float logged to metrics.jsonl, read back bit for bit.
    val = [r for r in records if "val/acc" in r]
    best_acc = max(r["val/acc"] for r in val)
    assert best["metric"] == best_acc
    assert best["global_step"] == next(r["step"] for r in val if r["val/acc"] == best_acc)
    assert best["epoch"] == best["global_step"] // STEPS_PER_EPOCH


def test_test_tool_writes_test_metrics_matching_the_last_validation(toy_run, tmp_path):
    _, save_path, _ = toy_run
    # Evaluate model_last on the validation split: the numbers must equal the
    # last val/* values in metrics.jsonl exactly (same weights, data and code).
    out = tmp_path / "eval"
    result = run_tool("test", save_path / "config.py", f"weight={save_path / 'model' / 'model_last.pth'}",
                      f"save_path={out}", "data.test.seed=1")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((out / "test_metrics.json").read_text())
    metrics = report["metrics"]["ClsEvaluator"]
    assert report["weight"].endswith("model_last.pth")
    _, records = read_metrics(save_path)
    last_val = [r for r in records if "val/acc" in r][-1]
    assert metrics["acc"] == last_val["val/acc"]
    assert metrics["loss"] == last_val["val/loss"]  # a float64 mean: survives only with full precision
    assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- numerics (in-process)

SMALL = """
epoch = 2
model = dict(type="ToyMLP", dropout=0.0)
data = dict(
    train=dict(type="ToyDataset", num_samples=64),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
)
hooks = []
"""


@HOOKS.register_module(force=True)
class ParamTrace(HookBase):
    """Keeps a flat copy of the parameters before training and after every step."""

    def __init__(self):
        self.trace = []

    def _snap(self):
        params = self.trainer.model_without_ddp.parameters()
        self.trace.append(torch.cat([p.detach().reshape(-1).clone() for p in params]))

    before_train = _snap
    after_step = _snap


def make_trainer(tmp_path: Path, extra: str = "", options=(), name: str = "run"):
    directory = tmp_path / name
    directory.mkdir()
    cfg_path = write_toy_config(directory, directory / "save", SMALL + extra)
    cfg, hooks = load_config(str(cfg_path), list(options), world_size=1)
    return build_trainer(cfg, hooks=hooks)


def test_grad_accumulation_equals_the_larger_batch(tmp_path):
    accum = make_trainer(tmp_path, "batch_size = 16\ngrad_accum_steps = 2\nhooks = [dict(type='ParamTrace')]\n",
                         name="accum")
    plain = make_trainer(tmp_path, "batch_size = 32\n", name="plain")
    single = make_trainer(tmp_path, "batch_size = 16\n", name="single")
    assert (accum.iters_per_epoch, plain.iters_per_epoch, single.iters_per_epoch) == (2, 2, 4)
    for trainer in (accum, plain):
        trainer.train()
    # Half the optimizer steps of the unaccumulated batch-16 run, and the model moved.
    assert accum.global_step == 4
    assert all(s["step"].item() == 4 for s in accum.optimizer.state.values())
    trace = next(h for h in accum.hooks if isinstance(h, ParamTrace)).trace
    assert len(trace) == 5 and not torch.equal(trace[0], trace[-1])
    # Two micro-batches of 16 give the gradient of one batch of 32 (same samples, same order).
    for (name, a), b in zip(accum.model_without_ddp.named_parameters(), plain.model_without_ddp.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    # The reported step loss is the whole step's mean, not the last micro-batch's.
    assert accum.metrics.latest("train/loss") == pytest.approx(plain.metrics.latest("train/loss"), rel=1e-5)
    single.close()


def test_clip_grad_bounds_every_update(tmp_path):
    clip, lr = 1e-3, 1.0
    trainer = make_trainer(tmp_path, textwrap.dedent(f"""
        epoch = 1
        optimizer = dict(type="SGD", lr={lr})
        scheduler = dict(type="Constant")
        clip_grad = {clip}
        hooks = [dict(type="ParamTrace")]
    """))
    trainer.train()
    trace = next(h for h in trainer.hooks if isinstance(h, ParamTrace)).trace
    steps = [(after - before).norm().item() for before, after in zip(trace, trace[1:])]
    assert len(steps) == 4
    # Plain SGD moves by lr * |g|; the raw gradients here are ~100x larger than the clip.
    for step in steps:
        assert step == pytest.approx(lr * clip, rel=1e-3)


def test_bfloat16_autocast_runs_on_cpu(tmp_path):
    trainer = make_trainer(tmp_path, "epoch = 1\nenable_amp = True\namp_dtype = 'bfloat16'\n"
                                     "hooks = [dict(type='ParamTrace'), dict(type='ClsEvaluator', num_classes=2)]\n")
    trainer.train()
    output = trainer.comm_info["model_output_dict"]
    assert output["cls_logits"].dtype == torch.bfloat16  # the forward ran under autocast
    assert math.isfinite(trainer.metrics.latest("train/loss"))
    assert all(p.dtype == torch.float32 for p in trainer.model_without_ddp.parameters())  # master weights
    trace = next(h for h in trainer.hooks if isinstance(h, ParamTrace)).trace
    assert not torch.equal(trace[0], trace[-1])
    _, records = read_metrics(trainer.save_path)
    assert [r["step"] for r in records if "val/acc" in r] == [4]


def test_resume_extends_a_finished_run(tmp_path):
    # ``epoch`` is an absolute horizon: raising it and resuming from the final
    # (epoch-end) checkpoint trains the extra epochs with fresh data.
    hooks = "hooks = [dict(type='CheckpointLoader'), dict(type='CheckpointSaver')]\n"
    first = make_trainer(tmp_path, "epoch = 1\n" + hooks)
    first.train()
    directory = tmp_path / "run"
    cfg, hooks = load_config(str(directory / "toy_cfg.py"), ["resume=True", "epoch=2"], world_size=1)
    second = build_trainer(cfg, hooks=hooks)
    second.train()
    assert first.global_step == 4 and second.global_step == 8
    assert second.train_state.epoch == 2 and second.outcome == "completed"
    assert sorted(p.name for p in (directory / "save" / "checkpoints").glob("step*"))[-1] == "step000000008-epoch0002"


# ----------------------------------------------------------------------------- W&B and failures


def test_wandb_offline_run_and_run_id_in_checkpoint(tmp_path):
    pytest.importorskip("wandb")
    save_path = tmp_path / "run"
    cfg_path = write_toy_config(tmp_path, save_path, "epoch = 1\n")
    result = run_tool("train", cfg_path, "use_wandb=True")  # run_tool sets WANDB_MODE=offline
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((save_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    (checkpoint,) = sorted((save_path / "checkpoints").glob("step*"))[-1:]
    writer_state = torch.load(checkpoint / "common.pth", weights_only=True)["writer"]
    run_id = writer_state["wandb_run_id"]
    assert run_id and runs[0].name.endswith(f"-{run_id}")


FLAKY_MODEL = '''
"""A ToyMLP whose training forward raises at call ``fail_at``."""
from pimm.engines import MODELS
from tests.support.toy import ToyMLP


@MODELS.register_module(force=True)
class FlakyMLP(ToyMLP):
    def __init__(self, fail_at, **kwargs):
        super().__init__(**kwargs)
        self.fail_at, self.calls = fail_at, 0

    def forward(self, batch):
        if self.training:
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError(f"simulated failure in forward call {self.calls}")
        return super().forward(batch)
'''


def test_failure_exits_1_with_one_traceback_and_closed_writers(tmp_path, monkeypatch):
    (tmp_path / "flaky_model.py").write_text(FLAKY_MODEL)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # run_tool puts the repo root in front
    save_path = tmp_path / "run"
    cfg_path = write_toy_config(tmp_path, save_path, textwrap.dedent("""
        custom_imports = ["tests.support.toy", "flaky_model"]
        model = dict(type="FlakyMLP", fail_at=7)
    """))
    result = run_tool("train", cfg_path)
    assert result.returncode == 1, result.stderr[-3000:]
    line = assert_single_error_line(result.stderr, "error: train failed: ")
    assert "simulated failure in forward call 7" in line and "train.log" in line
    log = (save_path / "train.log").read_text()
    assert log.count("Traceback (most recent call last)") == 1
    assert "RuntimeError: simulated failure in forward call 7" in log
    assert result.stderr.count("Traceback (most recent call last)") <= 1  # the console echo, not logged twice
    # Writers were flushed and closed: steps 5 and 6 were still buffered (log_frequency=4).
    assert [step for step, _ in train_losses(save_path)] == [1, 2, 3, 4, 5, 6]
    assert max(read_tensorboard_scalars(save_path / "tensorboard")["train/loss"]) == 6  # the last window too
