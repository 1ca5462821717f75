"""Components for the round-3 hardening tests (imported via ``custom_imports``)."""

import os
import signal

import torch

from pimm.engines import HOOKS, HookBase
from pimm.evaluation.cls import ClsEvaluator
from pimm.models import MODELS
from pimm.models.grpo.track_policy import TrackProposalPolicy
from pimm.utils import comm
from pimm.utils.errors import UserError


@HOOKS.register_module(force=True)
class KillRankAtStep(HookBase):
    """Sends ``signal_name`` to its own process on ``rank`` after ``step``."""

    priority = "LOWEST"

    def __init__(self, step, rank=1, signal_name="SIGKILL"):
        self.step, self.rank, self.signal_name = step, rank, signal_name

    def after_step(self):
        if self.trainer.global_step == self.step and comm.get_rank() == self.rank:
            os.kill(os.getpid(), getattr(signal, self.signal_name))


@HOOKS.register_module(force=True)
class BadInputAtStep(HookBase):
    """Raises a UserError (bad input found mid-run) after ``step``."""

    def __init__(self, step):
        self.step = step

    def after_step(self):
        if self.trainer.global_step == self.step:
            raise UserError(f"data sample 17 has 3 features, the model takes 8 (found at step {self.step})")


@HOOKS.register_module(force=True)
class NaNClsEvaluator(ClsEvaluator):
    """A ClsEvaluator whose metrics include non-finite values (an empty class)."""

    def evaluate(self, loader, model, images=0):
        metrics = super().evaluate(loader, model, images)
        return {**metrics, "acc_class_empty": float("nan"), "ratio": float("inf"),
                "per_class": [float("nan"), 1.0]}


@MODELS.register_module(force=True)
class NaNRewardPolicy(TrackProposalPolicy):
    """The task-1 policy with a reward that cannot score anything (all NaN),
    or, with ``constant=True``, the same reward for every trajectory."""

    def __init__(self, constant=False, **kwargs):
        super().__init__(**kwargs)
        self.constant = constant

    def _rewards(self, actions, action_mask, track_angle, track_class):
        rewards = super()._rewards(actions, action_mask, track_angle, track_class)
        return torch.full_like(rewards, 0.5 if self.constant else float("nan"))
