"""GANTrainer: several networks updated in turn, each by its own optimizer.

The config names the parts (:mod:`pimm.engines.optim.parts`)::

    train = dict(type="GANTrainer")
    optimizer = dict(disc=dict(type="Adam", lr=2e-4), gen=dict(type="Adam", lr=2e-4))

and the model computes each part's loss when asked, ``model(batch,
part=name) -> dict(loss=..., <scalars>)`` (see :class:`~pimm.models.ring_gan.RingGAN`).
One training step fetches ``grad_accum_steps`` batches, then for each part,
in ``order`` (default: the optimizer config's order)::

    optim_steps[part].zero_grad()          # what another part's backward left in its parameters
    for each batch: backward(model(batch, part=part)["loss"] / accum)
    optim_steps[part].step()               # that part's scaler, clipping, optimizer, scheduler

So with the default order a GAN's discriminator is updated first, and the
generator is then trained against the updated discriminator on the same real
batch (fresh noise). Nothing here is specific to GANs: any model whose parts
are trained by alternating updates fits.

Metrics per part: ``train/loss/<part>``, ``train/lr/<part>``,
``train/grad_norm/<part>`` (when clipping or ``log_grad_norm``) and every
other scalar the model returns for that part as ``train/<key>/<part>``;
``train/loss`` is the sum of the parts' losses (what generic tools watch).
``trainer.step_results`` holds each part's :class:`StepResult`;
``trainer.step_result`` is the last part's, and ``trainer.optim_step`` is the
update in progress while its ``after_backward`` hooks run (NaNGuard skips
that part's update).

Distributed: the model is wrapped whole by DDP with
``find_unused_parameters=True`` by default (a discriminator step leaves the
generator without gradients); under FSDP each part is its own sharding unit.
"""

from __future__ import annotations

import torch

from pimm.engines.registries import TRAINERS
from pimm.engines.trainers.default import DefaultTrainer, batch_stats
from pimm.utils.errors import ConfigError
from pimm.utils.domains import Keys

__all__ = ["GANTrainer"]


@TRAINERS.register_module()
class GANTrainer(DefaultTrainer):
    """Alternating updates of the optimizer parts (see the module docstring).

    Options, besides DefaultTrainer's: ``order``: the parts to update in one
    step, in order (default: every part, in the optimizer config's order);
    ``find_unused_parameters`` defaults to True.
    """

    supports_optimizer_parts = True
    # The generated sample's distance from the real one (RingGANEvaluator); the losses of a GAN say little.
    headline_metric = ("val/stat_gap", "min")

    domains = dict(order=Keys | None)

    def __init__(self, cfg, *args, order=None, find_unused_parameters: bool = True, **kwargs):
        self._order_option = order
        if kwargs.get("oom_backoff") is not None:
            raise ConfigError("train.oom_backoff is not supported by GANTrainer (one step updates several parts); "
                              "remove it or lower batch_size")
        super().__init__(cfg, *args, find_unused_parameters=find_unused_parameters, **kwargs)

    def build_optim_parts(self) -> dict:
        """The parts, and ``self.order`` checked against them (a one-line ConfigError
        for a single-optimizer config or an unknown name)."""
        parts = super().build_optim_parts()
        if not parts:
            raise ConfigError("GANTrainer trains several networks, each with its own optimizer: set optimizer = "
                              "dict(<part>=dict(type=...), ...) with one entry per submodule of the model "
                              "(e.g. gen=dict(type='Adam', lr=2e-4), disc=dict(type='Adam', lr=2e-4))")
        order = self._order_option
        if order is None:
            order = tuple(parts)
        if isinstance(order, str) or not isinstance(order, (list, tuple)) or not order:
            raise ConfigError(f"train.order={order!r} must be a non-empty list of optimizer parts "
                              f"({', '.join(parts)})")
        unknown = [name for name in order if name not in parts]
        if unknown:
            raise ConfigError(f"train.order names {unknown[0]!r}, which is no optimizer part "
                              f"(the optimizer config names {', '.join(parts)})")
        if len(set(order)) != len(order):
            raise ConfigError(f"train.order={list(order)!r} names a part twice: each part is updated once per "
                              "step (its schedule counts steps); use grad_accum_steps or a larger lr instead")
        self.order = tuple(order)
        return parts

    def forward_part(self, batch, part: str) -> dict:
        """The model's loss for ``part`` (under autocast when AMP is on); the first
        call per part checks the model answers it, in one line."""
        if part not in self._checked_parts:
            return self._first_part_forward(batch, part)
        with self.autocast():
            return self.model(batch, part=part)

    _checked_parts: frozenset = frozenset()

    def _first_part_forward(self, batch, part: str) -> dict:
        output = self.checked_first_forward(
            lambda: self.model(batch, part=part), f" for part {part!r}",
            "GANTrainer calls model(batch, part=name) and needs dict(loss=...) back",
            "(GANTrainer calls model(batch, part=name), whose result must be a dict with a scalar 'loss')")
        self._checked_parts = self._checked_parts | {part}
        return output

    def run_step(self) -> None:
        info = self.begin_step()
        accum = self.grad_accum_steps
        tracer = self.tracer
        batches = [self.next_batch() for _ in range(accum)]
        scalars: dict = {}
        results = {}
        total = output = None
        for name in self.order:
            optim_step = self.optim_steps[name]
            optim_step.zero_grad()  # another part's backward may have left gradients in these parameters
            part_loss = None
            for micro, batch in enumerate(batches):
                with optim_step.sync(last=micro == accum - 1):
                    t = tracer.now()
                    output = self.forward_part(batch, name)
                    loss = output["loss"] / accum if accum > 1 else output["loss"]
                    t = tracer.complete(f"forward/{name}", t)
                    optim_step.backward(loss)
                    tracer.complete(f"backward/{name}", t)
                part_loss = loss.detach() if part_loss is None else part_loss + loss.detach()
            self.optim_step = optim_step  # after_backward hooks act on the update in progress
            info["input_dict"], info["model_output_dict"], info["loss"] = batch, output, part_loss
            t = tracer.now()
            results[name] = result = optim_step.step()
            tracer.complete(f"optimizer/{name}", t)
            total = part_loss if total is None else total + part_loss
            scalars[f"train/loss/{name}"] = part_loss
            scalars[f"train/lr/{name}"] = result.lr
            if result.grad_norm is not None:
                scalars[f"train/grad_norm/{name}"] = result.grad_norm
            for key, value in output.items():
                if key != "loss" and isinstance(value, torch.Tensor) and value.ndim == 0:
                    scalars[f"train/{key}/{name}"] = value.detach()
        info["loss"] = total
        self.step_results = results
        self.step_result = results[self.order[-1]]
        scalars["train/loss"] = total
        self.metrics.publish(scalars, dense=True, step=self.train_state.global_step + 1)
        self.metrics.record("time/data", self._data_time)
        if tracer.batch_stats_every and tracer.step % tracer.batch_stats_every == 0:
            tracer.counter("batch", **batch_stats(batches[-1], self.batch_size_per_rank * accum))
