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
  are taken on it. **Each update is one global step**: hooks, logging,
  checkpoints and the LR schedule (sized rollouts x updates) all count
  updates, and a checkpoint may fall between two updates of one rollout, so
  the cached rollout is saved with it (per rank) for an exact resume;
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
* the update itself is the engine's :class:`~pimm.engines.optim_step.OptimStep`
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

import math

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from pimm.engines.metrics import reduce_op_by_suffix
from pimm.engines.parallel import shard_model
from pimm.engines.registries import TRAINERS
from pimm.engines.state.participants import LoaderParticipant
from pimm.engines.sync_points import host_sync
from pimm.engines.trainers.default import DefaultTrainer
from pimm.utils import comm
from pimm.utils.errors import CheckpointError, ConfigError, UserError

__all__ = ["GRPOTrainer", "split_rollout", "combine_micro_batch_metrics"]

_CONTRACT = ("sample_grpo_batch", "grpo_loss_from_batch")


# -- metrics --------------------------------------------------------------------------
def combine_micro_batch_metrics(outputs: list[dict]) -> dict[str, torch.Tensor]:
    """One update's scalars from its micro-batches' outputs: each micro-batch
    reports its additive share (see docs/grpo.md), so values are summed;
    ``*_min`` / ``*_max`` keys take the min / max. Non-scalar outputs are ignored."""
    combined: dict[str, torch.Tensor] = {}
    for output in outputs:
        for key, value in output.items():
            if not isinstance(value, torch.Tensor) or value.numel() != 1:
                continue
            value = value.detach().reshape(())
            if key not in combined:
                combined[key] = value
            elif key.endswith("_min"):
                combined[key] = torch.minimum(combined[key], value)
            elif key.endswith("_max"):
                combined[key] = torch.maximum(combined[key], value)
            else:
                combined[key] = combined[key] + value
    return combined


# -- rollouts ---------------------------------------------------------------------------
def split_rollout(rollout: dict, size: int | None) -> list[dict]:
    """Micro-batches of at most ``size`` whole trajectories (in order). Only the
    per-trajectory tensors (``rollout["trajectories"]``) are sliced; everything
    else (context, totals) is shared."""
    trajectories = rollout["trajectories"]
    count = len(next(iter(trajectories.values())))
    if size is None or size >= count:
        return [rollout]
    return [{**rollout, "trajectories": {k: v[start:start + size] for k, v in trajectories.items()}}
            for start in range(0, count, size)]


