"""Sonata's optional representation fusion (upstream's ``representation_fusion_*``
arguments): a small residual MLP between the up-cast features and the
prototype heads, in the student and in the teacher (EMA-updated like the rest).

The concatenated levels are LayerNorm-ed, projected by ``Linear -> GELU ->
Dropout -> Linear`` to ``out_channels`` (hidden width ``max(in, 2 * out)``
unless given), plus a bias-free linear skip of the normalised input
(``residual``), then LayerNorm-ed again (``output_norm``). The heads then
read ``out_channels`` features instead of ``head_in_channels``, and the
model's probe output (``return_point=True``) is these fused features copied
back onto the input points. Module names are upstream's (``input_norm``,
``mlp``, ``skip``, ``output_norm``), so its checkpoints load strictly.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RepresentationFusion"]


class RepresentationFusion(nn.Module):
    """``feat (N, in_channels)`` -> ``(N, out_channels)`` (module doc)."""

    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int | None = None,
                 dropout: float = 0.0, residual: bool = True, output_norm: bool = True):
        super().__init__()
        hidden = hidden_channels or max(in_channels, 2 * out_channels)
        self.input_norm = nn.LayerNorm(in_channels)
        self.mlp = nn.Sequential(nn.Linear(in_channels, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, out_channels))
        self.skip = nn.Linear(in_channels, out_channels, bias=False) if residual else None
        self.output_norm = nn.LayerNorm(out_channels) if output_norm else nn.Identity()
        for layer in self.modules():
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        normed = self.input_norm(feat)
        out = self.mlp(normed)
        if self.skip is not None:
            out = out + self.skip(normed)
        return self.output_norm(out)
