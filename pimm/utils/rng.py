"""Capture, restore and derive random-number-generator states.

Exact resume needs every stream that training draws from: Python's
``random``, NumPy's global generator, torch's CPU generator and every CUDA
device generator. Seeds for sub-streams (per rank, per epoch, per sample)
are derived by hashing their coordinates, so they never collide and never
depend on how many processes or workers exist.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import struct
from typing import Iterator

import numpy as np
import torch

__all__ = ["derive_seed", "seed_all", "seed_cpu_streams", "capture_rng_state", "restore_rng_state", "fork_rng"]


def derive_seed(*coords: int) -> int:
    """A 63-bit seed that is a stable function of integer coordinates,
    e.g. ``derive_seed(base_seed, epoch, sample_index)``."""
    digest = hashlib.blake2b(struct.pack(f"<{len(coords)}q", *coords), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def seed_all(seed: int) -> None:
    """Seed python, numpy (global) and torch (CPU and all CUDA devices)."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def seed_cpu_streams(seed: int) -> None:
    """Seed python, numpy and torch's CPU generator only: the per-sample reseed
    in data workers. ``torch.manual_seed`` also queues lazy CUDA seeding,
    which costs hundreds of microseconds per call when CUDA is not initialised."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.default_generator.manual_seed(seed)


def _plain_python_state(state: tuple) -> dict:
    version, words, gauss_next = state
    return {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss_next": gauss_next}


def _python_state(plain) -> tuple:
    if isinstance(plain, tuple):  # a checkpoint from before states were plain data
        return plain
    return plain["version"], tuple(plain["words"].tolist()), plain["gauss_next"]


def _plain_numpy_state(state: tuple) -> dict:
    kind, key, pos, has_gauss, cached_gaussian = state
    return {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}


def _numpy_state(plain) -> tuple:
    if isinstance(plain, tuple):  # a checkpoint from before states were plain data
        return plain
    return (plain["kind"], plain["key"].numpy().astype(np.uint32), plain["pos"], plain["has_gauss"],
            plain["cached_gaussian"])


def capture_rng_state() -> dict:
    """Every stream's state as plain data (tensors, numbers, strings), so a
    checkpoint holding it loads with ``torch.load(..., weights_only=True)``."""
    state = {
        "python": _plain_python_state(random.getstate()),
        "numpy": _plain_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    """Set every stream from :func:`capture_rng_state`'s result (or the tuple
    forms older checkpoints hold)."""
    random.setstate(_python_state(state["python"]))
    np.random.set_state(_numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            torch.cuda.set_rng_state(cuda_states[torch.cuda.current_device() % len(cuda_states)])


@contextlib.contextmanager
def fork_rng() -> Iterator[None]:
    """Run a block (an evaluation, say) without disturbing any training RNG stream."""
    saved = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(saved)
