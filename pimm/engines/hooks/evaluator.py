"""EvaluatorBase: run the model over an evaluation split, reduce over ranks,
log ``val/<name>`` scalars and report a new best metric.

A concrete evaluator implements four methods::

    reset()                         clear accumulators
    process(input_dict, output)     one batch (no grad, tensors on the device);
                                    accumulate into tensors, no .item()
    accumulators() -> {name: Tensor}  summed over ranks by this class
    compute(totals) -> {name: value}  metrics from the summed accumulators;
                                    int/float values are logged as val/<name>

and may override ``report(metrics) -> str`` for a per-class table.
``metric_name`` (a key of ``compute``'s result) selects the best checkpoint.
Evaluation runs inside ``fork_rng`` so it never perturbs the training RNG
streams, whether at an epoch end or mid-epoch (``every_n_steps``).
"""

from __future__ import annotations

import time

import torch

from pimm.engines.hooks.base import HookBase
from pimm.utils import comm
from pimm.utils.rng import fork_rng

__all__ = ["EvaluatorBase"]


class EvaluatorBase(HookBase):
    metric_name: str | None = None
    greater_is_better: bool = True

    def __init__(self, every_n_steps: int | None = None, prefix: str = "val"):
        if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                          or every_n_steps <= 0):
            raise ValueError(f"every_n_steps must be a positive integer or None, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix

    # -- to implement ---------------------------------------------------
    def reset(self) -> None:
        raise NotImplementedError

    def process(self, input_dict: dict, output_dict: dict) -> None:
        raise NotImplementedError

    def accumulators(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        raise NotImplementedError

    def report(self, metrics: dict) -> str:
        return ""

    # -- schedule -------------------------------------------------------
    def after_step(self):
        if self.every_n_steps and self.trainer.global_step % self.every_n_steps == 0 and self.trainer.cfg.evaluate:
            self.evaluate_and_log()

    def after_epoch(self):
        if not self.every_n_steps and self.trainer.cfg.evaluate:
            self.evaluate_and_log()

    # -- running --------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, loader) -> dict:
        trainer = self.trainer
        model = trainer.model_without_ddp
        was_training = model.training
        loss_sum = torch.zeros((), dtype=torch.float64, device=trainer.device)
        batches = torch.zeros((), dtype=torch.float64, device=trainer.device)
        with fork_rng():
            model.eval()
            self.reset()
            try:
                for batch in loader:
                    batch = trainer._to_device(batch)
                    with trainer.autocast():
                        output = model(batch)
                    loss = output.get("loss") if isinstance(output, dict) else None
                    if isinstance(loss, torch.Tensor):
                        loss_sum += loss.detach().double()
                        batches += 1
                    self.process(batch, output)
            finally:
                model.train(was_training)
        totals = {k: comm.all_reduce(v.clone()) for k, v in self.accumulators().items()}
        metrics = self.compute(totals)
        comm.all_reduce(loss_sum)
        comm.all_reduce(batches)
        if batches.item() > 0:
            metrics.setdefault("loss", (loss_sum / batches).item())
        return metrics

    def evaluate_and_log(self) -> dict:
        trainer = self.trainer
        start = time.perf_counter()
        metrics = self.evaluate(trainer.val_loader)
        scalars = {f"{self.prefix}/{k}": v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        trainer.writer.add_scalars(scalars, step=trainer.global_step, epoch=trainer.epoch + 1)
        trainer.writer.flush()
        summary = " ".join(f"{k} {v:.4f}" for k, v in scalars.items())
        trainer.logger.info(f"Eval at step {trainer.global_step} ({time.perf_counter() - start:.1f}s): {summary}")
        table = self.report(metrics)
        if table:
            trainer.logger.info(table)
        if self.metric_name is not None and self.metric_name in metrics:
            if trainer.train_state.update_best(self.metric_name, metrics[self.metric_name], self.greater_is_better):
                trainer.comm_info["new_best"] = True
        return metrics
