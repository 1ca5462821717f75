"""Snapshots of training state for a checkpoint: copies that training can no
longer change, taken as fast as the device allows.

A save blocks the training thread only while the state is copied; writing to
disk happens afterwards (on the background writer with ``async_write``). For
CUDA tensors the copy is what costs, so :class:`SnapshotBuffers` makes it
cheap:

* every CUDA tensor is copied into a page-locked (pinned) host buffer with
  ``non_blocking=True``: the copies are queued back to back on the current
  stream, and the training thread waits once, for all of them, at the end of
  the snapshot (a pageable ``.cpu()`` per tensor would wait once per tensor,
  through a staging copy);
* the buffers are allocated at the first save and reused by every later save
  that has a tensor of the same shape and dtype at the same place in the
  state, so a run pins its staging memory once (the size of one checkpoint)
  instead of allocating it at every save. A buffer is reused only after the
  previous save's write is finished: :meth:`CheckpointManager.save` waits for
  the write in flight before it takes the next snapshot.
* one tensor reached twice in one save (the model's weights in the checkpoint
  and in ``model_last.pth``) is copied once.

Host tensors are cloned (they already are host memory; keeping buffers for
them would hold a second copy of a CPU run's state for nothing), and anything
else is deep-copied.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable

import torch

__all__ = ["SnapshotBuffers"]

# Leaves that deepcopy would return as they are, recognised without its call.
_IMMUTABLE = frozenset({str, int, float, bool, bytes, type(None)})


class SnapshotBuffers:
    """Reusable host buffers for the tensors of a checkpoint's state (see the module docstring).

    Args:
        pin: allocate page-locked buffers (default: when CUDA is available).
        stage: which tensors go through the reusable buffers (default: CUDA
            tensors); the others are cloned. Tests stage CPU tensors with
            ``pin=False`` to check the reuse logic without a GPU.
    """

    def __init__(self, pin: bool | None = None, stage: Callable[[torch.Tensor], bool] | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stage = stage if stage is not None else (lambda t: t.is_cuda)
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.allocations = 0  # buffers allocated so far: stays put while saves reuse them

    def snapshot(self) -> "Snapshot":
        """Start one save's snapshot; freeze every state with it, then call :meth:`Snapshot.finish`."""
        return Snapshot(self)

    def release(self) -> None:
        """Drop every buffer (the next save allocates again)."""
        self.buffers = {}


class Snapshot:
    """One save's copies. :meth:`freeze` each state under its own ``key``, then
    :meth:`finish` (waits for the device copies, drops buffers this save did not use)."""

    def __init__(self, pool: SnapshotBuffers):
        self.pool = pool
        self.used: dict[tuple, torch.Tensor] = {}
        self.seen: dict[tuple, torch.Tensor] = {}  # source identity -> its copy in this snapshot
        self.devices: set[torch.device] = set()  # devices with copies queued

    def freeze(self, obj: Any, key: tuple = ()) -> Any:
        """A copy of ``obj`` (nested dicts, OrderedDicts, lists, tuples) that training cannot change."""
        if type(obj) in _IMMUTABLE:  # most leaves (config values, counters): nothing to copy
            return obj
        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if type(obj) is dict:
            return {k: self.freeze(v, key + (k,)) for k, v in obj.items()}
        if type(obj) is OrderedDict:  # a module's state dict: keep its version metadata
            out = OrderedDict((k, self.freeze(v, key + (k,))) for k, v in obj.items())
            if hasattr(obj, "_metadata"):
                out._metadata = copy.deepcopy(obj._metadata)
            return out
        if type(obj) in (list, tuple):
            return type(obj)(self.freeze(v, key + (i,)) for i, v in enumerate(obj))
        return copy.deepcopy(obj)

    def _tensor(self, tensor: torch.Tensor, key: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        if type(tensor) is not torch.Tensor or not self.pool.stage(tensor):
            return tensor.to("cpu", copy=True)  # host data, or a tensor subclass (DTensor): a plain copy
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tensor.stride(), tensor.dtype, tensor.device)
        copied = self.seen.get(identity)
        if copied is not None:
            return copied
        buffer = self.pool.buffers.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype or key in self.used:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pool.pin)
            self.pool.allocations += 1
        buffer.copy_(tensor, non_blocking=tensor.is_cuda)
        if tensor.is_cuda:
            self.devices.add(tensor.device)
        self.used[key] = self.seen[identity] = buffer
        return buffer

    def finish(self) -> None:
        """Wait for the queued device-to-host copies (the only wait of the save on the
        device) and keep exactly the buffers this save used for the next one."""
        for device in self.devices:
            torch.cuda.current_stream(device).synchronize()
        self.pool.buffers = self.used