def _check_rollout(rollout, model_name: str) -> None:
    where = f"{model_name}.sample_grpo_batch"
    if not isinstance(rollout, dict) or not isinstance(rollout.get("trajectories"), dict):
        raise UserError(f"{where} must return a dict with a 'trajectories' dict of per-trajectory tensors "
                        "(see docs/grpo.md)")
    trajectories = rollout["trajectories"]
    mask = trajectories.get("action_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise UserError(f"{where}: trajectories['action_mask'] must be a (trajectories, steps) tensor")
    lengths = {k: v.shape[0] if isinstance(v, torch.Tensor) and v.dim() else None for k, v in trajectories.items()}
    wrong = [f"{k} ({n})" for k, n in lengths.items() if n != mask.shape[0]]
    if wrong:
        raise UserError(f"{where}: every trajectories entry must be a tensor with one row per trajectory "
                        f"({mask.shape[0]}); not so for {', '.join(wrong)}")


def _global_totals(action_mask: torch.Tensor) -> dict:
    """Trajectories, active steps and the longest trajectory over all ranks."""
    mask = action_mask.bool()
    counts = torch.tensor([float(mask.shape[0]), float(mask.sum())], dtype=torch.float64)
    longest = torch.tensor(float(mask.sum(1).max()) if mask.numel() else 0.0, dtype=torch.float64)
    comm.all_reduce(counts, op="sum")
    comm.all_reduce(longest, op="max")
    return {"trajectories": counts[0].item(), "steps": counts[1].item(), "max_length": longest.item(),
            "world_size": comm.get_world_size()}


def _move(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_move(v, device) for v in obj)
    return obj


def _reward_health(trajectories: dict) -> tuple[float, float, float] | None:
    """(finite rewards, groups, groups whose finite rewards differ), summed over
    ranks; None when the rollout has no ``rewards`` / ``event_index``."""
    rewards, groups = trajectories.get("rewards"), trajectories.get("event_index")
    if not isinstance(rewards, torch.Tensor) or not isinstance(groups, torch.Tensor) or rewards.dim() != 1:
        return None
    rewards, groups = rewards.detach().double().cpu(), groups.detach().long().cpu()
    finite = torch.isfinite(rewards)
    spread = 0
    if groups.numel():
        _, groups = torch.unique(groups, return_inverse=True)
        count = int(groups.max()) + 1
        high = torch.full((count,), -math.inf, dtype=torch.float64).scatter_reduce(
            0, groups[finite], rewards[finite], "amax")
        low = torch.full((count,), math.inf, dtype=torch.float64).scatter_reduce(
            0, groups[finite], rewards[finite], "amin")
        spread = int((high > low).sum())
        total = count
    else:
        total = 0
    counts = torch.tensor([float(finite.sum()), float(total), float(spread)], dtype=torch.float64)
    comm.all_reduce(counts, op="sum")
    return counts[0].item(), counts[1].item(), counts[2].item()


class DegenerateRewards(RuntimeError):
    """Every reward of every rollout in a whole epoch was NaN: nothing to learn from (exit 1)."""


class _RolloutCache:
    """The rollout being trained on and its updates' metrics so far; a per-rank
    checkpoint participant (a checkpoint may fall between two updates)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.rollout: dict | None = None
        self.batch: dict | None = None  # for hooks' input_dict only; not checkpointed
        self.history: list[dict[str, torch.Tensor]] = []
        self.all_nan_run = 0  # rollouts in a row whose rewards were all NaN
        self.useless_run = 0  # rollouts in a row with nothing to learn (all NaN, or no group with a spread)

    def start(self, rollout: dict, batch) -> None:
        self.rollout, self.batch, self.history = rollout, batch, []

    def clear(self) -> None:
        self.rollout = self.batch = None
        self.history = []

    def over_updates(self, metrics: dict[str, torch.Tensor], last: bool) -> dict[str, torch.Tensor]:
        """Record this update's metrics; at the rollout's last update return
        ``<key>_first`` / ``_last`` / ``_mean`` over its updates."""
        self.history.append(metrics)
        if not last or len(self.history) < 2:
            return {}
        summary = {}
        for key in metrics:
            values = [h[key] for h in self.history if key in h]
            summary[f"{key}_first"], summary[f"{key}_last"] = values[0], values[-1]
            summary[f"{key}_mean"] = torch.stack(values).mean()
        return summary

    def state_dict(self) -> dict:
        return {"rollout": _move(self.rollout, "cpu"), "history": _move(self.history, "cpu"),
                "all_nan_run": self.all_nan_run, "useless_run": self.useless_run}

    def load_state_dict(self, state: dict) -> None:
        self.rollout = _move(state["rollout"], self.device)
        self.history = list(state["history"])
        self.all_nan_run = int(state.get("all_nan_run", 0))  # absent from checkpoints before round 3
        self.useless_run = int(state.get("useless_run", 0))
        self.batch = None


class _RolloutLoaderParticipant(LoaderParticipant):
    """The data position in batches consumed: a rollout's batch is taken at its
    first update, so after ``i`` updates ``ceil(i / updates)`` batches are gone."""

    def state_dict(self) -> dict:
        state = super().state_dict()
        if state["kind"] == "position":
            trainer = self.trainer
            batches = math.ceil(trainer.train_state.iter_in_epoch / trainer.updates_per_rollout)
            state["samples_in_epoch"] = batches * trainer.batch_size_per_rank * trainer.world_size
        return state

    def restore(self, state, context) -> None:
        if context.layout_changed:
            raise CheckpointError(
                f"checkpoint {context.path.name}: a GRPO run resumes with the process layout that saved it "
                f"(changed: {', '.join(context.layout_changed)}); resume with the same number of processes, "
                "batch size and workers")
        super().restore(state, context)


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


@TRAINERS.register_module()
class GRPOTrainer(DefaultTrainer):
    """Options (``train = dict(type="GRPOTrainer", ...)``), besides DefaultTrainer's:

    policy_updates_per_rollout: optimizer updates (global steps) per rollout (mu).
    trajectory_microbatch_size: trajectories per micro-batch of an update; None = the whole rollout.
    sample_in_eval_mode: put the model in eval mode while sampling rollouts.
    torch_threads: ``torch.set_num_threads`` for this process; None leaves torch's default.
        Small policies run fastest on one thread (more threads only contend).
    reward_warn_after: warn after this many rollouts in a row with nothing to
        learn from (every reward NaN, or no group whose rewards differ). Every
        reward NaN for a whole epoch stops the run (exit 1) naming the cause.

    ``iters_per_epoch`` (iterable data) counts rollouts; an epoch has
    ``rollouts x policy_updates_per_rollout`` steps. ``grad_accum_steps`` must be 1:
    accumulate over trajectories with ``trajectory_microbatch_size`` instead.
    """

    def __init__(self, cfg, policy_updates_per_rollout=1, trajectory_microbatch_size=None, sample_in_eval_mode=True,
                 torch_threads=None, reward_warn_after=10, **options):
        self.updates_per_rollout = _positive_int("policy_updates_per_rollout", policy_updates_per_rollout)
        self.reward_warn_after = _positive_int("reward_warn_after", reward_warn_after)
        self.trajectory_microbatch_size = _positive_int("trajectory_microbatch_size", trajectory_microbatch_size,
                                                        allow_none=True)
        if not isinstance(sample_in_eval_mode, bool):
            raise ConfigError(f"train.sample_in_eval_mode={sample_in_eval_mode!r} is invalid: use True or False")
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
        if self.mode == "train":
            self._cache = _RolloutCache(self.device)
            self.track("grpo_rollout", self._cache, scope="rank")
            self.optim_step.track_grad_norm = True  # grad_norm is logged every update

    # -- builders --------------------------------------------------------------------
    def build_model(self) -> nn.Module:
        model = super().build_model()
        missing = [name for name in _CONTRACT if not callable(getattr(model, name, None))]
        if missing and self.mode == "train":
            raise ConfigError(f"GRPOTrainer needs a policy model: {type(model).__name__} has no "
                              f"{' / '.join(missing)} (see docs/grpo.md)")
        return model

    loader_participant = _RolloutLoaderParticipant

    def wrap_model(self, model: nn.Module) -> nn.Module:
        if (self.cfg.get("compile") or {}).get("enabled"):  # rollouts call methods torch.compile does not wrap
            raise ConfigError("compile: GRPOTrainer does not support torch.compile yet; set compile=dict(enabled=False)")
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
        return batches * self.updates_per_rollout

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
        _check_rollout(rollout, type(model).__name__)
        rollout["totals"] = _global_totals(rollout["trajectories"]["action_mask"])
        return rollout

    def _watch_rewards(self, cache: "_RolloutCache") -> None:
        """Warn after ``reward_warn_after`` rollouts in a row with nothing to
        learn from (every reward NaN, or no group whose rewards differ: every
        advantage 0); stop (exit 1) once every rollout of a whole epoch had only
        NaN rewards."""
        health = _reward_health(cache.rollout["trajectories"])
        if health is None:
            return
        finite, groups, spread = health
        cache.all_nan_run = cache.all_nan_run + 1 if finite == 0 else 0
        cache.useless_run = cache.useless_run + 1 if finite == 0 or spread == 0 else 0
        rollouts_per_epoch = max(1, self.iters_per_epoch // self.updates_per_rollout)
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

    def run_step(self) -> None:
        info = self.comm_info
        info["input_dict"] = info["model_output_dict"] = info["loss"] = None
        self._data_time = 0.0
        updates = self.updates_per_rollout
        update_index = self.iter % updates
        cache = self._cache
        if self._first_step:
            self._first_step = False
            if update_index != 0 and comm.any_rank(cache.rollout is None):
                raise UserError(
                    f"the checkpoint at step {self.global_step} was taken between two updates of a rollout, and "
                    "not every process has that rollout (the number of processes changed?); resume with the "
                    "number of processes that saved it")
        tracer = self.tracer
        if update_index == 0:
            batch = self.next_batch()
            t = tracer.now()
            # A rollout may make the host wait for the device, once per rollout (not per update):
            # sampling decides on the host when every trajectory has stopped, the global totals
            # (trajectories, active steps, longest trajectory) that normalise the loss are host
            # numbers all-reduced across ranks, and the reward-health check that warns or stops
            # the run reads the rewards. The updates that follow queue device work only.
            with host_sync("rollout"):
                cache.start(self._sample_rollout(batch), batch)
                tracer.complete("rollout", t)
                self._watch_rewards(cache)
            self.train_state.samples_seen += self.batch_size_per_rank * self.world_size
        t = tracer.now()
        micro_batches = split_rollout(cache.rollout, self.trajectory_microbatch_size)
        outputs = []
        optim_step = self.optim_step
        for index, micro in enumerate(micro_batches):
            with optim_step.sync(last=index == len(micro_batches) - 1):
                with self.autocast():
                    output = self._policy_loss(micro, update_index)
                loss = output.get("loss") if isinstance(output, dict) else None
                if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                    raise UserError(f"{type(self.model_without_ddp).__name__}.grpo_loss_from_batch must return a "
                                    "dict with a scalar 'loss' tensor (see docs/grpo.md)")
                optim_step.backward(loss)
            outputs.append(output)
        metrics = combine_micro_batch_metrics(outputs)
        info["input_dict"], info["loss"] = cache.batch, metrics["loss"]
        info["model_output_dict"] = {**metrics, **cache.rollout.get("metrics", {})}
        self.step_result = result = optim_step.step()
        tracer.complete("policy_update", t)
        scalars = {**metrics, **cache.rollout.get("metrics", {}), "grad_norm": result.grad_norm}
        if optim_step.scaler is not None:
            scalars["amp_step_skipped"] = torch.tensor(0.0 if result.stepped else 1.0)
        tracked = {k: v for k, v in metrics.items() if reduce_op_by_suffix(k) == "mean"}
        scalars.update(cache.over_updates(tracked, last=update_index == updates - 1))
        scalars = {f"train/{k}": v.detach() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()
                   if v is not None}
        scalars["train/lr"] = result.lr
        self.metrics.publish(scalars, reduce={k: reduce_op_by_suffix(k) for k in scalars}, dense=True,
                             step=self.train_state.global_step + 1)
        self.metrics.record("time/data", self._data_time)
        if update_index == updates - 1:
            cache.clear()  # the next step samples a new rollout; nothing to checkpoint
