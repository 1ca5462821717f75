"""EvaluatorBase: score a model over an evaluation split, reduced over ranks.

An evaluator hook decides *when* (each epoch end, or every N steps) and asks
the trainer to validate (``trainer.validate([self])``); the trainer hands it
the model to score (so an EMA hook can have its weights evaluated too),
dispatches ``before_val(run)`` / ``after_val(metrics, run)``, publishes
``val/<name>`` scalars, keeps the best metric and tells each evaluator which
evaluation it took part in (:meth:`EvaluatorBase.mark_evaluated`).

A concrete evaluator implements four methods::

    reset()                         clear accumulators
    process(input_dict, output)     one batch (no grad, tensors on the device);
                                    accumulate into tensors, no .item()
    accumulators() -> {name: Tensor}  summed over ranks by this class
    compute(totals) -> {name: value}  metrics from the summed accumulators;
                                    int/float values are logged as val/<name>

and may override ``report(metrics) -> str`` for a per-class table,
``forward_batch(batch, model) -> (batch, output)`` for batches that are not
one model call (test-time voting, :mod:`pimm.evaluation.voting`) and
``display(input_dict, output_dict, limit) -> [image, ...]`` for event
displays: pictures of up to ``limit`` events of a batch, (H, W, 3) uint8,
true vs predicted. ``log_images=N`` logs the first N validation events (the
same ones every time: the evaluation order is fixed) to TensorBoard and W&B
at every evaluation; rank 0 renders its own first events; 0 turns it off.
Without matplotlib (the core install, no ``plot`` extra) the displays are
skipped with one warning naming the extra, and the evaluation goes on.
``metric_name`` (a key of ``compute``'s result) with ``greater_is_better``
declares the metric's direction; the first such evaluator selects the best
model (``model/model_best.pth``).
Evaluation runs inside ``fork_rng`` so it never perturbs the training RNG
streams, whether at an epoch end or mid-epoch (``every_n_steps``).
"""

from __future__ import annotations

import torch

from pimm.engines.hooks.base import EvalRun, HookBase
from pimm.utils import comm
from pimm.utils.extras import skip_without_extra
from pimm.utils.rng import fork_rng

__all__ = ["EvaluatorBase", "eval_interval_epochs"]


