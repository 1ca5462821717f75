"""Checkpoint participants: the :class:`Participant` protocol, the adapter for
plain ``state_dict`` / ``load_state_dict`` objects, the participants that wrap
a component to give it the restore rules of :mod:`pimm.engines.state.restore`,
and the ones that are not components: the RNG streams, the hooks' states, the
data position and the run's metadata.

Every participant restores itself through ``restore(state, context)``, which
receives the :class:`~pimm.engines.state.restore.RestoreContext` (to adapt
when the process layout changed, or to report what the config changed).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from pimm.engines.run.data import train_sampler
from pimm.engines.state.plain_values import decode, encode
from pimm.engines.state.renamed_weights import upgrade_model_state
from pimm.engines.state.train_state import LAYOUT_FIELDS, TrainState
from pimm.engines.state.weight_file import strip_wrapper_prefixes
from pimm.utils.errors import CheckpointError, ConfigError
from pimm.utils.rng import capture_rng_state, restore_rng_state

__all__ = ["Participant", "StateDictParticipant", "as_participant", "apply_configured_groups", "ModelParticipant", "OptimizerParticipant", "SchedulerParticipant", "TrainStateParticipant",
           "RNGParticipant", "HooksParticipant", "MetaParticipant", "LoaderParticipant"]


@runtime_checkable
class Participant(Protocol):
    """What a checkpoint holds a piece of: ``trainer.track(name, participant)``.

    ``state_dict()`` is called on every rank at every checkpoint (gathering a
    sharded state may be a collective); rank 0 writes the ``shared`` ones,
    every rank its own ``rank`` ones. ``restore(state, context)`` takes it back
    on resume; ``state`` is None for a per-rank participant whose state cannot
    be matched to this rank (another world size), and ``context`` (a
    :class:`~pimm.engines.state.restore.RestoreContext`) is where it reports
    what it could not restore exactly and what the config overrides.

    Restore order: participants restore in registration order (the order of
    the ``track`` calls, which is the checkpoint layout): FSDP's sharded
    model and optimizer first, then the shared participants, then the
    per-rank ones, of which the hooks' states come last; then the trainer
    dispatches ``after_load_checkpoint``, and only then ``before_train``. So
    a participant may rely on everything tracked before it (the optimizer on
    the model, the loader position on the train state), and every hook sees
    the whole restored state.

    An object with ``state_dict`` / ``load_state_dict`` only (a GradScaler,
    the metric channel) is adapted by :class:`StateDictParticipant`.
    """

    def state_dict(self) -> Any:
        """The state to save (anything ``torch.save`` writes with weights_only loading)."""

    def restore(self, state: Any, context: Any) -> None:
        """Take back what :meth:`state_dict` returned (``state`` may be None, see above)."""


class StateDictParticipant:
    """A :class:`Participant` over a plain object with ``state_dict`` /
    ``load_state_dict``: a missing state (another world size) leaves it as built."""

    def __init__(self, obj: Any):
        self.obj = obj

    def state_dict(self) -> Any:
        """The wrapped object's ``state_dict()``."""
        return self.obj.state_dict()

    def restore(self, state: Any, context: Any) -> None:
        """``load_state_dict(state)`` when there is a state."""
        if state is not None:
            self.obj.load_state_dict(state)

    def __repr__(self) -> str:
        return f"StateDictParticipant({type(self.obj).__name__})"


def as_participant(obj: Any) -> Participant:
    """``obj`` itself when it is a :class:`Participant`, else wrapped in
    :class:`StateDictParticipant`; anything else is a TypeError naming it."""
    if isinstance(obj, Participant):
        return obj
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return StateDictParticipant(obj)
    raise TypeError(f"{type(obj).__name__} cannot be a checkpoint participant: it needs state_dict() and "
                    "restore(state, context) or load_state_dict(state)")


def check_model_fits(model, own_shapes: dict, saved_shapes: dict, context) -> None:
    """One-line error when a checkpoint's weights (name -> shape, ``None``
    where unknown) do not fit the model's: missing, unexpected, other shapes."""
    missing = [k for k in own_shapes if k not in saved_shapes]
    unexpected = [k for k in saved_shapes if k not in own_shapes]
    mismatched = [f"{k} {saved_shapes[k]} vs {shape}" for k, shape in own_shapes.items()
                  if saved_shapes.get(k) is not None and saved_shapes[k] != shape]
    if missing or unexpected or mismatched:
        parts = [f"{label} {', '.join(keys[:5])}{' ...' if len(keys) > 5 else ''}"
                 for label, keys in (("missing", missing), ("unexpected", unexpected),
                                     ("shape-mismatched", mismatched)) if keys]
        raise CheckpointError(
            f"checkpoint {context.path.name} does not fit model {type(model).__name__} "
            f"({'; '.join(parts)}): the model config changed since it was saved; resume it with the "
            "original model config, or start a new run (a new save_path) with weight=<model file>")


