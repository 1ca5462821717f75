"""Several networks, several optimizers: one :class:`OptimStep` per named part.

A model made of several networks trained against or beside each other (a
GAN's generator and discriminator, a student and a teacher head) gives each
its own optimizer, schedule, AMP scaler and gradient clipping by naming the
parts in the optimizer config::

    optimizer = dict(gen=dict(type="Adam", lr=2e-4, betas=(0.5, 0.999)),
                     disc=dict(type="Adam", lr=2e-4, betas=(0.5, 0.999)))
    scheduler = dict(gen=dict(type="ConstantLR"), disc=dict(type="CosineWarmupLR"))  # or one dict(type=...) for all
    clip_grad = dict(disc=1.0)            # or one number for every part; a missing part is not clipped
    param_dicts = dict(gen=[dict(keyword="project", lr_scale=0.1)])  # per part, optional

Each name is a submodule of the model (``model.gen``, ``model.disc``); its
optimizer holds that submodule's trainable parameters, and no parameter may
belong to two parts. A config with ``optimizer = dict(type=...)`` is the
single-optimizer case and is untouched by this module.

The trainer gets ``trainer.optim_steps`` (name -> :class:`OptimStep`, in the
config's order) and uses them by name in its ``run_step``; see
:class:`~pimm.engines.trainers.gan.GANTrainer`. Every part's optimizer,
scheduler and scaler is its own checkpoint participant (``optimizer/gen``,
``scheduler/gen``, ``scaler/gen``, ...), so a resumed run continues each
exactly. Hooks that act on *the* optimizer (ReduceLROnPlateau, LiveControl's
``lr``, EarlyStopping's lr floor) need a single one and say so.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
from torch import nn

from pimm.engines.optim.optimizers import build_optimizer
from pimm.engines.optim.step import OptimStep
from pimm.engines.optim.scheduler import build_scheduler
from pimm.engines.state.participants import OptimizerParticipant, SchedulerParticipant
from pimm.engines.state.sharded import ShardedOptimizerParticipant
from pimm.utils.errors import ConfigError, UserError

__all__ = ["OptimPart", "optimizer_parts", "model_parts", "build_optim_parts", "part_participants",
           "scheduled_group_keys", "all_optimizers", "single_optimizer_problem"]

logger = logging.getLogger(__name__)


class OptimPart(NamedTuple):
    """One named part: its submodule, optimizer, scheduler, AMP scaler and the
    :class:`OptimStep` that drives them."""
    name: str
    module: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: torch.amp.GradScaler
    step: OptimStep


def optimizer_parts(spec: Any) -> tuple[str, ...]:
    """The part names of a multi-optimizer ``optimizer`` config, or ``()`` for
    the single-optimizer form ``dict(type=...)``."""
    if not isinstance(spec, dict) or "type" in spec:
        return ()
    if not spec:
        raise ConfigError("optimizer = dict() is empty: give dict(type=..., lr=...) or one dict(type=...) per "
                          "model part, e.g. dict(gen=dict(type='Adam'), disc=dict(type='Adam'))")
    for name, value in spec.items():
        if not isinstance(value, dict) or "type" not in value:
            raise ConfigError(f"optimizer.{name} = {value!r}: optimizer is either one dict(type=..., ...) or one "
                              "dict(type=..., ...) per model part, e.g. dict(gen=dict(type='Adam', lr=2e-4), "
                              "disc=dict(type='Adam', lr=2e-4))")
    return tuple(spec)


def _per_part(key: str, value: Any, parts: tuple[str, ...], is_shared, require_all: bool = False) -> dict:
    """``value`` spread over the parts: one shared value (``is_shared(value)``)
    for every part, or a dict keyed by part names."""
    if is_shared(value):
        return {name: value for name in parts}
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r}: with several optimizers it is one value for every part or "
                          f"dict({', '.join(f'{p}=...' for p in parts)})")
    unknown = [k for k in value if k not in parts]
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}: no optimizer part is named {unknown[0]!r} "
                          f"(the optimizer config names {', '.join(parts)})")
    missing = [p for p in parts if p not in value]
    if require_all and missing:
        raise ConfigError(f"{key} has no entry for optimizer part {missing[0]!r}: give every part its own "
                          f"({', '.join(parts)}), e.g. {missing[0]}=dict(type='ConstantLR'), or one "
                          f"{key} = dict(type=...) for all")
    return {name: value.get(name) for name in parts}


def model_parts(model: nn.Module, parts: tuple[str, ...]) -> dict[str, nn.Module]:
    """The submodule of ``model`` each part names; a one-line ConfigError for a name
    that is not one, or for two parts that share parameters."""
    children = [name for name, _ in model.named_children()]
    found = {}
    for name in parts:
        module = getattr(model, name, None) if name.isidentifier() else None
        if not isinstance(module, nn.Module) or module is model:
            raise ConfigError(f"optimizer.{name}: model {type(model).__name__} has no submodule {name!r}; "
                              f"name each optimizer after one of its parts: {', '.join(children) or '(none)'}")
        found[name] = module
    owner: dict[int, str] = {}
    for name, module in found.items():
        for param in module.parameters():
            if id(param) in owner:
                raise ConfigError(f"optimizer parts {owner[id(param)]!r} and {name!r} share parameters (one is "
                                  "inside the other?): each parameter may be trained by one optimizer only")
            owner[id(param)] = name
    left = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in owner]
    if left:
        logger.warning("%d trainable parameter(s) of %s belong to no optimizer part (%s) and will not be trained: "
                       "%s", len(left), type(model).__name__, ", ".join(parts),
                       ", ".join(left[:5]) + (" ..." if len(left) > 5 else ""))
    return found


def scheduled_group_keys(scheduler) -> tuple[str, ...]:
    """Group keys ``scheduler`` sets per step (the lr, a cycled momentum): the
    optimizer participant takes them from the checkpoint, not the config."""
    owned = getattr(scheduler, "_owned_group_keys", None)
    return ("lr", *({"betas", "momentum"} & set(owned() if owned else ())))


def build_optim_parts(cfg, model: nn.Module, wrapped: nn.Module, total_steps: int, make_scaler,
                      parts: tuple[str, ...] | None = None) -> dict[str, OptimPart]:
    """One optimizer, scheduler, scaler and :class:`OptimStep` per part of
    ``cfg.optimizer`` (see the module docstring). ``model`` is the plain module,
    ``wrapped`` the one the loss runs through (DDP/FSDP: it decides how gradient
    sync pauses), ``make_scaler()`` a fresh GradScaler (the trainer's ``build_scaler``)."""
    parts = parts or optimizer_parts(cfg.optimizer)
    modules = model_parts(model, parts)
    schedulers = _per_part("scheduler", cfg.get("scheduler"),
                           parts, lambda v: v is None or (isinstance(v, dict) and "type" in v), require_all=True)
    clips = _per_part("clip_grad", cfg.get("clip_grad"), parts, lambda v: not isinstance(v, dict))
    groups = _per_part("param_dicts", cfg.get("param_dicts"), parts, lambda v: v is None)
    interval = cfg.get("scheduler_interval", 1)
    total_steps = max(1, total_steps // interval)  # each schedule steps once every `interval` updates
    built = {}
    for name in parts:
        try:
            optimizer = build_optimizer(cfg.optimizer[name], modules[name], groups[name])
            scheduler = build_scheduler(schedulers[name] if schedulers[name] is not None else dict(type="ConstantLR"),
                                        optimizer, total_steps=total_steps)
        except UserError as err:  # name the part: both parts usually have the same optimizer type
            raise type(err)(f"optimizer part {name!r}: {err}") from None
        scaler = make_scaler()
        step = OptimStep(optimizer, scheduler=scheduler, scaler=scaler, clip_grad=clips[name], model=wrapped,
                         track_grad_norm=cfg.log_grad_norm, scheduler_interval=interval)
        built[name] = OptimPart(name, modules[name], optimizer, scheduler, scaler, step)
    return built


def part_participants(parts: dict[str, OptimPart], model: nn.Module, sharded: bool) -> list[tuple]:
    """``(name, participant, scope)`` for every part's optimizer, scheduler and
    scaler: ``optimizer/<part>``, ``scheduler/<part>``, ``scaler/<part>`` (and
    ``optim_step/<part>``, its update count, with ``scheduler_interval`` > 1).
    Under FSDP the optimizers go through Distributed Checkpoint (``model`` is
    the sharded root, whose parameter names key the state)."""
    entries = []
    for name, part in parts.items():
        keys = scheduled_group_keys(part.scheduler)
        if sharded:
            entries.append((f"optimizer/{name}", ShardedOptimizerParticipant(model, part.optimizer, keys), "sharded"))
        else:
            entries.append((f"optimizer/{name}", OptimizerParticipant(part.optimizer, keys), "shared"))
        entries.append((f"scheduler/{name}", SchedulerParticipant(part.scheduler), "shared"))
        entries.append((f"scaler/{name}", part.scaler, "shared"))
        if part.step.scheduler_interval > 1:  # where the part's next scheduler step falls
            entries.append((f"optim_step/{name}", part.step, "shared"))
    return entries


def all_optimizers(trainer) -> list[torch.optim.Optimizer]:
    """Every optimizer ``trainer`` steps: its one ``optimizer``, or each part's."""
    parts = getattr(trainer, "optim_parts", None) or {}
    if parts:
        return [part.optimizer for part in parts.values()]
    optimizer = getattr(trainer, "optimizer", None)
    return [optimizer] if optimizer is not None else []


def single_optimizer_problem(trainer, who: str) -> str | None:
    """Why ``who`` (a hook acting on *the* optimizer's lr) cannot work on this
    trainer's several optimizers, or None when there is one."""
    parts = getattr(trainer, "optim_parts", None) or {}
    if not parts:
        return None
    return (f"{who} acts on a single optimizer's learning rate; this run has one per model part "
            f"({', '.join(parts)}): schedule each part with scheduler = dict(<part>=dict(type=...))")
