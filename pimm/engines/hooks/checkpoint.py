"""Checkpoint hooks: CheckpointSaver decides *when* to save, CheckpointLoader
restores a run (``resume=True``) or warm-starts weights (``weight=``). The
trainer's CheckpointManager does the saving and loading itself."""

from __future__ import annotations

import time

from pimm.engines.checkpoint import atomic_torch_save
from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.engines.resume import load_weights, resume_training
from pimm.utils import comm

__all__ = ["CheckpointSaver", "CheckpointLoader"]


@HOOKS.register_module()
class CheckpointSaver(HookBase):
    """Resumable checkpoints at every epoch end, every ``save_freq`` steps and
    every ``save_every_seconds`` of wall time; ``model/model_last.pth`` with each,
    ``model/model_best.pth`` whenever an evaluator reports a new best.

    ``keep_last`` resumable checkpoints are kept, plus the newest best one.
    The wall-clock rule is agreed across ranks every ``time_check_every`` steps."""

    # After evaluators (NORMAL) so the epoch-end checkpoint knows the new best.
    priority = "LOW"

    def __init__(self, save_freq: int | None = None, save_every_seconds: float | None = None, keep_last: int = 2,
                 time_check_every: int = 10):
        for name, value in (("save_freq", save_freq), ("save_every_seconds", save_every_seconds)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        self.save_freq = int(save_freq) if save_freq else None
        self.save_every_seconds = save_every_seconds
        self.keep_last = keep_last
        self.time_check_every = max(1, int(time_check_every))
        self._last_save = time.monotonic()

    @property
    def checkpoint_interval(self) -> int | None:
        """Steps between planned saves; the trainer aligns loader snapshots to it."""
        return self.save_freq

    def before_train(self):
        self.trainer.checkpointer.keep_last = self.keep_last
        self._last_save = time.monotonic()

    def _time_due(self) -> bool:
        if not self.save_every_seconds or self.trainer.global_step % self.time_check_every:
            return False
        return comm.any_rank(time.monotonic() - self._last_save >= self.save_every_seconds)

    def after_step(self):
        trainer = self.trainer
        if trainer.comm_info.pop("new_best", False):
            self.save_model_file("model_best.pth", with_metric=True)
        due = (self.save_freq and trainer.global_step % self.save_freq == 0) or self._time_due()
        # At the last step of an epoch the epoch-end save follows immediately.
        if due and trainer.iter < trainer.iters_per_epoch:
            self.save()

    def after_epoch(self):
        if self.trainer.comm_info.pop("new_best", False):
            self.save_model_file("model_best.pth", with_metric=True)
        self.save()

    def save(self):
        self.trainer.save_checkpoint()
        self.save_model_file("model_last.pth")
        self._last_save = time.monotonic()

    def save_model_file(self, name: str, with_metric: bool = False) -> None:
        if not comm.is_main_process():
            return
        trainer = self.trainer
        state = trainer.train_state
        payload = {"state_dict": trainer.model_without_ddp.state_dict(), "epoch": state.epoch,
                   "global_step": state.global_step}
        if with_metric:
            payload.update(metric=state.best_metric, metric_name=state.best_metric_name)
        atomic_torch_save(payload, trainer.save_path / "model" / name)
        if with_metric:
            trainer.logger.info(f"New best {state.best_metric_name}={state.best_metric:.4f}: saved model/{name}")


@HOOKS.register_module()
class CheckpointLoader(HookBase):
    """``resume=True``: restore the newest complete checkpoint in
    ``save_path/checkpoints`` (a fresh start when there is none).
    Otherwise ``weight=PATH``: copy matching weights into the model, renaming
    key prefixes with ``key_map=[(old, new), ...]``."""

    priority = "VERY_HIGH"  # restore before any other hook starts
    restores_checkpoints = True

    def __init__(self, key_map=()):
        self.key_map = [tuple(pair) for pair in key_map]

    def before_train(self):
        trainer = self.trainer
        cfg = trainer.cfg
        if cfg.resume:
            resumed = resume_training(trainer)
            if resumed or not cfg.weight:
                return
        if cfg.weight:
            load_weights(trainer.model_without_ddp, cfg.weight, self.key_map, trainer.logger)
