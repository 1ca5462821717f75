"""How the model is spread over the processes: the ``parallel`` runtime key.

``parallel = dict(strategy="ddp")`` (the default) replicates the model on
every rank and all-reduces gradients (DistributedDataParallel).
``parallel = dict(strategy="fsdp", ...)`` shards parameters, gradients and
optimizer state over the ranks with PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``); its options:

* ``shard_modules``: class names of the submodules that become their own
  FSDP unit (gathered just before their forward, freed after it), e.g.
  ``["Block"]``; None shards the root module only (one unit);
* ``reshard_after_forward``: free the gathered parameters after the forward
  pass (True: less memory, one more all-gather in backward);
* ``mixed_precision``: None, or ``dict(param_dtype="bfloat16",
  reduce_dtype="float32")``: the dtype the parameters are gathered and
  computed in, and the dtype gradients are reduced in.

Everything FSDP-specific the engine needs lives here: validating the key,
wrapping the model, keeping buffers (BatchNorm statistics, which FSDP does
not shard) equal to rank 0's as DDP does, the full (gathered) state dict
that ``model/*.pth`` files hold, and :func:`full_parameters`, under which every rank holds the
whole model (evaluation, where ranks run unequal numbers of forward passes,
and GRPO rollouts, which call model methods other than ``forward``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from pimm.utils.errors import ConfigError

__all__ = ["DEFAULT_PARALLEL", "ParallelConfig", "check_parallel", "parallel_config", "shard_model",
           "sync_buffers", "is_sharded", "check_shard_modules", "full_state_dict", "full_parameters"]

DEFAULT_PARALLEL = dict(strategy="ddp", shard_modules=None, reshard_after_forward=True, mixed_precision=None)
STRATEGIES = ("ddp", "fsdp")
DTYPES = ("float32", "bfloat16", "float16")
_PRECISION_KEYS = ("param_dtype", "reduce_dtype")


@dataclass(frozen=True)
class ParallelConfig:
    """The validated ``parallel`` runtime key (see :func:`check_parallel`):
    ``strategy`` ``"ddp"`` or ``"fsdp"``; for FSDP, the class names of the
    submodules that become units of their own (``shard_modules``), whether
    parameters are freed after forward, and the mixed-precision dtypes of
    parameters and gradient reduction (None: float32).
    """
    strategy: str = "ddp"
    shard_modules: tuple[str, ...] | None = None
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None

    @property
    def fsdp(self) -> bool:
        """Whether the strategy is FSDP sharding."""
        return self.strategy == "fsdp"


def check_parallel(key: str, value) -> dict:
    """The runtime-key check: the normalised ``parallel`` dict, or a one-line ConfigError."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} is invalid: it takes a dict, e.g. dict(strategy='fsdp')")
    unknown = [k for k in value if k not in DEFAULT_PARALLEL]
    if unknown:
        raise ConfigError(f"{key}: unknown option {unknown[0]!r}; the options are {', '.join(DEFAULT_PARALLEL)}")
    out = {**DEFAULT_PARALLEL, **value}
    if out["strategy"] not in STRATEGIES:
        raise ConfigError(f"{key}.strategy={out['strategy']!r} is invalid: it takes 'ddp' or 'fsdp'")
    names = out["shard_modules"]
    if isinstance(names, str):
        names = [names]
    if names is not None and (not isinstance(names, (list, tuple)) or not names
                              or not all(isinstance(n, str) and n for n in names)):
        raise ConfigError(f"{key}.shard_modules={out['shard_modules']!r} is invalid: it takes a list of module class "
                          "names like ['Block'] or None (the root module only)")
    out["shard_modules"] = list(names) if names is not None else None
    if not isinstance(out["reshard_after_forward"], bool):
        raise ConfigError(f"{key}.reshard_after_forward={out['reshard_after_forward']!r} is invalid: it takes True "
                          "or False")
    precision = out["mixed_precision"]
    if precision is not None:
        if not isinstance(precision, dict) or any(k not in _PRECISION_KEYS for k in precision):
            raise ConfigError(f"{key}.mixed_precision={precision!r} is invalid: it takes None or "
                              "dict(param_dtype=..., reduce_dtype=...)")
        for name, dtype in precision.items():
            if dtype is not None and dtype not in DTYPES:
                raise ConfigError(f"{key}.mixed_precision.{name}={dtype!r} is invalid: it takes one of "
                                  f"{', '.join(map(repr, DTYPES))} or None")
    if out["strategy"] == "ddp":
        changed = [k for k in ("shard_modules", "reshard_after_forward", "mixed_precision")
                   if out[k] != DEFAULT_PARALLEL[k]]
        if changed:
            raise ConfigError(f"{key}.{changed[0]} is an FSDP option but {key}.strategy='ddp': set "
                              f"{key}.strategy='fsdp' or leave {key}.{changed[0]} at its default")
    return out


