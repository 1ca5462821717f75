"""NaNGuard: catch a non-finite loss or gradient before the optimizer applies it.

In ``after_backward`` (gradients present, unscaled, before clipping and the
optimizer step) the guard checks the step's loss (``comm_info["loss"]``) and
every gradient of ``trainer.model_without_ddp``. The check is one fused
device reduction, then **one host sync per step** to read the verdict (and,
under DDP, one one-element all-reduce so that every rank takes the same
decision). That is why the guard is opt-in: without it a non-finite
``train/loss`` still stops the run, at the next metrics flush
(:class:`~pimm.engines.observe.metrics.NonFiniteMetric`), without a per-step sync.

On a bad step the log names the culprit: the model outputs (scalars of
``comm_info["model_output_dict"]``) that are not finite, and the first
parameter, in the model's order, whose gradient is not (these look-ups run on
bad steps only). Then, by ``policy``:

* ``skip``: the update is dropped (``trainer.optim_step.skip``: no optimizer
  or scheduler step, gradients zeroed; EMAHook does not average either).
  ``metrics.jsonl`` shows the skipped step's ``train/loss`` as ``null`` and
  ``train/skipped_steps`` (the run's running count) at that step; the metric
  channel's stop on a non-finite ``train/loss`` is switched off, since the
  guard already handles every such step. More than
  ``max_consecutive_skips`` bad steps in a row stop the run as below.
* ``stop``: raise :class:`NonFiniteStep` before the optimizer step: the
  weights stay the last good ones, nothing after the failure writes a
  checkpoint (the committed ones stay untouched), and ``tools/train.py``
  exits 1 with the message.

Under a GradScaler (fp16 AMP) overflowing gradients are the scaler's business
(it skips the step and lowers the scale); the guard then checks the loss only.
"""

from __future__ import annotations

import torch

from pimm.engines.hooks.base import HookBase
from pimm.engines.registries import HOOKS
from pimm.utils import comm
from pimm.utils.domains import Choice, PosInt

__all__ = ["NaNGuard", "NonFiniteStep"]

_POLICIES = ("skip", "stop")


class NonFiniteStep(FloatingPointError):
    """A step's loss or gradients are not finite and the guard stops the run."""


@HOOKS.register_module()
class NaNGuard(HookBase):
    """Options:

    policy: ``"skip"`` (drop the update) or ``"stop"`` (fail before it).
    max_consecutive_skips: ``skip`` only: bad steps in a row tolerated before stopping.
    check_gradients: also check the gradients (not only the loss).
    """

    # after_backward: after every hook that may change the gradients.
    priority = "VERY_LOW"

    domains = dict(policy=Choice("skip", "stop"), max_consecutive_skips=PosInt)

    def __init__(self, policy: str = "skip", max_consecutive_skips: int = 5, check_gradients: bool = True):
        if policy not in _POLICIES:
            raise ValueError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) \
                or max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips must be an integer >= 0, got {max_consecutive_skips!r}")
        if not isinstance(check_gradients, bool):
            raise ValueError(f"check_gradients must be True or False, got {check_gradients!r}")
        self.policy, self.max_consecutive_skips, self.check_gradients = policy, max_consecutive_skips, check_gradients
        self.consecutive = 0  # bad steps in a row
        self.skipped = 0  # steps skipped in the whole run
        self._skipped_now = False

    def before_train(self) -> None:
        if self.policy == "skip":
            # Every non-finite loss is a step this guard skips: it must not stop the run at the next flush.
            self.trainer.metrics.watch_finite.discard("train/loss")

    # -- the check --------------------------------------------------------
    def _gradients(self) -> list[torch.Tensor]:
        if not self.check_gradients or self.trainer.optim_step.scaler is not None:
            return []
        return [p.grad for p in self.trainer.model_without_ddp.parameters() if p.grad is not None]

    def _bad(self) -> bool:
        """One device flag for the loss and all gradients, read once (agreed across ranks)."""
        loss = self.trainer.comm_info.get("loss")
        flags = []
        if isinstance(loss, torch.Tensor):
            flags.append(~torch.isfinite(loss.detach()).all())
        grads = self._gradients()
        if grads:
            # The max-abs norm is NaN/inf exactly when an element is, and cannot overflow.
            norm = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: sharded gradients
            flags.append(~torch.isfinite(norm))
        if not flags:
            return False
        bad = torch.stack([f.to(flags[0].device) for f in flags]).any().float().reshape(1)
        return bool(comm.all_reduce(bad, op="max").item())

    def describe(self) -> str:
        """What is not finite on this rank (called on bad steps only)."""
        trainer = self.trainer
        parts = []
        loss = trainer.comm_info.get("loss")
        if isinstance(loss, torch.Tensor) and not torch.isfinite(loss).all():
            parts.append(f"loss={loss.item()}")
        outputs = trainer.comm_info.get("model_output_dict") or {}
        bad_outputs = [k for k, v in outputs.items() if isinstance(v, torch.Tensor) and v.ndim == 0
                       and v.is_floating_point() and not torch.isfinite(v).item()]
        if bad_outputs:
            parts.append(f"non-finite model outputs: {', '.join(bad_outputs)}")
        if self._gradients():
            named = [(n, p.grad) for n, p in trainer.model_without_ddp.named_parameters() if p.grad is not None]
            bad = [n for n, g in named if not torch.isfinite(g).all()]
            if bad:
                parts.append(f"first non-finite gradient: {bad[0]} ({len(bad)} of {len(named)} parameters)")
        return "; ".join(parts) or "non-finite on another rank"

    def after_backward(self) -> None:
        if not self._bad():
            self.consecutive = 0
            return
        trainer = self.trainer
        step = trainer.global_step + 1  # the step being computed
        what = self.describe()
        self.consecutive += 1
        if self.policy == "stop" or self.consecutive > self.max_consecutive_skips:
            why = ("policy='stop'" if self.policy == "stop"
                   else f"{self.consecutive} bad steps in a row, max_consecutive_skips={self.max_consecutive_skips}")
            raise NonFiniteStep(
                f"NaNGuard: non-finite values at step {step} ({what}); stopping before the update ({why}). The "
                "last committed checkpoint holds the last good state; lower the learning rate, enable clip_grad, "
                "or check the data"
            )
        self.skipped += 1
        self._skipped_now = True
        trainer.optim_step.skip(f"NaNGuard: non-finite values at step {step}")
        trainer.logger.warning(f"NaNGuard: skipped the update of step {step} ({what}); {self.consecutive} in a row "
                               f"(max {self.max_consecutive_skips}), {self.skipped} in this run")

    def after_step(self) -> None:
        if self._skipped_now:
            self._skipped_now = False
            self.trainer.metrics.put("train/skipped_steps", self.skipped)

    # -- state --------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.skipped = state.get("consecutive", 0), state.get("skipped", 0)
