"""EMAHook: an exponential moving average of the model's weights, evaluated
and exported beside the trained weights.

The average is a :class:`torch.optim.swa_utils.AveragedModel` (a copy of
``trainer.model_without_ddp``) with ``use_buffers=True``: BatchNorm running
statistics are averaged like the weights, so the averaged model needs no
extra pass over the data before it is evaluated. Integer buffers (BatchNorm's
``num_batches_tracked``) are counters, not weights: they are copied.

The update, ``ema = d * ema + (1 - d) * weights``, runs in ``after_step``
after real optimizer updates only (``trainer.step_result.stepped``): a step
that a GradScaler or a hook (NaNGuard) skipped leaves the average untouched.
``update_every=K`` averages after every K-th real update. The first update
copies the weights; the n-th after it (n = weights averaged so far) uses::

    d_n = min(decay, (1 + n) / (10 + n))      # warmup=True (default)
    d_n = decay                               # warmup=False

The warm-up (the schedule of TensorFlow's ``ExponentialMovingAverage`` with
``num_updates``) keeps early, far-from-trained weights from dominating a
long-horizon average: the average covers roughly the updates seen so far
until ``decay`` takes over (after ~9 / (1 - decay) updates).

Every evaluation of the trained weights with prefix ``val`` (scheduled,
final, or on demand) is followed by one of the averaged weights with the same
evaluators, published as ``val_ema/<metric>``; its kind is passed on, so an
on-demand evaluation stays metrics-only. ``val_ema`` metrics never select the
best model (only ``val/<metric_name>`` does).

The average is part of every checkpoint (this hook's ``state_dict``; hook
states are saved by every rank, so under DDP each rank file holds one copy)
and is exported as ``model/model_ema.pth`` by rank 0 whenever a checkpoint is
written, in the format of ``model_last.pth``.

Under DDP every rank averages its own replica of the (identical) weights, so
the averages are identical without communication. Sharded training (FSDP)
is not supported yet: each rank would need the average of its own shards only.
"""

from __future__ import annotations

import re

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.errors import CheckpointError, ConfigError
from pimm.utils.domains import Key, PosInt, Real

__all__ = ["EMAHook", "ema_decay"]

EMA_PREFIX = "val_ema"


def ema_decay(decay: float, averaged: int, warmup: bool = True) -> float:
    """The decay of the update that follows ``averaged`` averaged weights (>= 1)."""
    return min(decay, (1.0 + averaged) / (10.0 + averaged)) if warmup else decay


