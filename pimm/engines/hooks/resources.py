"""``ResourceUtilizationLogger``: where a run's CPU time and memory go, as
scalars on the metric channel (upstream pimm's hook, arguments and meaning,
read from the standard library and torch: no psutil or NVML needed)."""

from __future__ import annotations

import os
import resource
import time

import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils.domains import Key, PosInt
from pimm.utils.errors import ConfigError

__all__ = ["ResourceUtilizationLogger"]


@HOOKS.register_module()
class ResourceUtilizationLogger(HookBase):
    """Every ``log_frequency`` steps under ``<prefix>/``, rank-local values.

    ``per_process=True`` (upstream's default; right on a shared node): this
    process only. ``log_cpu``: ``cpu_percent``, its CPU time over wall time
    since the last log (100 = one core busy). ``log_system_memory``:
    ``process_rss_gb``, its peak resident memory. On GPUs, the memory its
    tensors hold, ``gpu<i>/allocated_gb`` and ``gpu<i>/reserved_gb`` (their sums
    ``gpu/...`` without ``log_per_gpu``).

    ``per_process=False`` adds the whole machine's: ``system_cpu_percent``
    (all cores, from /proc/stat; 100 = every core busy), ``load_per_cpu`` (the
    1-minute load average per core) and ``cpu_count`` with ``log_cpu``;
    ``system_memory_percent`` (/proc/meminfo) with ``log_system_memory``; and
    ``gpu/device_used_gb``, the memory every process uses on this process's
    GPU. A value the platform cannot read is left out."""

    domains = dict(log_frequency=PosInt, prefix=Key)

    def __init__(self, log_frequency: int = 10, prefix: str = "resources", log_per_gpu: bool = True,
                 log_cpu: bool = True, log_system_memory: bool = True, per_process: bool = True):
        if isinstance(log_frequency, bool) or not isinstance(log_frequency, int) or log_frequency < 1:
            raise ConfigError(f"ResourceUtilizationLogger: log_frequency={log_frequency!r} must be a positive integer")
        self.log_frequency, self.prefix = log_frequency, prefix
        self.log_per_gpu, self.log_cpu, self.log_system_memory = bool(log_per_gpu), bool(log_cpu), log_system_memory
        self.per_process = bool(per_process)
        self._last = (time.monotonic(), time.process_time())
        self._last_system = self.system_cpu_times()

    @staticmethod
    def system_memory_percent() -> float | None:
        """Percent of the machine's memory in use (/proc/meminfo); None where unreadable."""
        try:
            info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
            total, available = (float(info[k].split()[0]) for k in ("MemTotal", "MemAvailable"))
            return 100.0 * (1 - available / total)
        except (OSError, KeyError, ValueError):
            return None

    @staticmethod
    def system_cpu_times() -> tuple[float, float] | None:
        """``(busy, total)`` CPU time of every core since boot (/proc/stat, in
        clock ticks; idle and iowait are not busy); None where unreadable."""
        try:
            with open("/proc/stat") as fh:
                fields = [float(v) for v in fh.readline().split()[1:]]
            return sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0.0), sum(fields)
        except (OSError, ValueError, IndexError):
            return None

    def _system_cpu(self, scalars: dict, p: str) -> None:
        now = self.system_cpu_times()
        if now is not None and self._last_system is not None and now[1] > self._last_system[1]:
            busy, total = now[0] - self._last_system[0], now[1] - self._last_system[1]
            scalars[f"{p}/system_cpu_percent"] = 100.0 * busy / total
        self._last_system = now
        cores = os.cpu_count() or 0
        scalars[f"{p}/cpu_count"] = float(cores)
        if cores and hasattr(os, "getloadavg"):
            scalars[f"{p}/load_per_cpu"] = os.getloadavg()[0] / cores

    def after_step(self) -> None:
        trainer = self.trainer
        if trainer.global_step % self.log_frequency:
            return
        p = self.prefix
        scalars: dict[str, float] = {}
        if self.log_cpu:
            wall, cpu = time.monotonic(), time.process_time()
            scalars[f"{p}/cpu_percent"] = 100.0 * (cpu - self._last[1]) / max(wall - self._last[0], 1e-9)
            self._last = (wall, cpu)
            if not self.per_process:
                self._system_cpu(scalars, p)
        if self.log_system_memory:
            scalars[f"{p}/process_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
            if not self.per_process and (percent := self.system_memory_percent()) is not None:
                scalars[f"{p}/system_memory_percent"] = percent
        if torch.cuda.is_available():
            per = [(torch.cuda.memory_allocated(i) / 2**30, torch.cuda.memory_reserved(i) / 2**30)
                   for i in range(torch.cuda.device_count())]
            if self.log_per_gpu:
                for i, (alloc, reserved) in enumerate(per):
                    scalars[f"{p}/gpu{i}/allocated_gb"], scalars[f"{p}/gpu{i}/reserved_gb"] = alloc, reserved
            else:
                scalars[f"{p}/gpu/allocated_gb"] = sum(a for a, _ in per)
                scalars[f"{p}/gpu/reserved_gb"] = sum(r for _, r in per)
            if not self.per_process:
                free, total = torch.cuda.mem_get_info()  # this process's device, every process's use
                scalars[f"{p}/gpu/device_used_gb"] = (total - free) / 2**30
        trainer.metrics.publish(scalars, step=trainer.global_step)