def parallel_config(cfg) -> ParallelConfig:
    """The (validated) ``parallel`` key of a config as a :class:`ParallelConfig`."""
    value = check_parallel("parallel", cfg.get("parallel", DEFAULT_PARALLEL))
    precision = value["mixed_precision"] or {}
    return ParallelConfig(strategy=value["strategy"],
                          shard_modules=tuple(value["shard_modules"]) if value["shard_modules"] else None,
                          reshard_after_forward=value["reshard_after_forward"],
                          param_dtype=precision.get("param_dtype"), reduce_dtype=precision.get("reduce_dtype"))


def check_shard_modules(model: nn.Module, config: ParallelConfig) -> None:
    """Every class named in ``config.shard_modules`` is a submodule class of
    ``model``, else a one-line ConfigError. Called wherever the model is built
    (one process too, where nothing is sharded), so a typo fails the same way
    at any world size."""
    if not config.fsdp or not config.shard_modules:
        return
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in config.shard_modules if name not in present]
    if missing:
        import difflib

        close = difflib.get_close_matches(missing[0], sorted(present), n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"parallel.shard_modules: {type(model).__name__} has no submodule of class "
                          f"{missing[0]!r} ({hint}its classes are {', '.join(sorted(present))})")


def shard_model(model: nn.Module, config: ParallelConfig, device: torch.device, world_size: int,
                logger=None, keep_frozen_whole: bool = False, units=()) -> nn.Module:
    """``fully_shard`` the submodules of the classes in ``config.shard_modules``
    (innermost first), then the root; in place (the returned module is ``model``).
    ``keep_frozen_whole``: parameters that need no gradient stay whole on every
    rank (a frozen copy the model writes to itself, like GRPO's reference policy:
    a write to gathered parameters would be lost at the next reshard).
    ``units``: more submodules to shard as units of their own (the networks
    of a model trained by several optimizers), in any order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_shard_modules(model, config)
    wanted = set(config.shard_modules or ())
    extra = {id(m) for m in units}
    units = [m for m in model.modules() if m is not model and (type(m).__name__ in wanted or id(m) in extra)]
    names = type(model).__name__, sorted({type(m).__name__ for m in units})  # before fully_shard renames them
    mesh = init_device_mesh(device.type, (world_size,))
    policy = MixedPrecisionPolicy(
        param_dtype=getattr(torch, config.param_dtype) if config.param_dtype else None,
        reduce_dtype=getattr(torch, config.reduce_dtype) if config.reduce_dtype else None)
    ignored = {p for p in model.parameters() if not p.requires_grad} if keep_frozen_whole else None
    for unit in [*reversed(units), model]:  # children before parents, the root last
        fully_shard(unit, mesh=mesh, reshard_after_forward=config.reshard_after_forward, mp_policy=policy,
                    ignored_params=ignored or None)
        unit._pimm_reshard_after_forward = config.reshard_after_forward  # full_parameters() restores it
    if any(True for _ in model.buffers()):
        model.register_forward_pre_hook(_sync_buffers_before_training_forward)
    if logger is not None:
        logger.info(f"FSDP2: {names[0]} sharded over {world_size} processes in {len(units) + 1} unit(s)"
                    f"{' (' + ', '.join(names[1]) + ' and the root)' if units else ' (the root)'}")
    return model


def sync_buffers(module: nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running statistics, ...) to every rank
    (a collective). FSDP shards parameters only; buffers stay per rank, so
    they are made rank 0's before every training forward pass, as DDP does,
    and before a checkpoint saves them (DCP saves one copy of a replicated
    tensor, from whichever rank it picks)."""
    import torch.distributed as dist

    buffers = [b for b in module.buffers() if b.numel()]
    if not buffers or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    for group in by_dtype.values():
        flat = torch.cat([b.detach().reshape(-1) for b in group])
        dist.broadcast(flat, src=0)
        offset = 0
        for buffer in group:
            buffer.data.copy_(flat[offset:offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


def _sync_buffers_before_training_forward(module: nn.Module, args, kwargs=None):
    if module.training and torch.is_grad_enabled():
        sync_buffers(module)


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP-sharded (DTensor) parameters."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())


def full_state_dict(module: nn.Module, keep: bool = True) -> dict | None:
    """``module.state_dict()`` with every sharded tensor gathered into a plain CPU
    tensor. A collective when the module is sharded: every rank must call it, in
    the same order; ranks with ``keep=False`` drop the result (returns None)."""
    from torch.distributed.tensor import DTensor

    out = {} if keep else None
    for key, value in module.state_dict().items():
        if isinstance(value, DTensor):
            value = value.full_tensor()
        if keep:
            out[key] = value.detach().cpu() if isinstance(value, torch.Tensor) else value
    return out


@contextlib.contextmanager
def full_parameters(module: nn.Module):
    """Every rank holds the whole model inside: each FSDP unit is gathered once
    on entry (a collective) and kept through any number of forward passes (none
    of which is then a collective), and resharded on exit. A no-op for a model
    that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not units:
        yield module
        return
    previous = [getattr(unit, "_pimm_reshard_after_forward", True) for unit in units]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield module
    finally:
        for unit, value in zip(units, previous):
            unit.reshard()
            unit.set_reshard_after_forward(value, recurse=False)
