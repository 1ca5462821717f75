"""Upstream pimm's (detectron2's) ``launch(main_func, num_gpus_per_machine, ...)``,
for training scripts written against it (``from pimm.engines.launch import launch``).

One process (``num_machines * num_gpus_per_machine == 1``) calls
``main_func(*cfg)`` here. Otherwise each machine starts ``num_gpus_per_machine``
workers (``torch.multiprocessing.spawn``); each joins the process group
through the torchrun variables pimm's own ranks read (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; see
:func:`pimm.utils.comm.init_distributed_from_env`: NCCL on GPUs, gloo on CPU),
calls ``main_func(*cfg)`` and leaves the group. ``cfg`` and ``main_func``
must pickle (a module-level function).

``dist_url``: ``None`` or ``"auto"`` (one machine: a free local port),
``"tcp://HOST:PORT"``, or ``"env"`` / ``"slurm"`` (``MASTER_ADDR`` and
``MASTER_PORT`` from the environment; under SLURM, without them, the job's
first node and the port pimm derives from the job id).

pimm's own command line does not go through here: ``tools/train.py
--num-gpus N`` starts its ranks with :mod:`pimm.distributed.spawn`, which
also forwards pre-emption signals and stops the other ranks when one fails.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from typing import Any, Callable

from pimm.utils.errors import UserError

__all__ = ["DEFAULT_TIMEOUT", "launch"]

#: How long a collective may wait before the process group gives up.
DEFAULT_TIMEOUT = timedelta(minutes=60)

_TCP = re.compile(r"tcp://(?P<host>\[[^\]]+\]|[^:/]+):(?P<port>\d+)/?")


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"launch({name}={value!r}): give an integer >= {low}")
    return value


def _rendezvous(dist_url: str | None, num_machines: int) -> tuple[str, int]:
    """The (address, port) every rank meets at."""
    if dist_url in (None, "auto"):
        if num_machines > 1:
            raise UserError("launch(dist_url='auto') picks a port on this machine only: with num_machines > 1 give "
                            "dist_url='tcp://HOST:PORT' (the same on every machine), 'env' or 'slurm'")
        from pimm.distributed.spawn import free_port

        return "127.0.0.1", free_port()
    if dist_url in ("env", "slurm"):
        if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT", "").isdigit():
            return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        if dist_url == "slurm" and os.environ.get("SLURM_JOB_ID"):
            from pimm.distributed.slurm_task import Rendezvous

            meeting = Rendezvous.from_slurm()
            return meeting.master_addr, meeting.master_port
        raise UserError(f"launch(dist_url={dist_url!r}) needs MASTER_ADDR and MASTER_PORT in the environment"
                        + (" (or a SLURM job)" if dist_url == "slurm" else ""))
    match = _TCP.fullmatch(str(dist_url))
    if match is None:
        raise UserError(f"launch(dist_url={dist_url!r}): give 'tcp://HOST:PORT', 'auto', 'env' or 'slurm'")
    return match["host"].strip("[]"), int(match["port"])


def _worker(local_rank: int, main_func: Callable, world_size: int, per_machine: int, machine_rank: int,
            address: str, port: int, cfg: tuple, timeout: timedelta) -> None:
    from pimm.utils import comm

    os.environ.update(RANK=str(machine_rank * per_machine + local_rank), LOCAL_RANK=str(local_rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(per_machine), MASTER_ADDR=address,
                      MASTER_PORT=str(port))
    comm.init_distributed_from_env(timeout_s=timeout.total_seconds())
    try:
        main_func(*cfg)
    finally:
        comm.destroy_distributed()


def launch(main_func: Callable, num_gpus_per_machine: int, num_machines: int = 1, machine_rank: int = 0,
           dist_url: str | None = None, cfg: tuple = (), timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Run ``main_func(*cfg)`` on ``num_machines * num_gpus_per_machine``
    processes, this machine's ``num_gpus_per_machine`` of them started here
    (see the module docstring). Call it on every machine, with its ``machine_rank``."""
    per_machine = _count("num_gpus_per_machine", num_gpus_per_machine, 1)
    machines = _count("num_machines", num_machines, 1)
    if not 0 <= _count("machine_rank", machine_rank, 0) < machines:
        raise UserError(f"launch(machine_rank={machine_rank}) must be below num_machines={machines}")
    if not isinstance(timeout, timedelta):
        raise UserError(f"launch(timeout={timeout!r}): give a datetime.timedelta")
    cfg = tuple(cfg)
    world_size = machines * per_machine
    if world_size == 1:
        main_func(*cfg)
        return
    address, port = _rendezvous(dist_url, machines)
    import torch.multiprocessing as mp

    mp.spawn(_worker, nprocs=per_machine, daemon=False,
             args=(main_func, world_size, per_machine, machine_rank, address, port, cfg, timeout))
