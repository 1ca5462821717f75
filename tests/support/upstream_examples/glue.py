"""What upstream's examples leave to their user, written as an upstream user
would: a backbone for ``MySegmentor``, ``MyDataset.get_data``, and an evaluator
hook that accumulates in ``trainer.storage``, logs through ``trainer.writer`` and
publishes its metric in ``trainer.comm_info`` for the checkpoint saver.
Imported through ``custom_imports`` (it imports the four examples)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from pimm.engines.hooks.builder import HOOKS
from pimm.engines.hooks.default import HookBase
from pimm.models.builder import MODELS

from . import my_dataset, my_scalar_hook, my_segmentor, random_energy_dropout  # noqa: F401  (register)

HERE = Path(__file__).resolve().parent


def _load_as(name: str, path: Path):
    """Import ``path`` as module ``name`` (the page puts tversky.py in pimm/models/losses/)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_load_as("pimm.models.losses.tversky", HERE / "tversky.py")


@MODELS.register_module(force=True)
class TinyPointBackbone(nn.Module):
    """A per-point MLP: returns the Point at input resolution with new ``feat``."""

    def __init__(self, in_channels=4, out_channels=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_channels, out_channels), nn.ReLU())

    def forward(self, point):
        point.feat = self.net(point.feat)
        return point


@my_dataset.DATASETS.register_module("MyEvents", force=True)
class MyEvents(my_dataset.MyDataset):
    """``MyDataset`` with its ``get_data``: one ``.npz`` event (coord, energy, segment)."""

    def get_data(self, index):
        with np.load(self.data_list[index]) as event:
            return {key: event[key].copy() for key in ("coord", "energy", "segment")}



def write_events(root: Path, split: str, count: int, seed: int) -> None:
    """``count`` small events whose class is decided by the energy's sign."""
    rng = np.random.default_rng(seed)
    folder = Path(root) / split
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        points = int(rng.integers(20, 40))
        energy = rng.normal(size=points).astype(np.float32)
        np.savez(folder / f"event_{i:03d}.npz", coord=rng.normal(size=(points, 3)).astype(np.float32),
                 energy=energy, segment=(energy > 0).astype(np.int64) + (energy > 1).astype(np.int64))


@HOOKS.register_module(force=True)
class StepMetricPublisher(HookBase):
    """Publishes ``at[global_step]`` as ``stepwise`` after those steps (an evaluator on a step schedule)."""

    def __init__(self, at):
        self.at = {int(k): v for k, v in at.items()}

    def after_step(self):
        value = self.at.get(self.trainer.global_step)
        if value is not None:
            self.trainer.comm_info["current_metric_value"] = value
            self.trainer.comm_info["current_metric_name"] = "stepwise"


@HOOKS.register_module(force=True)
class UpstreamStyleEvaluator(HookBase):
    """Point accuracy on the validation split after every epoch, upstream's way;
    ``values``: publish these per epoch instead (a scripted best-model choice)."""

    def __init__(self, values=None, greater_is_better=True):
        self.values = values
        self.greater_is_better = greater_is_better

    def after_epoch(self):
        trainer = self.trainer
        model = trainer.model
        model.eval()
        with torch.no_grad():
            for input_dict in trainer.val_loader:
                output = model(input_dict)
                pred = output["seg_logits"].argmax(1)
                trainer.storage.put_scalar("val_correct", (pred == input_dict["segment"]).sum().item())
                trainer.storage.put_scalar("val_points", pred.numel())
                trainer.storage.put_scalar("val_loss", output["loss"].item())
        model.train()
        accuracy = trainer.storage.history("val_correct").total / trainer.storage.history("val_points").total
        value = accuracy if self.values is None else self.values[trainer.epoch]
        trainer.writer.add_scalar("val/point_acc", accuracy, trainer.global_step)
        trainer.writer.add_scalar("val/loss_avg", trainer.storage.history("val_loss").avg, trainer.global_step)
        trainer.comm_info["current_metric_value"] = value
        trainer.comm_info["current_metric_name"] = "published"
        trainer.comm_info["current_metric_greater_is_better"] = self.greater_is_better
        trainer.logger.info(f"published={value:.4f} best so far {trainer.best_metric_value}")
