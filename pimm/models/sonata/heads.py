"""Sonata's prototype head: an MLP projection, L2 normalisation, and a
weight-normalised linear layer whose rows are the prototypes (their norm
fixed at 1, so the logits are cosine similarities). Module names follow
upstream's ``OnlineCluster`` so upstream checkpoints load strictly."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

__all__ = ["PrototypeHead"]


class PrototypeHead(nn.Module):
    """``feat (N, in_channels)`` -> cosine similarity to ``num_prototypes`` prototypes."""

    def __init__(self, in_channels: int, hidden_channels: int = 4096, embed_channels: int = 512,
                 num_prototypes: int = 4096):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(in_channels, hidden_channels), nn.GELU(),
                                 nn.Linear(hidden_channels, embed_channels))
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.trunc_normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)
        self.prototype = weight_norm(nn.Linear(embed_channels, num_prototypes, bias=False))
        magnitude = self.prototype.parametrizations.weight.original0
        magnitude.data.fill_(1.0)
        magnitude.requires_grad = False  # only the directions are learnt

    @property
    def num_prototypes(self) -> int:
        return self.prototype.out_features

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        embed = self.mlp(feat)
        eps = 1e-6 if embed.dtype == torch.float16 else 1e-12
        return self.prototype(nn.functional.normalize(embed, dim=-1, p=2, eps=eps))
