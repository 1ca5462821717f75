"""Tiny registered components for engine tests (imported via ``custom_imports``).

They are deliberately random in every way that matters to exact resume:
data augmentation draws from the global numpy and torch RNGs, and the model
uses dropout.
"""

import numpy as np
import torch
from torch import nn

from pimm.engines import DATASETS, HOOKS, MODELS, HookBase


@DATASETS.register_module(force=True)
class ToyDataset(torch.utils.data.Dataset):
    def __init__(self, num_samples=256, dim=8, seed=0, noise_aug=0.0):
        generator = torch.Generator().manual_seed(1234)  # one fixed task for all splits
        weights = torch.randn(dim, generator=generator)
        generator.manual_seed(seed)
        self.x = torch.randn(num_samples, dim, generator=generator)
        self.y = (self.x @ weights > 0).long()
        self.noise_aug = noise_aug

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        x = self.x[index]
        if self.noise_aug:
            x = x + self.noise_aug * torch.randn_like(x) + float(np.random.uniform(-0.01, 0.01))
        return {"x": x, "label": self.y[index]}


@MODELS.register_module(force=True)
class ToyMLP(nn.Module):
    def __init__(self, dim=8, hidden=32, dropout=0.0, num_classes=2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, num_classes))

    def forward(self, batch):
        logits = self.net(batch["x"])
        out = {"cls_logits": logits}
        if "label" in batch:
            out["loss"] = nn.functional.cross_entropy(logits, batch["label"])
        return out


@HOOKS.register_module(force=True)
class RecordingHook(HookBase):
    """Appends ``(name, phase, epoch, global_step)`` to a shared class-level log and
    counts steps in its state (for hook-state round trips)."""

    events = []

    def __init__(self, name="rec"):
        self.name = name
        self.steps_seen = 0

    def before_train(self):
        self.events.append((self.name, "before_train", self.trainer.epoch, self.trainer.global_step))

    def before_epoch(self):
        self.events.append((self.name, "before_epoch", self.trainer.epoch, self.trainer.global_step))

    def before_step(self):
        self.events.append((self.name, "before_step", self.trainer.epoch, self.trainer.global_step))

    def after_step(self):
        self.steps_seen += 1
        self.events.append((self.name, "after_step", self.trainer.epoch, self.trainer.global_step))

    def after_epoch(self):
        self.events.append((self.name, "after_epoch", self.trainer.epoch, self.trainer.global_step))

    def after_train(self):
        self.events.append((self.name, "after_train", self.trainer.epoch, self.trainer.global_step))

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = state["steps_seen"]


@HOOKS.register_module(force=True)
class KillAtStep(HookBase):
    """SIGKILLs (or SIGTERMs) its own process after ``step`` — a crash at a chosen point."""

    priority = "LOWEST"

    def __init__(self, step, signal_name="SIGKILL"):
        self.step, self.signal_name = step, signal_name

    def after_step(self):
        if self.trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), getattr(signal, self.signal_name))


@DATASETS.register_module(force=True)
class ToyStream(torch.utils.data.IterableDataset):
    """An endless, deterministic stream with its own resumable state: sample k
    is drawn from a generator seeded by k (single-process loading)."""

    def __init__(self, dim=8):
        self.dim, self.position = dim, 0
        self.weights = torch.randn(dim, generator=torch.Generator().manual_seed(1234))

    def __iter__(self):
        while True:
            x = torch.randn(self.dim, generator=torch.Generator().manual_seed(self.position))
            self.position += 1
            yield {"x": x, "label": (x @ self.weights > 0).long()}

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


@DATASETS.register_module(force=True)
class ToySizedStream(ToyStream):
    """The same stream, declaring how many samples make an epoch."""

    def __init__(self, dim=8, length=80):
        super().__init__(dim)
        self.length = length

    def num_samples(self):
        return self.length
