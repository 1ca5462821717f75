"""``nn.Linear`` whose CPU forward is a matrix product, then the bias added.

``F.linear`` with a bias runs ``addmm``, which on the CPU first copies the
bias into every row of the output and then accumulates the product into it;
that broadcast copy is slow for PT-v3's narrow levels (17,860 x 16 -> 64:
1.10 ms against 0.56 ms for ``mm`` then ``add_``, one thread), and the
copies summed to ~14 ms of a ~400 ms training step of the shipped LArTPC
config (``bench/ptv3.py``). Same parameters, names and function (the sum
is rounded in the other order: differences of a float32 ulp); on CUDA the
fused ``addmm`` (bias in the GEMM epilogue) is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Linear"]


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` (same state dict); on the CPU, ``x @ W^T`` then ``+ b``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None or x.device.type != "cpu":
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight).add_(self.bias)