class ModelParticipant:
    """Model weights; a checkpoint that does not fit the model is a one-line error."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        """The model's state dict."""
        return self.model.state_dict()

    def restore(self, state: dict, context) -> None:
        """Load the weights; a checkpoint that does not fit is a CheckpointError."""
        # pimm saves the plain module; a file written through a compiled or DDP
        # wrapper by other code still fits.
        state = {strip_wrapper_prefixes(k): v for k, v in state.items()}
        state, renamed = upgrade_model_state(self.model, state)  # a checkpoint in the model's older names
        if renamed is not None:
            context.renamed_parameters = renamed
            context.note(f"{context.path.name}: weights saved under {type(self.model).__name__}'s older parameter "
                         "names, taken under the current ones")
        own = self.model.state_dict()
        check_model_fits(self.model, {k: tuple(v.shape) for k, v in own.items()},
                         {k: tuple(v.shape) if hasattr(v, "shape") else None for k, v in state.items()}, context)
        self.model.load_state_dict(state)


class OptimizerParticipant:
    """Optimizer state (moments, step counts) comes from the checkpoint; every
    param-group value (lr and its schedule bookkeeping, weight decay, betas,
    momentum, ...) comes from the config, so an edited config takes effect on
    resume. The scheduler then sets the lr (and a cycled momentum) for the
    restored step. ``unreported``: keys that differ by design between a saved
    step and a fresh build (the lr, a cycled momentum), not listed as changes."""

    def __init__(self, optimizer: torch.optim.Optimizer, unreported: tuple[str, ...] = ("lr",)):
        self.optimizer = optimizer
        self.unreported = set(unreported)

    def state_dict(self) -> dict:
        """The optimizer's state dict."""
        return self.optimizer.state_dict()

    def restore(self, state: dict, context) -> None:
        """Moments and step counts from ``state``, param-group values from the config."""
        configured = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        saved_groups = state.get("param_groups", [])
        if len(saved_groups) != len(configured):
            raise CheckpointError(
                f"checkpoint {context.path.name} has {len(saved_groups)} optimizer param groups, the config builds "
                f"{len(configured)} (param_dicts changed?): resume with the original optimizer config"
            )
        if getattr(context, "renamed_parameters", None) is not None:  # the moments follow their parameters
            state = context.renamed_parameters.optimizer_state(self.optimizer, state)
        try:
            self.optimizer.load_state_dict(state)
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"checkpoint {context.path.name}: the optimizer state does not fit "
                                  f"({err}); resume with the original model and optimizer config") from None
        apply_configured_groups(self.optimizer, configured, saved_groups, self.unreported, context)


def apply_configured_groups(optimizer, configured: list[dict], saved_groups: list[dict], unreported: set,
                            context) -> None:
    """Put the config's param-group values back after a load, listing each one
    that differs from the checkpoint's (except ``unreported`` keys)."""
    for index, (group, values, saved) in enumerate(zip(optimizer.param_groups, configured, saved_groups)):
        for key, value in values.items():
            if key not in unreported and saved.get(key) != value:
                what = "lr" if key == "initial_lr" else key
                context.config_wins(f"optimizer group {group.get('name', index)} {what}", saved.get(key), value)
            group[key] = value


class SchedulerParticipant:
    """The schedule's progress comes from the checkpoint, its parameters
    (length, warm-up, milestones, base lrs) from the config: pimm's schedulers
    load only their step counters (see :mod:`pimm.engines.optim.scheduler`)."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        """The scheduler's state dict."""
        return self.scheduler.state_dict()

    def restore(self, state: dict, context) -> None:
        """The schedule's progress; parameters the config changed are reported."""
        for key in ("total_steps", "warmup_steps", "milestones", "gamma", "power"):
            if key in state and hasattr(self.scheduler, key) and state[key] != getattr(self.scheduler, key):
                context.config_wins(f"scheduler {key}", state[key], getattr(self.scheduler, key))
        total, done = getattr(self.scheduler, "total_steps", None), state.get("last_epoch")
        if isinstance(total, int) and isinstance(done, int) and done > total:
            # Checked here, before the schedule is asked for an lr it cannot give.
            raise ConfigError(
                f"resume: the LR schedule now lasts {total} optimizer steps but the run is already at step {done} "
                f"(the checkpoint's schedule had {state.get('total_steps', '?')}): epoch, batch_size, the data size "
                "or the world size now give fewer steps than the run has done. Resume without those overrides "
                "(the run's own config.py is used), or raise epoch (nothing was changed)")
        self.scheduler.load_state_dict(state)


