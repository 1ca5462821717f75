"""InformationWriter: every step's scalars to the writers, a log line every
``log_frequency`` steps. ``train/lr`` is the learning rate the step used.

The per-step work is appending detached device tensors to the writer's
buffer; the host transfer happens once per ``log_frequency`` steps.
"""

from __future__ import annotations

import datetime
import math

import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS

__all__ = ["InformationWriter"]


@HOOKS.register_module()
class InformationWriter(HookBase):
    def __init__(self, log_frequency: int = 20):
        if isinstance(log_frequency, bool) or not isinstance(log_frequency, int) or log_frequency <= 0:
            raise ValueError(f"log_frequency must be a positive integer, got {log_frequency!r}")
        self.log_frequency = log_frequency

    def after_step(self):
        trainer = self.trainer
        info = trainer.comm_info
        scalars = {"train/loss": info["loss"], "train/lr": info["lr"]}
        for key, value in info["model_output_dict"].items():
            if key != "loss" and isinstance(value, torch.Tensor) and value.ndim == 0:
                scalars[f"train/{key}"] = value.detach()
        step = trainer.global_step
        trainer.writer.add_scalars(scalars, step=step, epoch=trainer.epoch + 1, dense=True)
        if step % self.log_frequency == 0 or trainer.iter == trainer.iters_per_epoch:
            self._flush_and_log()

    def _flush_and_log(self):
        trainer = self.trainer
        records = trainer.writer.flush() or []
        if not records:
            return
        last = next((r for r in reversed(records) if "train/loss" in r), None)
        if last is None:
            return
        storage = trainer.storage
        eta = storage.latest("eta_seconds")
        eta_text = str(datetime.timedelta(seconds=int(eta))) if not math.isnan(eta) else "-"
        extras = " ".join(f"{k[6:]} {v:.4f}" for k, v in last.items()
                          if k.startswith("train/") and k not in ("train/loss", "train/lr"))
        trainer.logger.info(
            f"Train: [{trainer.epoch + 1}/{trainer.max_epoch}][{trainer.iter}/{trainer.iters_per_epoch}] "
            f"step {trainer.global_step} loss {last['train/loss']:.4f} lr {last['train/lr']:.3e} "
            f"{extras + ' ' if extras else ''}"
            f"data {storage.avg('data_time'):.3f}s step {storage.avg('step_time'):.3f}s eta {eta_text}"
        )

    def after_epoch(self):
        self.trainer.writer.flush()

    def after_train(self):
        self.trainer.writer.flush()
