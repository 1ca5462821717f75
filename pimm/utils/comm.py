"""Thin helpers over ``torch.distributed`` that also work in a single process.

Every function is a no-op (or the identity) when no process group is
initialised, so engine code never branches on "am I distributed?".
"""

from __future__ import annotations

import gc
import os
from datetime import timedelta

import torch
import torch.distributed as dist

__all__ = [
    "is_dist",
    "get_rank",
    "get_local_rank",
    "get_world_size",
    "is_main_process",
    "synchronize",
    "all_reduce",
    "any_rank",
    "broadcast_object",
    "all_gather_object",
    "init_distributed_from_env",
    "destroy_distributed",
]


def is_dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_dist() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_dist() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0)) if is_dist() else 0


def is_main_process() -> bool:
    return get_rank() == 0


def synchronize() -> None:
    if is_dist() and get_world_size() > 1:
        dist.barrier()


def _collective_device() -> torch.device:
    # NCCL only reduces CUDA tensors; gloo only CPU ones.
    if is_dist() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over ranks in place (``op``: sum, mean, max, min) and return it.

    The tensor is moved to the backend's device for the collective and the
    result is copied back, so callers may pass tensors on any device."""
    if not is_dist() or get_world_size() == 1:
        return tensor
    reduce_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                 "min": dist.ReduceOp.MIN}[op]
    work = tensor.to(_collective_device())
    dist.all_reduce(work, op=reduce_op)
    if op == "mean":
        work = work / get_world_size()
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def any_rank(flag: bool) -> bool:
    """True on every rank if ``flag`` is true on any rank (a collective)."""
    if not is_dist() or get_world_size() == 1:
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def broadcast_object(obj, src: int = 0):
    if not is_dist() or get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_gather_object(obj) -> list:
    if not is_dist() or get_world_size() == 1:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _env_int(name: str, default: int | None = None, low: int = 0) -> int:
    from pimm.utils.errors import UserError

    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise UserError(f"{name} is not set but WORLD_SIZE is: set every torchrun variable (RANK, WORLD_SIZE, "
                            "MASTER_ADDR, MASTER_PORT) or none")
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < low:
        raise UserError(f"{name}={raw!r} is invalid: it must be an integer >= {low}")
    return value


def init_distributed_from_env(timeout_s: float = 1800.0) -> bool:
    """Join the process group described by torchrun-style environment variables
    (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``).

    Returns True when a multi-process group was initialised. The backend is
    NCCL when CUDA is usable, gloo otherwise (so CPU-only machines work).
    Joining waits at most ``PIMM_DIST_INIT_TIMEOUT`` seconds (default 300) for
    every rank: a rank started with the wrong variables fails with a message
    instead of hanging; ``timeout_s`` bounds each collective afterwards."""
    from pimm.utils.errors import UserError

    world_size = _env_int("WORLD_SIZE", 1, low=1)
    if world_size <= 1 or is_dist():
        return is_dist()
    rank = _env_int("RANK")
    if rank >= world_size:
        raise UserError(f"RANK={rank} is invalid for WORLD_SIZE={world_size}: ranks are 0..{world_size - 1}")
    local_rank = _env_int("LOCAL_RANK", 0)
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise UserError(f"{name} is not set but WORLD_SIZE={world_size} is: set MASTER_ADDR and MASTER_PORT "
                            "(torchrun does) or run a single process")
    _env_int("MASTER_PORT", low=1)
    init_timeout = float(os.environ.get("PIMM_DIST_INIT_TIMEOUT", "300"))
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(local_rank)
    try:
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timedelta(seconds=init_timeout)))
        store.set_timeout(timedelta(seconds=init_timeout))  # every peer must join within it
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, TimeoutError, ValueError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise UserError(
            f"distributed start-up failed for RANK={rank} of WORLD_SIZE={world_size} at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {init_timeout:g}s ({first}): start "
            "every rank with the same WORLD_SIZE/MASTER_ADDR/MASTER_PORT; PIMM_DIST_INIT_TIMEOUT sets the wait"
        ) from None
    return True


def destroy_distributed() -> None:
    if is_dist():
        # A DistributedDataParallel wrapper still alive when its process group is
        # destroyed can abort the process at exit (torch 2.x, gloo: "terminate
        # called without an active exception"); a trainer kept alive only by
        # reference cycles is collected first.
        gc.collect()
        dist.destroy_process_group()