def _is_sharded(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a build without torch.distributed cannot shard
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


@HOOKS.register_module()
class EMAHook(HookBase):
    """Options:

    decay: the long-run decay in (0, 1) (0.999: an average over ~1000 updates).
    warmup: ramp the decay up as ``min(decay, (1 + n) / (10 + n))`` (see the module docstring).
    update_every: average after every K-th real optimizer update.
    evaluate: also evaluate the averaged weights at every evaluation (``val_ema/...``).
    export: write ``model/model_ema.pth`` with every checkpoint.
    name: tells several averages apart (e.g. two decays): the metrics are
        ``val_<name>/...`` and the file ``model/model_<name>.pth``; two
        EMAHooks with the same name would overwrite each other's file and
        metrics, so they are refused at start-up.
    """

    # after_step: the average is updated before evaluators (NORMAL) score it
    # at the same step and before CheckpointSaver (LOW) saves it.
    priority = "ABOVE_NORMAL"

    domains = dict(decay=Real(0, 1, lo_open=True, hi_open=True), update_every=PosInt, name=Key)

    def __init__(self, decay: float = 0.999, warmup: bool = True, update_every: int = 1, evaluate: bool = True,
                 export: bool = True, name: str = "ema"):
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be a number in (0, 1) (e.g. 0.999), got {decay!r}")
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise ValueError(f"update_every must be a positive integer, got {update_every!r}")
        for option, flag in (("warmup", warmup), ("evaluate", evaluate), ("export", export)):
            if not isinstance(flag, bool):
                raise ValueError(f"{option} must be True or False, got {flag!r}")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_]+", name):
            raise ValueError(f"name must be letters, digits or '_' (it names model_<name>.pth), got {name!r}")
        self.decay, self.warmup, self.update_every = float(decay), warmup, update_every
        self.evaluate, self.export, self.name = evaluate, export, name
        self.prefix = EMA_PREFIX if name == "ema" else f"val_{name}"
        self.averaged: AveragedModel | None = None
        self.real_updates = 0  # optimizer updates that happened (skipped steps excluded)
        self._restored: dict | None = None

    @property
    def module(self) -> torch.nn.Module:
        """The averaged model (a plain module, same keys as the trained one)."""
        if self.averaged is None:
            raise RuntimeError("EMAHook: the averaged model exists once training has started")
        return self.averaged.module

    # -- set-up -------------------------------------------------------------
    def modify_config(self, cfg) -> None:
        """Refuse FSDP (not supported yet)."""
        parallel = cfg.get("parallel")
        if isinstance(parallel, dict) and parallel.get("strategy") == "fsdp":
            raise ConfigError("EMAHook does not support parallel.strategy='fsdp' yet (each rank would have to "
                              "average its own shards); train with DDP or remove EMAHook")

    def before_train(self) -> None:
        """Build the average (from restored state on resume); declare ``<prefix>/*`` (``val_ema`` by default)."""
        trainer = self.trainer
        twins = [h for h in getattr(trainer, "hooks", ()) if isinstance(h, EMAHook) and h.name == self.name]
        if len(twins) > 1:
            raise ConfigError(f"hooks: {len(twins)} EMAHook entries share name={self.name!r}: they would write one "
                              f"model/model_{self.name}.pth and one set of val_{self.name}/ metrics; give each its "
                              "own name (e.g. name='ema_slow')")
        model = trainer.model_without_ddp
        if _is_sharded(model):
            raise ConfigError("EMAHook does not support sharded (FSDP) models yet; train with DDP or remove EMAHook")
        self.averaged = AveragedModel(model, multi_avg_fn=self._average, use_buffers=True)
        self.averaged.module.requires_grad_(False)
        # Its n_averaged counter stays on the CPU: read on the host at every update.
        if self._restored is not None:
            state, self._restored = self._restored, None
            try:
                self.averaged.load_state_dict(state["averaged"])
            except (RuntimeError, KeyError) as err:
                first = str(err).splitlines()[0]
                raise CheckpointError(f"EMAHook: the averaged weights in the checkpoint do not fit the model "
                                      f"({first}); resume with the original model config") from None
            self.real_updates = int(state["real_updates"])
        if not self.evaluate:
            return
        # Declared here, before EarlyStopping's before_train (BELOW_NORMAL), which
        # learns from these declarations that val_<name>/* metrics exist.
        trainer.metrics.declare(f"{self.prefix}/loss", "min")
        for evaluator in trainer.evaluators:  # val_ema/<metric> goes the way val/<metric> goes
            if evaluator.metric_name is not None:
                trainer.metrics.declare(f"{self.prefix}/{evaluator.metric_name}",
                                        "max" if evaluator.greater_is_better else "min")

    # -- averaging ----------------------------------------------------------
    def _average(self, averaged: list[torch.Tensor], current: list[torch.Tensor], _count) -> None:
        """AveragedModel's ``multi_avg_fn``: one device/dtype group per call."""
        if averaged[0].is_floating_point() or averaged[0].is_complex():
            decay = ema_decay(self.decay, int(self.averaged.n_averaged), self.warmup)
            get_ema_multi_avg_fn(decay)(averaged, current, _count)
        else:  # integer buffers count batches: copy them
            for mine, theirs in zip(averaged, current):
                mine.copy_(theirs)

    def after_step(self) -> None:
        """Average the weights after a real optimizer update."""
        if not self.trainer.step_result.stepped:
            return  # skipped by the GradScaler or a hook: the weights did not change
        self.real_updates += 1
        if self.real_updates % self.update_every == 0:
            self.averaged.update_parameters(self.trainer.model_without_ddp)

    # -- evaluation and export ------------------------------------------------
    def after_val(self, metrics: dict, run) -> None:
        """After an evaluation of the trained weights with prefix ``val``: the same
        evaluators score the averaged weights (``<prefix>/...``), same kind."""
        if not self.evaluate or self.averaged is None or run.prefix != "val" or not run.of_trained_weights:
            return
        self.trainer.validate(run.evaluators, model=self.averaged.module, prefix=self.prefix, kind=run.kind,
                              weights=self.name)

    def before_save_checkpoint(self) -> None:
        """Have ``model/model_ema.pth`` written with this checkpoint."""
        if not self.export or self.averaged is None:
            return
        self.trainer.add_model_file(f"model_{self.name}.pth", self.averaged.module)  # written after the commit

    # -- state ----------------------------------------------------------------
    def state_dict(self) -> dict:
        """The averaged model and the count of real updates."""
        if self.averaged is None:
            return {}
        return {"averaged": self.averaged.state_dict(), "real_updates": self.real_updates}

    def load_state_dict(self, state: dict) -> None:
        """Kept until ``before_train`` builds the averaged model from the restored weights."""
        # Restored before before_train, when the averaged model is built from the restored weights.
        if state:
            self._restored = state
