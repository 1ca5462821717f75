"""What the Point Transformer v1 / v2 reference fixture and its test share:
weights and inputs from a formula, and the batch of a run.

Every value comes from an integer hash of (seed, element index) done in
32-bit integer arithmetic: the same numbers on any machine and any torch
version, in pimm's tests and in the scratch venv that runs upstream's code
(``tests/fixtures/point_transformers/make_reference.py`` imports this file
by path). Nothing but the outputs is stored: PT-v1's widths are fixed and
its models hold 0.35-7.8 M parameters.

Weight scales keep activations near 1 through deep networks: a weight
matrix uniform with variance ``1 / fan_in``, norm scales near 1, biases and
running means near 0, running variances in [0.5, 1].
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["uniform", "formula_state", "make_inputs", "batch_for", "PDNORM_CONTEXT"]

_MASK = 0xFFFFFFFF
PDNORM_CONTEXT = 8  # context_channels of the PT-v2m3 runs


def uniform(count: int, seed: int) -> torch.Tensor:
    """``count`` float64 values in [-1, 1) from a 32-bit hash of (seed, index)."""
    x = (torch.arange(count, dtype=torch.int64) * 2654435761 + (seed & _MASK) * 40503 + 12345) & _MASK
    x = x ^ (x >> 15)
    x = (x * 2246822519) & _MASK  # int64 products wrap; the low 32 bits are exact
    x = x ^ (x >> 13)
    x = (x * 3266489917) & _MASK
    x = x ^ (x >> 16)
    return x.double() / 2.0**31 - 1.0


def _value(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    numel = 1
    for size in shape:
        numel *= size
    u = uniform(numel, zlib.crc32(name.encode())).reshape(shape)
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "running_var":
        return 0.75 + 0.25 * u
    if leaf in ("running_mean", "bias"):
        return 0.1 * u
    if len(shape) == 1:  # a norm's scale
        return 1.0 + 0.2 * u
    return u * (3.0 / max(1, numel // shape[0])) ** 0.5


def formula_state(shapes: dict[str, tuple[int, ...]], dtypes: dict[str, torch.dtype] | None = None) -> dict:
    """A state dict for ``shapes`` (name -> shape): float tensors from the
    formula (seeded by the name), integer ones (``num_batches_tracked``) zero."""
    state = {}
    for name, shape in shapes.items():
        dtype = (dtypes or {}).get(name, torch.int64 if name.endswith("num_batches_tracked") else torch.float32)
        if dtype.is_floating_point:
            state[name] = _value(name, tuple(shape)).to(dtype)
        else:
            state[name] = torch.zeros(tuple(shape), dtype=dtype)
    return state


def _cloud(count: int, seed: int, box, shift: float) -> torch.Tensor:
    """``count`` points uniform in ``box`` (+ ``shift``)."""
    u = (uniform(count * 3, seed).reshape(count, 3) + 1) / 2
    return (u * torch.tensor(box, dtype=torch.float64) + shift).float()


def make_inputs() -> dict:
    """PT-v1: two events of 800 and 300 points (the small one keeps 1 point at
    the last level: padded neighbour tables, interpolation with missing
    neighbours), ``feat`` = coordinates and a colour (6), the classifiers'
    ``feat`` the colour. PT-v2: two events of 160 and 110 points in a small
    box (grid pooling merges points at every stage), 4 features. No two
    distances tie. Also PT-v2m3's context and the projections the gradient
    runs differentiate."""
    v1_coord = torch.cat([_cloud(800, 1, (2.0, 1.0, 0.5), 0.0), _cloud(300, 2, (2.0, 1.0, 0.5), 0.3)])
    v1_color = _cloud(1100, 3, (1.0, 1.0, 1.0), 0.0)
    v2_coord = torch.cat([_cloud(160, 4, (0.6, 0.3, 0.3), 0.0), _cloud(110, 5, (0.6, 0.3, 0.3), 0.05)])
    v2_feat = uniform(270 * 4, 6).reshape(270, 4).float() * 2
    return dict(v1=dict(coord=v1_coord, feat=torch.cat([v1_coord, v1_color], 1), offset=torch.tensor([800, 1100])),
                v1_cls=dict(coord=v1_coord, feat=v1_color, offset=torch.tensor([800, 1100])),
                v2=dict(coord=v2_coord, feat=v2_feat, offset=torch.tensor([160, 270])),
                context=uniform(PDNORM_CONTEXT, 7).reshape(1, -1).float(),
                projection=dict(v1=uniform(1100 * 3, 8).reshape(1100, 3).float(),
                                v2=uniform(270 * 8, 9).reshape(270, 8).float()))


def batch_for(inputs: dict, which: str, extra: dict) -> dict:
    """A run's batch: the input ``which`` plus its extra keys (``cls_token``
    ids, ``condition`` names, ``context``: the inputs' context)."""
    batch = {k: v.clone() for k, v in inputs[which].items()}
    for key, value in extra.items():
        if value == "context":
            batch[key] = inputs["context"].clone()
        else:
            batch[key] = torch.tensor(value) if key == "cls_token" else list(value)
    return batch