class TrainStateParticipant:
    """The position in training. Under a changed process layout the current
    layout is kept and the old one is reported to the context."""

    def __init__(self, train_state: TrainState):
        self.train_state = train_state

    def state_dict(self) -> dict:
        """Epoch, steps, samples seen, the process layout."""
        return self.train_state.state_dict()

    def restore(self, state: dict, context) -> None:
        """The position; the saved layout goes to ``context`` when it differs."""
        current = self.train_state.layout()
        self.train_state.load_state_dict(state)
        context.saved_train_state = TrainState(**{k: v for k, v in state.items()
                                                  if k in TrainState.__dataclass_fields__})
        changed = {k: (state.get(k), current[k]) for k in LAYOUT_FIELDS if state.get(k) != current[k]}
        context.layout_changed = changed
        self.train_state.load_state_dict(current)


class RNGParticipant:
    """The process's RNG streams (per rank). Under another world size the
    streams cannot be matched to ranks; the current ones are kept."""

    def state_dict(self) -> dict:
        """Python, NumPy, torch CPU and CUDA RNG states."""
        return capture_rng_state()

    def restore(self, state: dict | None, context) -> None:
        """Restore the streams; without a state (another world size) report it as inexact."""
        if state is None:
            context.inexact("the per-rank random streams")
            return
        restore_rng_state(state)


class MetaParticipant:
    """What a resume compares against: the config and the schedule length."""

    def __init__(self, config_flat: dict, total_steps: int):
        self.meta = {"config_flat": config_flat, "total_steps": total_steps}

    def state_dict(self) -> dict:
        """The flattened config and the schedule length."""
        return self.meta

    def restore(self, state: dict, context) -> None:
        """Hand the saved config to ``context`` (to report what changed)."""
        context.saved_config_flat = state.get("config_flat", {})


class HooksParticipant:
    """All hooks' states (per rank), matched back by position and type."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> list:
        """Every hook's ``state_dict()`` with its type, in priority order (NumPy
        values and deques as plain data: :mod:`pimm.engines.state.plain_values`)."""
        return [{"type": type(h).__name__, "state": encode(h.state_dict())} for h in self.trainer.hooks]

    def restore(self, states: list | None, context) -> None:
        """Each hook's ``load_state_dict``, matched by position and type (by type in
        order of appearance when the hooks changed; rank 0's under another world size)."""
        if states is None:
            # Another world size: every rank takes rank 0's hook states, which
            # hold the run's shared decisions (counters, patience, revisions).
            states = context.rank0_state("hooks")
            if states is None:
                return
        hooks = self.trainer.hooks
        if [s["type"] for s in states] != [type(h).__name__ for h in hooks]:
            context.note("the hooks differ from the checkpoint's; hook states were restored by type in order "
                         "of appearance")
            by_type: dict[str, list] = {}
            for s in states:
                by_type.setdefault(s["type"], []).append(s["state"])
            for hook in hooks:
                queue = by_type.get(type(hook).__name__)
                if queue:
                    hook.load_state_dict(decode(queue.pop(0), f"{context.path.name}: hook {type(hook).__name__}"))
            return
        for hook, s in zip(hooks, states):
            hook.load_state_dict(decode(s["state"], f"{context.path.name}: hook {type(hook).__name__}"))


class LoaderParticipant:
    """The training data position (per rank).

    Under a :class:`StatefulRandomSampler` a sample is a pure function of
    ``(seed, epoch, position)``, so the position alone restores the data
    stream exactly and in O(1): no worker state, no replayed batches. Other
    loaders (iterable data sets) save and restore ``StatefulDataLoader``'s own
    state, snapshotted at the checkpoint cadence. When the layout changed,
    the epoch continues after the same number of samples, in the new layout's
    steps."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        """The sample position (map-style data) or the loader's own snapshot (iterable)."""
        trainer = self.trainer
        state = trainer.train_state
        if train_sampler(trainer.train_loader) is not None:
            return {"kind": "position", "epoch": state.epoch, "samples_in_epoch": state.samples_seen_in_epoch()}
        # Also between epochs: an iterable data set's stream goes on from where the
        # last epoch left it (the next epoch's iterator continues the same stream).
        return {"kind": "loader", "state": trainer.train_loader.state_dict()}

    def restore(self, state: dict | None, context) -> None:
        """Continue the epoch after the saved position (after the same sample count
        when the layout changed)."""
        trainer, train_state = self.trainer, self.trainer.train_state
        if not context.layout_changed and state is not None:
            if state["kind"] == "position":
                trainer.resume_position(state["samples_in_epoch"])
            elif state["state"] is not None:
                trainer.train_loader.load_state_dict(state["state"])
            return
        context.inexact("the data order inside this epoch")
        consumed = context.saved_train_state.samples_seen_in_epoch()
        sampler = train_sampler(trainer.train_loader)
        if train_state.iter_in_epoch > 0 and sampler is not None:
            sampler.set_epoch(train_state.epoch, consumed)
            remaining = trainer.iters_for_batches(len(trainer.train_loader))
            train_state.iter_in_epoch = max(0, trainer.iters_per_epoch - remaining)
            trainer.resume_position(consumed)
        elif train_state.iter_in_epoch > 0:
            context.note("this loader cannot skip to a sample count: the interrupted epoch restarts")
            train_state.iter_in_epoch = 0