class EvaluatorBase(HookBase):
    """Base of evaluator hooks (see the module docstring).

    ``every_n_steps``: evaluate every N optimizer steps instead of at each
    epoch end. The final weights are evaluated at the end of training in
    either case, unless the last evaluation already saw them."""

    metric_name: str | None = None
    greater_is_better: bool = True

    def __init__(self, every_n_steps: int | None = None, prefix: str = "val", log_images: int = 2):
        _check_interval(every_n_steps)
        if isinstance(log_images, bool) or not isinstance(log_images, int) or log_images < 0:
            raise ValueError(f"log_images must be an integer >= 0, got {log_images!r}")
        self.every_n_steps = every_n_steps
        self.prefix = prefix
        self.log_images = log_images
        self.last_step: int | None = None
        self.images: list = []  # the event displays of the last evaluation (rank 0)

    # -- to implement ---------------------------------------------------
    def reset(self) -> None:
        """Clear the accumulators before an evaluation."""
        raise NotImplementedError

    def process(self, input_dict: dict, output_dict: dict) -> None:
        """Accumulate one batch (tensors on the device, no grad; avoid ``.item()``)."""
        raise NotImplementedError

    def accumulators(self) -> dict[str, torch.Tensor]:
        """The accumulated tensors, summed over ranks by :meth:`evaluate`."""
        raise NotImplementedError

    def compute(self, totals: dict[str, torch.Tensor]) -> dict:
        """Metrics from the rank-summed accumulators; int/float values are logged."""
        raise NotImplementedError

    def report(self, metrics: dict) -> str:
        """A text table for the log (e.g. per class); empty by default."""
        return ""

    def display(self, input_dict: dict, output_dict: dict, limit: int) -> list:
        """Pictures of up to ``limit`` events of this batch (none by default)."""
        return []

    def state_dict(self) -> dict:
        """``last_step``, so a resumed run knows whether its final weights were scored."""
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict) -> None:
        """Take back :meth:`state_dict`'s ``last_step``."""
        self.last_step = state.get("last_step")

    # -- the trainer's and other hooks' calls ----------------------------
    def mark_evaluated(self, run: EvalRun) -> None:
        """The trainer tells this evaluator it scored ``run``. A scheduled or final
        evaluation of the trained weights is remembered in ``last_step`` (the end
        of training does not score the same weights twice); an on-demand one or
        one of other weights (EMA) leaves the schedule as it was."""
        if run.kind != "on_demand" and run.of_trained_weights:
            self.last_step = run.step

    def set_interval(self, every_n_steps: int | None) -> None:
        """Evaluate every ``every_n_steps`` optimizer steps from now on (None: at
        each epoch end); for live control. Checked like the constructor's option."""
        _check_interval(every_n_steps)
        self.every_n_steps = every_n_steps

    # -- metrics this evaluator defines ----------------------------------
    def declare_metrics(self, channel) -> None:
        """Tell the metric channel which way this evaluator's metrics go; the
        first evaluator with a ``metric_name`` selects the best model."""
        channel.declare(f"{self.prefix}/loss", "min")
        if self.metric_name is not None:
            name = f"{self.prefix}/{self.metric_name}"
            channel.declare(name, "max" if self.greater_is_better else "min")
            channel.track_best(name)

    # -- schedule -------------------------------------------------------
    def after_step(self):
        trainer = self.trainer
        if self.every_n_steps and trainer.global_step % self.every_n_steps == 0 and trainer.cfg.evaluate:
            trainer.validate([self])

    def after_epoch(self):
        trainer = self.trainer
        if self.every_n_steps or not trainer.cfg.evaluate:
            return
        every = eval_interval_epochs(trainer.max_epoch, trainer.cfg.get("eval_epoch"))
        if trainer.train_state.epoch % every:
            return  # the final weights are scored at the end whatever the interval
        trainer.validate([self])

    # -- running --------------------------------------------------------
    def forward_batch(self, batch, model: torch.nn.Module) -> tuple:
        """``(batch, output)`` for one loader batch: the batch on the trainer's
        device and the model's output on it. An evaluator whose batches are not
        one model call (test-time fragments and voting) overrides this and
        returns the batch it scores with the output it scores."""
        batch = self.trainer.to_device(batch)
        with self.trainer.autocast():
            return batch, model(batch)

    @torch.no_grad()
    def evaluate(self, loader, model: torch.nn.Module, images: int = 0) -> dict:
        """Metrics of ``model`` over ``loader``, reduced over ranks (a collective),
        and (rank 0) displays of its first ``images`` events in :attr:`images`.
        Runs inside ``fork_rng`` so it never perturbs the training RNG streams."""
        trainer = self.trainer
        self.images = []
        images = images if comm.is_main_process() else 0
        was_training = model.training
        device = next(iter(model.parameters()), torch.zeros(())).device
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        batches = torch.zeros((), dtype=torch.float64, device=device)
        with fork_rng():
            model.eval()
            self.reset()
            try:
                for batch in loader:
                    batch, output = self.forward_batch(batch, model)
                    loss = output.get("loss") if isinstance(output, dict) else None
                    if isinstance(loss, torch.Tensor):
                        loss_sum += loss.detach().double()
                        batches += 1
                    self.process(batch, output)
                    if len(self.images) < images:
                        try:
                            self.images += self.display(batch, output, images - len(self.images))[:images]
                        except ModuleNotFoundError as err:  # the core install has no matplotlib
                            if not skip_without_extra(err, "event displays"):
                                raise
                            images = 0
            finally:
                model.train(was_training)
        totals = {k: comm.all_reduce(v.clone()) for k, v in self.accumulators().items()}
        metrics = self.compute(totals)
        comm.all_reduce(loss_sum)
        comm.all_reduce(batches)
        if batches.item() > 0:
            metrics.setdefault("loss", (loss_sum / batches).item())
        return metrics


def eval_interval_epochs(epoch: int, eval_epoch: int | None) -> int:
    """Epochs between the scheduled evaluations of a run of ``epoch`` epochs with
    ``eval_epoch`` evaluations (upstream's key): ``max(1, epoch // eval_epoch)``,
    so an ``eval_epoch`` at or above ``epoch`` (upstream's default sets it to
    ``epoch``; ``--options epoch=10`` on ``eval_epoch=20``) evaluates every
    epoch, and one that does not divide ``epoch`` evaluates at least that
    often. The final weights are scored at the end whatever the interval."""
    if not eval_epoch or not epoch:
        return 1
    return max(1, epoch // eval_epoch)


def _check_interval(every_n_steps) -> None:
    if every_n_steps is not None and (isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int)
                                      or every_n_steps <= 0):
        raise ValueError(f"every_n_steps must be a positive integer or None, got {every_n_steps!r}")
