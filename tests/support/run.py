"""Helpers to write configs and run ``tools/train.py`` / ``tools/test.py`` as real processes
(forked from a server that imported torch and pimm once: ``tests/support/forkserver.py``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from tests.support import forkserver

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = Path(__file__).resolve().parent

TOY_CONFIG = '''
_base_ = {base!r}
custom_imports = ["tests.support.toy"]
save_path = {save_path!r}
epoch = 3
batch_size = 16
num_worker = 0
model = dict(type="ToyMLP", dropout=0.1)
data = dict(
    train=dict(type="ToyDataset", num_samples=160, noise_aug=0.1),
    val=dict(type="ToyDataset", num_samples=64, seed=1),
    test=dict(type="ToyDataset", num_samples=64, seed=2),
)
optimizer = dict(type="AdamW", lr=0.01)
scheduler = dict(type="CosineWarmupLR", warmup_ratio=0.1)
hooks = [
    dict(type="CheckpointLoader"),
    dict(type="IterationTimer", warmup_iter=1),
    dict(type="InformationWriter", log_frequency=4),
    dict(type="ClsEvaluator", num_classes=2),
    dict(type="CheckpointSaver", save_freq=5),
]
'''


# pimm's console log format. Logs share stderr with a failure's one ``error:``
# line (as with Python's logging), so the one-line rule is checked on the rest.
LOG_LINE = re.compile(r"(\[rank\d+\] )?\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z]+\] ")


def non_log_lines(stderr: str) -> list[str]:
    """The non-empty lines of ``stderr`` that are not pimm log lines (nor the
    indented later lines of a multi-line log record)."""
    kept, in_record = [], False
    for line in stderr.splitlines():
        if LOG_LINE.match(line):
            in_record = True
        elif in_record and line.startswith("  "):
            pass  # a continuation line of the record above (the console indents them)
        else:
            in_record = False
            if line.strip():
                kept.append(line)
    return kept


def write_toy_config(directory: Path, save_path: Path, extra: str = "") -> Path:
    path = Path(directory) / "toy_cfg.py"
    base = str(ROOT / "configs" / "_base_" / "default_runtime.py")
    path.write_text(TOY_CONFIG.format(base=base, save_path=str(save_path)) + extra)
    return path


def env() -> dict:
    out = dict(os.environ)
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")])
    out["OMP_NUM_THREADS"] = "1"
    # torch.compile's inductor otherwise starts a pool of compile-worker interpreters
    # (one per core), each importing torch: most of a compiled test run's CPU time.
    out["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    out["WANDB_MODE"] = "offline"
    out.pop("PIMM_DEBUG", None)
    return out


def run_tool(tool: str, config: Path, *options: str, num_gpus: int = 1, timeout: float = 300,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--config-file", str(config)]
    if num_gpus != 1:
        cmd += ["--num-gpus", str(num_gpus)]
    if options:
        cmd += ["--options", *options]
    return forkserver.run(cmd, timeout=timeout, env=env(), cwd=cwd or ROOT)


def train_losses(save_path: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in open(Path(save_path) / "metrics.jsonl")]
    return [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]


def final_weights(save_path: Path) -> dict:
    return torch.load(Path(save_path) / "model" / "model_last.pth", weights_only=True)
