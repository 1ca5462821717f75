"""The frozen reference policy of GRPO's KL term, kept inside the model.

A policy model that uses ``beta > 0`` holds a :class:`FrozenReference` as a
submodule. Being a submodule puts the reference weights in the model's
``state_dict``, so checkpoints save and restore them with everything else
(exact resume needs them: the KL of every later step depends on them) and no
trainer has to know about it. Its parameters have ``requires_grad=False``, so
the optimizer and DDP leave them alone.

The snapshot is taken lazily, by :meth:`FrozenReference.ensure` at the first
rollout, not when the model is built: a ``weight=`` warm start (the usual way
to start GRPO fine-tuning) is loaded after the model is built, and the
reference must be the policy GRPO starts from. The ``taken`` flag is part of
the state, so a resumed run keeps the original reference instead of copying
the current policy. With ``beta = 0`` a model creates no reference at all.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["FrozenReference"]


class FrozenReference(nn.Module):
    def __init__(self, policy: nn.Module):
        super().__init__()
        self.network = copy.deepcopy(policy).requires_grad_(False)
        self.register_buffer("taken", torch.zeros((), dtype=torch.bool))
        self.network.eval()

    @torch.no_grad()
    def ensure(self, policy: nn.Module) -> None:
        """Copy ``policy``'s weights the first time only. Copied tensor by tensor,
        not through ``state_dict()``: under FSDP that call would put the sharded
        parameters back in the middle of a rollout that runs on gathered ones."""
        if not bool(self.taken):
            source = {**dict(policy.named_buffers()), **dict(policy.named_parameters())}
            for name, tensor in {**dict(self.network.named_buffers()),
                                 **dict(self.network.named_parameters())}.items():
                tensor.copy_(source[name])
            self.taken.fill_(True)

    def train(self, mode: bool = True) -> "FrozenReference":
        # Always in eval mode: dropout or batch statistics would make it a moving target.
        return super().train(False)

    def forward(self, *args, **kwargs):
        with torch.no_grad():
            return self.network(*args, **kwargs)
