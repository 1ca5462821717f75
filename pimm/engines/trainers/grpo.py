"""GRPOTrainer: group-relative policy optimisation with the engine's loop, hooks and checkpoints.

The model supplies the reinforcement-learning parts (``docs/grpo.md``):
``sample_grpo_batch(batch)`` returns a *rollout* (G scored trajectories per
event with their group advantages) and ``grpo_loss_from_batch(rollout,
update_index, policy_updates_per_rollout)`` the loss of (a micro-batch of)
it. The trainer owns the loop:

* one training batch gives one rollout, sampled under ``no_grad`` (in eval
  mode unless ``sample_in_eval_mode=False``: dropout would make the
  importance ratio differ from 1 for an unchanged policy);
* the rollout is cached and ``policy_updates_per_rollout`` optimizer updates
  are taken on it. With ``step_per="update"`` (the default) **each update is
  one global step**: hooks, logging, checkpoints and the LR schedule (sized
  rollouts x updates) all count updates, and a checkpoint may fall between
  two updates of one rollout, so the cached rollout is saved with it (per
  rank) for an exact resume. With ``step_per="rollout"`` (upstream pimm's
  counting) one step is a rollout with all its updates; the scheduler still
  steps once per update;
* the rollout's *format* is detected: pimm's (a ``trajectories`` dict of
  per-trajectory tensors, below) or upstream pimm's (a list of ``events``,
  :mod:`pimm.engines.trainers.grpo_upstream`, trained with upstream's
  chunking, weighting and metric names);
* ``trajectory_microbatch_size`` splits the rollout by whole trajectories
  and accumulates their gradients. The trainer first counts trajectories,
  active steps and the longest trajectory over the whole rollout on all
  ranks and attaches them as ``rollout["totals"]``; the model normalises by
  them (``pimm.models.grpo.objective``), so the accumulated gradient equals
  the unsplit one, and DDP's mean over ranks equals the global objective;
* the loss is computed *through* the DDP wrapper: DDP only all-reduces
  gradients of a forward pass it ran, and calling ``grpo_loss_from_batch``
  on the bare module would silently leave every rank with its own gradient.
  The trainer wraps the model in :class:`_PolicyLoss`, whose ``forward`` is
  the model's ``grpo_loss_from_batch``, and wraps that in DDP; gradients of
  all but the last micro-batch are kept local (``no_sync``);
* the update itself is the engine's :class:`~pimm.engines.optim.step.OptimStep`
  (AMP scaling, gradient sync on the last micro-batch only, clipping, the
  GradScaler skip rule, the scheduler), so ``after_backward`` hooks see the
  gradients of each update;
* scalar metrics of the micro-batches are added (their ``_min`` / ``_max``
  keys combined by min / max), published on the metric channel with a reduce
  op by key (``*_min`` -> min, ``*_max`` -> max, others mean; reduced across
  ranks at the next flush) and logged each step as ``train/<key>`` next to
  ``train/loss`` and ``train/grad_norm``. With more than one update per
  rollout, the last update also logs ``<key>_first``, ``<key>_last`` and
  ``<key>_mean`` over the rollout's updates for the loss metrics.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pimm.engines.run import data as data_lib
from pimm.engines.run.parallel import shard_model
from pimm.engines.registries import TRAINERS
from pimm.engines.optim.scheduler import build_scheduler
from pimm.engines.loop.sync_points import host_sync
from pimm.engines.trainers.default import DefaultTrainer
from pimm.engines.trainers.grpo_pimm import (_global_totals, combine_micro_batch_metrics,  # noqa: F401 (re-exported)
                                             PimmFormat, reward_health, split_rollout)
from pimm.engines.trainers.grpo_state import RolloutCache, RolloutLoaderParticipant
from pimm.engines.trainers.grpo_upstream import UpstreamFormat, is_upstream_rollout
from pimm.utils import comm
from pimm.utils.errors import ConfigError, UserError
from pimm.utils.domains import Choice, Count, Int, PosInt

__all__ = ["GRPOTrainer", "DegenerateRewards", "split_rollout", "combine_micro_batch_metrics", "PimmFormat"]

_CONTRACT = ("sample_grpo_batch", "grpo_loss_from_batch")


class DegenerateRewards(RuntimeError):
    """Every reward of every rollout in a whole epoch was NaN: nothing to learn from (exit 1)."""


_FORMATS = {"pimm": PimmFormat(), "upstream": UpstreamFormat()}


def _format_of(rollout) -> PimmFormat | UpstreamFormat:
    return _FORMATS["upstream" if is_upstream_rollout(rollout) else "pimm"]


def _scalars(values: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The scalar entries of an output (1-element tensors, numbers), as detached 0-d
    tensors on ``device`` (the metric channel reduces them in one stack per op)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = value.detach().reshape(()).to(device, non_blocking=True)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = torch.tensor(float(value), device=device)
    return out


class _PolicyLoss(nn.Module):
    """Makes ``grpo_loss_from_batch`` the forward pass, so that DDP (which wraps
    this module) runs it and all-reduces the gradients it produces."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, rollout: dict, update_index: int, policy_updates_per_rollout: int) -> dict:
        return self.policy.grpo_loss_from_batch(rollout, update_index=update_index,
                                                policy_updates_per_rollout=policy_updates_per_rollout)


