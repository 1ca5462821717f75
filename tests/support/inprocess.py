"""In-process trainers on the toy task of ``tests/support/toy.py``, for hook tests.

``make_trainer`` writes a toy config (64 training samples, batch 16: 4 steps
per epoch) with the given ``hooks`` list and builds the trainer the way the
command line does (``load_config`` then ``build_trainer``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pimm.cli

pimm.cli.register_all()  # the evaluators (ClsEvaluator...)

from pimm.engines.run.launch import build_trainer, load_config  # noqa: E402
from pimm.engines.state.manager import CheckpointManager  # noqa: E402
from tests.support.run import write_toy_config  # noqa: E402

SMALL = """
epoch = {epoch}
data = dict(
    train=dict(type="ToyDataset", num_samples=64),
    val=dict(type="ToyDataset", num_samples=32, seed=1),
    test=dict(type="ToyDataset", num_samples=32, seed=2),
)
"""


def make_trainer(directory: Path, hooks: str, extra: str = "", options=(), epoch: int = 2):
    """A toy trainer saving to ``directory/run``; ``hooks``: the config's list, as source."""
    directory.mkdir(parents=True, exist_ok=True)
    body = SMALL.format(epoch=epoch) + f"hooks = {hooks}\n" + extra
    cfg, built = load_config(str(write_toy_config(directory, directory / "run", body)), list(options), world_size=1)
    return build_trainer(cfg, hooks=built)


def hook_of(trainer, name: str):
    """The trainer's hook of type ``name`` (hooks are sorted by priority, not config order)."""
    return next(h for h in trainer.hooks if type(h).__name__ == name)


def records(save_path: Path) -> list[dict]:
    return [json.loads(line) for line in open(Path(save_path) / "metrics.jsonl")]


def committed_steps(save_path: Path) -> list[int]:
    return [int(p.name[4:13]) for p in CheckpointManager(Path(save_path) / "checkpoints").committed()]
