"""InformationWriter: flushes the metric channel every ``log_frequency`` steps
(and at each epoch end) and writes a log line.

The trainer publishes every step's scalars (``train/loss``, ``train/lr``,
the model's scalar outputs) as device tensors; the host transfer and the
cross-rank reduction happen here, once per ``log_frequency`` steps.
"""

from __future__ import annotations

import datetime
import math

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS

__all__ = ["InformationWriter"]


@HOOKS.register_module()
class InformationWriter(HookBase):
    """Flush the metric channel and log a line every ``log_frequency`` steps
    and at each epoch end (see the module docstring).

    Args:
        log_frequency: steps between flushes (each is a cross-rank collective).
        max_extras: how many other ``train/*`` scalars a log line shows beside
            loss and lr.
    """
    def __init__(self, log_frequency: int = 20, max_extras: int = 12):
        for name, value in (("log_frequency", log_frequency), ("max_extras", max_extras)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "log_frequency" else 0):
                raise ValueError(f"{name} must be a {'positive' if name == 'log_frequency' else 'non-negative'} "
                                 f"integer, got {value!r}")
        self.log_frequency = log_frequency
        self.max_extras = max_extras  # train/* scalars shown in a log line beside loss and lr

    def set_interval(self, log_frequency: int) -> None:
        """Flush and log every ``log_frequency`` steps from now on (live control)."""
        if isinstance(log_frequency, bool) or not isinstance(log_frequency, int) or log_frequency < 1:
            raise ValueError(f"log_frequency must be a positive integer, got {log_frequency!r}")
        self.log_frequency = log_frequency

    def after_step(self):
        trainer = self.trainer
        if trainer.global_step % self.log_frequency == 0 or trainer.iter == trainer.iters_per_epoch:
            self._flush_and_log()

    def _flush_and_log(self):
        trainer = self.trainer
        records = trainer.metrics.flush()
        last = next((r for r in reversed(records) if "train/loss" in r), None)
        if last is None:
            return
        metrics = trainer.metrics
        eta = metrics.latest("time/eta", float("nan"))
        eta_text = str(datetime.timedelta(seconds=int(eta))) if not math.isnan(eta) else "-"
        extra_items = [(k[6:], v) for k, v in last.items()
                       if k.startswith("train/") and k not in ("train/loss", "train/lr") and v is not None]
        extras = " ".join(f"{k} {v:.4f}" for k, v in extra_items[:self.max_extras])
        if len(extra_items) > self.max_extras:
            extras += f" (+{len(extra_items) - self.max_extras} in metrics.jsonl)"
        loss = last["train/loss"]
        trainer.logger.info(
            f"Train: [{trainer.epoch + 1}/{trainer.max_epoch}][{trainer.iter}/{trainer.iters_per_epoch}] "
            f"step {trainer.global_step} loss {loss:.4f} lr {last['train/lr']:.3e} "
            f"{extras + ' ' if extras else ''}"
            f"data {metrics.mean('time/data'):.3f}s step {metrics.mean('time/step'):.3f}s eta {eta_text}"
        )

    def after_epoch(self):
        self.trainer.metrics.flush()
