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


def two_steps_in_process(cfg) -> tuple[set[str], set[str]]:
    """A loaded config's model, optimizer (with ``param_dicts``), scheduler and
    training data, built as the trainer builds them, take two optimizer steps
    of two samples each (every loss finite); returns the names of the
    parameters that moved and of the frozen ones."""
    import torch

    from pimm.datasets import COLLATE_FNS, DATASETS
    from pimm.engines.optim import build_optimizer
    from pimm.engines.optim.scheduler import build_scheduler
    from pimm.engines.registries import MODELS

    torch.manual_seed(0)
    model = MODELS.build(cfg.model).train()
    optimizer = build_optimizer(cfg.optimizer, model, cfg.param_dicts)
    scheduler = build_scheduler(cfg.scheduler, optimizer, total_steps=2)
    dataset = DATASETS.build(cfg.data["train"])
    collate = COLLATE_FNS.get("point_collate_fn")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        loss = model(collate([dataset[2 * step], dataset[2 * step + 1]]))["loss"]
        assert torch.isfinite(loss), step
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(before[n], p)}
    return moved, {n for n, p in model.named_parameters() if not p.requires_grad}
