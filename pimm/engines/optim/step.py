"""One optimizer update, the same for every trainer.

A trainer computes losses; :class:`OptimStep` turns them into one update::

    for i, micro_batch in enumerate(micro_batches):
        with optim_step.sync(last=i == len(micro_batches) - 1):   # DDP/FSDP: all-reduce only on the last
            optim_step.backward(loss_of(micro_batch) * weight)   # AMP-scaled when a GradScaler is on
    result = optim_step.step()   # unscale, on_gradients(), clip, step, scheduler, zero_grad

:meth:`OptimStep.step` unscales the gradients (fp16 AMP), calls
``on_gradients`` (the trainer's ``after_backward`` hooks: gradients are
present and in true units), clips, steps the optimizer, steps the scheduler
only if the optimizer really stepped (a GradScaler skips steps whose
gradients overflowed), and zeroes the gradients. It returns
:class:`StepResult`: the gradient norm (a device tensor, or None when it was
neither clipped nor asked for) and whether the step happened.

Only the fp16 GradScaler path synchronises with the host (to learn whether
the step was skipped); every other path queues device work only.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, NamedTuple

import torch

__all__ = ["OptimStep", "StepResult"]


class StepResult(NamedTuple):
    """What one :meth:`OptimStep.step` did, for the trainer and after_step hooks."""
    grad_norm: torch.Tensor | None  # total 2-norm before clipping (None: not computed)
    stepped: bool  # False when the GradScaler skipped a step with inf/NaN gradients, or skip() was called
    lr: float  # the learning rate of the first param group that this update used


class OptimStep:
    """Owns the GradScaler, clipping, gradient-sync control, the optimizer step,
    ``zero_grad`` and the scheduler step (every update, or every
    ``scheduler_interval`` updates that really stepped).

    ``model`` is the module the loss is computed through (the DDP/FSDP wrapper
    when distributed); it decides how gradient sync is paused on inner
    micro-batches. ``track_grad_norm`` computes the norm on every step even
    without clipping (one fused norm over all gradients)."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, scheduler=None, scaler: torch.amp.GradScaler | None = None,
                 clip_grad: float | None = None, model: torch.nn.Module | None = None,
                 params: Iterable[torch.nn.Parameter] | None = None, track_grad_norm: bool = False,
                 scheduler_interval: int = 1):
        if isinstance(scheduler_interval, bool) or not isinstance(scheduler_interval, int) or scheduler_interval < 1:
            raise ValueError(f"scheduler_interval must be a positive integer, got {scheduler_interval!r}")
        self.scheduler_interval = scheduler_interval
        self.updates = 0  # optimizer updates that really stepped (checkpointed when scheduler_interval > 1)
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None
        self.clip_grad = clip_grad
        self.track_grad_norm = track_grad_norm
        if params is None:
            params = [p for group in optimizer.param_groups for p in group["params"]]
        self.params = [p for p in params if p.requires_grad]
        self.on_gradients: Callable[[], None] | None = None
        self._skip_reason: str | None = None
        self._pause_sync = _sync_pauser(model)

    def skip(self, reason: str) -> None:
        """Drop this update (call from ``after_backward``, e.g. on non-finite
        gradients): no optimizer or scheduler step, gradients zeroed. Every rank
        must take the same decision."""
        self._skip_reason = reason

    def sync(self, last: bool = True):
        """Context for one micro-batch's backward: gradient all-reduce happens only when ``last``."""
        if last or self._pause_sync is None:
            return _NO_PAUSE
        return self._pause_sync()

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss``, scaled by the GradScaler when one is in use."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> StepResult:
        """Finish the update from the accumulated gradients: unscale, call
        ``on_gradients`` (the after_backward hooks), clip or measure the norm,
        step the optimizer (unless :meth:`skip` was called or the GradScaler
        finds inf/NaN), zero the gradients, and advance the scheduler only when
        the optimizer really stepped."""
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if self.on_gradients is not None:
            self.on_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        if self._skip_reason is not None:
            self._skip_reason = None
            self.optimizer.zero_grad(set_to_none=True)
            return StepResult(None, False, lr)
        grad_norm = None
        if self.clip_grad is not None:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad)
        elif self.track_grad_norm:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in self.params if p.grad is not None])
        if grad_norm is not None and hasattr(grad_norm, "full_tensor"):  # FSDP: a norm over sharded gradients
            grad_norm = grad_norm.full_tensor()
        if scaler is not None:
            scale = scaler.get_scale()
            scaler.step(self.optimizer)
            scaler.update()
            stepped = scaler.get_scale() >= scale  # the scale shrinks exactly when the step was skipped
        else:
            self.optimizer.step()
            stepped = True
        self.optimizer.zero_grad(set_to_none=True)
        if stepped:
            self.updates += 1
            if self.scheduler is not None and (self.scheduler_interval == 1 or
                                               self.updates % self.scheduler_interval == 0):
                self.scheduler.step()
        return StepResult(grad_norm, stepped, lr)

    def state_dict(self) -> dict:
        """The update count (where the next scheduler step falls with ``scheduler_interval``)."""
        return {"updates": self.updates}

    def load_state_dict(self, state: dict) -> None:
        """Restore the update count."""
        self.updates = int(state["updates"])

    def zero_grad(self) -> None:
        """Drop the gradients (set to None)."""
        self.optimizer.zero_grad(set_to_none=True)


_NO_PAUSE = contextlib.nullcontext()  # stateless, so one instance serves every step


def _sync_pauser(model: torch.nn.Module | None):
    """A zero-argument context factory that pauses gradient sync, or None."""
    if model is None:
        return None
    model = getattr(model, "_orig_mod", model)  # under torch.compile: the wrapped DDP/FSDP module
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
        @contextlib.contextmanager
        def paused():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return paused
    return None
