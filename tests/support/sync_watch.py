"""Find the host-device synchronisations a CPU run would make on a GPU.

On a CPU every tensor is host memory, so nothing ever waits; what matters is
which reads *would* wait on a GPU. :class:`SyncWatch` tells the two apart by
following where values come from: a ``TorchFunctionMode`` sees every torch
call (tensor methods, operators and properties included) and marks as
"device" every tensor that

* is a parameter or buffer of the watched model, or a tensor of a batch the
  trainer moved to its device (the seeds, marked by the test);
* is produced by a call that took a device tensor (activations, losses,
  gradients through ``.grad``, optimizer moments through ``zeros_like``);
* is created with a ``torch.device`` object as its device (``torch.zeros(n,
  device=x.device)``, ``t.to(trainer.device)``): on a GPU run that object is
  the GPU. A device given as a string (``"cpu"``) or none at all makes host
  data, as on a GPU run.

Host bookkeeping therefore stays unmarked: offsets and sizes built by the
collate function, torch's own CPU step counters in Adam (which it reads with
``.item()`` on purpose), index tensors built with ``torch.arange(n)``.

A *sync* is one of :data:`SYNC_CALLS` on a device tensor (a read of its value
on the host, or an op whose output size depends on its values), a boolean
device tensor used as an index, ``.to("cpu")``, or ``torch.cuda.synchronize``.
Each one outside a :func:`pimm.engines.sync_points.host_sync` moment is a
violation, recorded with the innermost frames of pimm code that made it.

What it cannot see: ``t.to(torch.device("cpu"))`` on a device tensor (on this
CPU run the trainer's device *is* ``torch.device("cpu")``) and syncs made by
C++ code without a torch call (none in pimm's step today). The GPU run of
``bench/gpu_check.py`` (``torch.cuda.set_sync_debug_mode("error")``) covers
both.
"""

from __future__ import annotations

import traceback
from collections import Counter
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pimm.engines import sync_points

_MARK = "_pimm_on_device"

#: Calls that make the host wait for a device tensor's value (or size).
SYNC_CALLS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__complex__",
    "__format__", "__repr__", "__str__", "__array__", "__contains__", "is_nonzero", "equal", "allclose",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
})


def mark(obj) -> None:
    """Mark every tensor in ``obj`` (nested dicts/lists/tuples) as living on the device."""
    for leaf in tree_flatten(obj)[0]:
        if isinstance(leaf, torch.Tensor):
            leaf.__dict__[_MARK] = True


def on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.__dict__.get(_MARK, False)


class Violation(NamedTuple):
    """A sync outside the marked moments: what it was, and where (innermost frame first,
    paths under ``pimm/``)."""
    what: str
    where: list[str]

    def __str__(self) -> str:
        return f"{self.what} at {' <- '.join(self.where[:4])}"


class SyncWatch(TorchFunctionMode):
    """Records violations (syncs outside the marked moments) and counts the allowed ones."""

    def __init__(self):
        super().__init__()
        self.violations: list[Violation] = []
        self.allowed = Counter()  # moment reason -> syncs made in it

    # -- reporting ------------------------------------------------------
    def _sync(self, what: str) -> None:
        if sync_points.sync_allowed():
            self.allowed[sync_points.open_moments()[0]] += 1
            return
        frames = [f for f in traceback.extract_stack() if ("/pimm/" in f.filename or "/tests/" in f.filename)
                  and not f.filename.endswith("sync_watch.py")]
        self.violations.append(Violation(what, [f"{f.filename.rsplit('/pimm/', 1)[-1]}:{f.lineno} {f.name}"
                                                for f in reversed(frames[-6:])]))

    def cuda_synchronize(self, *args, **kwargs) -> None:
        """Stands in for ``torch.cuda.synchronize`` (never reached on a CPU run unless unguarded)."""
        self._sync("torch.cuda.synchronize()")

    # -- the mode -------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        from_device = any(on_device(x) for x in leaves)
        name = getattr(func, "__name__", "")
        to_host = name == "cpu" or (name == "to" and ("cpu" in args[1:] or kwargs.get("device") == "cpu"))
        if from_device:
            if name in SYNC_CALLS and on_device(args[0] if args else None):
                self._sync(f"{name}()")
            elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _bool_index(args[1]):
                self._sync(f"{name} with a boolean mask")
            elif to_host:
                self._sync("to('cpu')")
            elif name == "repeat_interleave" and kwargs.get("output_size") is None and any(
                    on_device(x) for x in list(args[1:2]) + [kwargs.get("repeats")]):
                self._sync("repeat_interleave() without output_size")
        out = func(*args, **kwargs)
        if not to_host and (from_device or any(isinstance(x, torch.device) for x in leaves)):
            mark(out)
        return out


def _bool_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(on_device(i) and i.dtype == torch.bool for i in items)