def _positive_int(name: str, value, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = " or None" if allow_none else ""
        raise ConfigError(f"train.{name}={value!r} is invalid: it must be a positive integer{extra}")
    return value


STEP_PER = ("update", "rollout")


@TRAINERS.register_module()
class GRPOTrainer(DefaultTrainer):
    """Options (``train = dict(type="GRPOTrainer", ...)``), besides DefaultTrainer's:

    policy_updates_per_rollout: optimizer updates per rollout (mu).
    trajectory_microbatch_size: trajectories per micro-batch of an update; None (or 0, upstream's
        spelling) = the whole rollout (upstream-format rollouts: trajectories per slice of each event).
    step_per: "update" (default: each update is a global step) or "rollout" (upstream pimm's
        counting: a step is a rollout with all its updates).
    sample_in_eval_mode: put the model in eval mode while sampling rollouts.
    torch_threads: ``torch.set_num_threads`` for this process; None leaves torch's default.
        Small policies run fastest on one thread (more threads only contend).
    reward_warn_after: warn after this many rollouts in a row with nothing to
        learn from (every reward NaN, or no group whose rewards differ). Every
        reward NaN for a whole epoch stops the run (exit 1) naming the cause
        (pimm-format rollouts with ``rewards`` and ``event_index``).

    ``iters_per_epoch`` (iterable data) counts rollouts; an epoch has
    ``rollouts x policy_updates_per_rollout`` steps with ``step_per="update"``.
    ``grad_accum_steps`` must be 1: accumulate over trajectories with
    ``trajectory_microbatch_size`` instead.
    """

    domains = dict(policy_updates_per_rollout=PosInt, trajectory_microbatch_size=Count | None,
                   torch_threads=Int(1, 4096) | None, step_per=Choice("update", "rollout"), reward_warn_after=Count)

    def __init__(self, cfg, policy_updates_per_rollout=1, trajectory_microbatch_size=None, sample_in_eval_mode=True,
                 torch_threads=None, step_per="update", reward_warn_after=10, **options):
        self.updates_per_rollout = _positive_int("policy_updates_per_rollout", policy_updates_per_rollout)
        self.reward_warn_after = _positive_int("reward_warn_after", reward_warn_after)
        if trajectory_microbatch_size == 0 and not isinstance(trajectory_microbatch_size, bool):
            trajectory_microbatch_size = None  # upstream's "no split"
        self.trajectory_microbatch_size = _positive_int("trajectory_microbatch_size", trajectory_microbatch_size,
                                                        allow_none=True)
        if not isinstance(sample_in_eval_mode, bool):
            raise ConfigError(f"train.sample_in_eval_mode={sample_in_eval_mode!r} is invalid: use True or False")
        if step_per not in STEP_PER:
            raise ConfigError(f"train.step_per={step_per!r} is invalid: use 'update' (each policy update is a step) "
                              "or 'rollout' (a step is a rollout with all its updates, as upstream pimm)")
        self.step_per = step_per
        self.sample_in_eval_mode = sample_in_eval_mode
        if _positive_int("torch_threads", torch_threads, allow_none=True) is not None:
            torch.set_num_threads(torch_threads)
        if cfg.grad_accum_steps != 1:
            raise ConfigError(f"grad_accum_steps={cfg.grad_accum_steps} is not used by GRPOTrainer: set it to 1 and "
                              "use train.trajectory_microbatch_size to accumulate gradients over trajectories")
        self._loss_module: _PolicyLoss | None = None
        self._first_step = True
        super().__init__(cfg, **options)
        self.samples_per_step = 0  # samples are counted per rollout, in run_step
        self.optim_step.track_grad_norm = True  # grad_norm is logged every update

    def build_components(self, *args, **kwargs) -> None:
        """DefaultTrainer's components and the rollout cache."""
        super().build_components(*args, **kwargs)
        # A rollout's objects (upstream's trajectory classes) are rebuilt on resume only from the
        # policy's own module and custom_imports: code the config already runs.
        trusted = (type(self.model_without_ddp).__module__, *(self.cfg.get("custom_imports") or ()))
        self._cache = RolloutCache(self.device, self.step_per, trusted_modules=trusted)

    def extra_state(self) -> list[tuple]:
        """The cached rollout (per rank): a checkpoint between two updates of a
        rollout resumes with the same rollout."""
        return [("grpo_rollout", self._cache, "rank")]

    @property
    def steps_per_rollout(self) -> int:
        """Global steps one rollout makes: its updates, or 1 with ``step_per="rollout"``."""
        return self.updates_per_rollout if self.step_per == "update" else 1

    # -- builders --------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        """The policy model; it must provide the GRPO contract (docs/grpo.md)."""
        model = super().build_model()
        missing = [name for name in _CONTRACT if not callable(getattr(model, name, None))]
        if missing:
            raise ConfigError(f"GRPOTrainer needs a policy model: {type(model).__name__} has no "
                              f"{' / '.join(missing)} (see docs/grpo.md)")
        return model

    loader_participant = RolloutLoaderParticipant
    headline_metric = ("train/reward_mean", "max")  # the rollouts' mean reward: what the policy optimises
    supports_compile = False  # rollouts call the policy's methods, which torch.compile does not wrap

    def wrap_model(self, model: nn.Module) -> nn.Module:
        self._loss_module = _PolicyLoss(model)
        if self.world_size == 1:
            return model
        if self.parallel.fsdp:  # the loss module is the FSDP root: its forward gathers the policy
            return shard_model(self._loss_module, self.parallel, self.device, self.world_size, self.logger,
                               keep_frozen_whole=True)  # the frozen reference policy is written at the first rollout
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(self._loss_module, device_ids=device_ids,
                                       find_unused_parameters=self.options["find_unused_parameters"])

    def iters_for_batches(self, batches: int) -> int:
        return batches * self.steps_per_rollout

    def _compute_iters_per_epoch(self) -> int:
        iters = super()._compute_iters_per_epoch()
        # An explicit iters_per_epoch counts rollouts (batches), as a derived one does.
        return iters * self.steps_per_rollout if self.explicit_iters_per_epoch() is not None else iters

    def build_scheduler(self):
        """The schedule, sized in optimizer updates (it steps once per update, whatever a step is;
        once every ``scheduler_interval`` updates when that is set)."""
        spec = self.cfg.scheduler if self.cfg.scheduler is not None else dict(type="ConstantLR")
        updates_per_step = self.updates_per_rollout // self.steps_per_rollout
        updates = self.iters_per_epoch * self.max_epoch * updates_per_step
        return build_scheduler(spec, self.optimizer,
                               total_steps=max(1, updates // self.cfg.get("scheduler_interval", 1)))

    # -- the step ------------------------------------------------------------------------
    def _sample_rollout(self, batch) -> dict:
        model = self.model_without_ddp
        was_training = model.training
        if self.sample_in_eval_mode:
            model.eval()
        try:
            with torch.no_grad(), self.autocast(), self.full_parameters():
                rollout = model.sample_grpo_batch(batch)
        finally:
            model.train(was_training)
        _format_of(rollout).prepare(rollout, type(model).__name__)
        return rollout

    def _watch_rewards(self, cache: RolloutCache) -> None:
        """Warn after ``reward_warn_after`` rollouts in a row with nothing to
        learn from (every reward NaN, or no group whose rewards differ: every
        advantage 0); stop (exit 1) once every rollout of a whole epoch had only
        NaN rewards. Rollouts without per-trajectory ``rewards`` and
        ``event_index`` tensors (upstream's format) are not watched."""
        trajectories = cache.rollout.get("trajectories")
        health = reward_health(trajectories) if isinstance(trajectories, dict) else None
        if health is None:
            return
        finite, groups, spread = health
        cache.all_nan_run = cache.all_nan_run + 1 if finite == 0 else 0
        cache.useless_run = cache.useless_run + 1 if finite == 0 or spread == 0 else 0
        rollouts_per_epoch = max(1, self.iters_per_epoch // self.steps_per_rollout)
        if cache.all_nan_run >= rollouts_per_epoch:
            raise DegenerateRewards(
                f"GRPO: every reward was NaN in the last {cache.all_nan_run} rollouts (a whole epoch, up to step "
                f"{self.global_step}): {type(self.model_without_ddp).__name__} cannot score its trajectories, so "
                "every advantage is 0 and nothing is learnt; fix the reward")
        if cache.useless_run == self.reward_warn_after:
            what = "every reward was NaN" if cache.all_nan_run >= cache.useless_run else \
                "no group of trajectories had rewards that differ (every advantage 0)"
            self.logger.warning(f"GRPO: {what} in the last {cache.useless_run} rollouts (step {self.global_step}); "
                                "the policy learns nothing from such rollouts: check the reward, or raise "
                                "num_generations / the sampling temperature")

    def _policy_loss(self, micro_batch: dict, update_index: int) -> dict:
        call = self.model if self.model is not self.model_without_ddp else self._loss_module
        return call(micro_batch, update_index=update_index, policy_updates_per_rollout=self.updates_per_rollout)

    def _new_rollout(self) -> dict:
        """Take a batch, sample its rollout into the cache; the scalars to log with it."""
        batch = self.next_batch()
        tracer = self.tracer
        t = tracer.now()
        # A rollout may make the host wait for the device, once per rollout (not per update):
        # sampling decides on the host when every trajectory has stopped, the global totals
        # (trajectories, active steps, longest trajectory) that normalise the loss are host
        # numbers all-reduced across ranks, and the reward-health check that warns or stops
        # the run reads the rewards. The updates that follow queue device work only.
        with host_sync("rollout"):
            rollout = self._sample_rollout(batch)
            self._cache.start(rollout, batch)
            tracer.complete("rollout", t)
            self._watch_rewards(self._cache)
            if tracer.batch_stats_every:
                tracer.counter("rollout", **{"events": self.batch_size_per_rank,
                                             **_format_of(rollout).batch_stats(rollout)})
            avg_pts = data_lib.points_per_sample([data_lib.point_batch_size(batch)])
        self.train_state.samples_seen += self.batch_size_per_rank * self.world_size
        return {} if avg_pts is None else {"avg_pts": avg_pts}

    def _update(self, update_index: int) -> dict[str, torch.Tensor]:
        """One optimizer update on the cached rollout; its scalars (also kept in the history)."""
        cache, optim_step, tracer = self._cache, self.optim_step, self.tracer
        fmt = _format_of(cache.rollout)
        t = tracer.now()
        chunks = fmt.chunks(cache.rollout, self.trajectory_microbatch_size)
        if self.world_size > 1 and self.trajectory_microbatch_size is not None:
            _check_same_count(len(chunks))
        outputs = []
        for index, (chunk, weight) in enumerate(chunks):
            with optim_step.sync(last=index == len(chunks) - 1):
                with self.autocast():
                    output = self._policy_loss(chunk, update_index)
                loss = output.get("loss") if isinstance(output, dict) else None
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise UserError(f"{type(self.model_without_ddp).__name__}.grpo_loss_from_batch must return a "
                                    "dict with a scalar 'loss' tensor (see docs/grpo.md)")
                optim_step.backward(loss if weight is None else loss * weight)
            outputs.append((output, weight))
        metrics = _scalars(fmt.combine(outputs, self.model_without_ddp, cache.rollout), self.device)
        self.comm_info["model_output_dict"] = metrics
        cache.history.append(metrics)
        self.step_result = result = optim_step.step()
        tracer.complete("policy_update", t)
        step = {**metrics, "grad_norm": result.grad_norm}
        if optim_step.scaler is not None:
            step["amp_step_skipped"] = torch.tensor(0.0 if result.stepped else 1.0, device=self.device)
        return step

    def run_step(self) -> None:
        info = self.begin_step()
        updates, cache = self.updates_per_rollout, self._cache
        if self.step_per == "rollout":
            scalars = self._new_rollout()
            steps = [self._update(update_index) for update_index in range(updates)]
            scalars.update(steps[-1])  # the last update's values, as upstream logs them
            scalars["loss"] = torch.stack([s["loss"] for s in steps]).mean()
            if "amp_step_skipped" in scalars:  # the fraction of the rollout's updates the scaler skipped
                scalars["amp_step_skipped"] = torch.stack([s["amp_step_skipped"] for s in steps]).mean()
            last = True
        else:
            update_index = self.iter % updates
            if self._first_step and update_index != 0 and comm.any_rank(cache.rollout is None):
                raise UserError(
                    f"the checkpoint at step {self.global_step} was taken between two updates of a rollout, and "
                    "not every process has that rollout (the number of processes changed?); resume with the "
                    "number of processes that saved it")
            scalars = self._new_rollout() if update_index == 0 else {}
            scalars.update(self._update(update_index))
            last = update_index == updates - 1
        self._first_step = False
        fmt = _format_of(cache.rollout)
        scalars.update(fmt.rollout_metrics(cache.rollout))
        if last:
            scalars.update(fmt.summarize_updates(cache.history))
        info["input_dict"], info["loss"] = cache.batch, scalars["loss"]
        info["model_output_dict"] = {k: v for k, v in scalars.items() if k != "grad_norm"}
        scalars = {f"train/{k}": v for k, v in scalars.items() if v is not None}
        scalars["train/lr"] = self.step_result.lr
        self.metrics.publish(scalars, reduce={k: fmt.reduce_op(k) for k in scalars}, dense=True,
                             step=self.train_state.global_step + 1)
        self.metrics.record("time/data", self._data_time)
        if last:
            cache.clear()  # the next step samples a new rollout; nothing to checkpoint


def _check_same_count(chunks: int) -> None:
    """Every rank runs the same number of forward passes through DDP (uneven rollouts would hang it)."""
    counts = torch.tensor([float(chunks), -float(chunks)])
    comm.all_reduce(counts, op="max")
    if counts[0].item() != -counts[1].item():
        raise UserError(f"GRPOTrainer: the processes' rollouts split into different numbers of micro-batches "
                        f"({int(-counts[1].item())} to {int(counts[0].item())}); every process must sample the same "
                        "number of trajectories per event (or set trajectory_microbatch_size=None)")
