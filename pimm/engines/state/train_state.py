"""The trainer's position in training: what a checkpoint must restore besides
the participants' own ``state_dict``s.

The layout fields (world size, batch per rank, accumulation, workers) say how
the position was counted. A resume under another layout keeps the current
layout and continues after the same number of samples (see
:mod:`pimm.engines.state.participants`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["TrainState", "LAYOUT_FIELDS"]

LAYOUT_FIELDS = ("world_size", "batch_size_per_rank", "grad_accum_steps", "num_workers_per_rank")


@dataclass
class TrainState:
    """Where the run is: completed epochs and steps, the samples consumed, and
    the layout they were consumed with (world size, per-rank batch size,
    accumulation, workers). It is checkpointed; a resume compares the layout to
    warn when a different one cannot replay the data order exactly.
    """
    epoch: int = 0  # epochs completed
    iter_in_epoch: int = 0  # optimizer steps completed inside the current epoch
    global_step: int = 0  # optimizer steps completed in the whole run
    samples_seen: int = 0  # global (all ranks) samples consumed by training
    world_size: int = 1
    batch_size_per_rank: int = 0
    grad_accum_steps: int = 1
    num_workers_per_rank: int = 0
    stop_reason: str | None = None  # set when a run stopped early by request (e.g. early stopping)

    def samples_seen_in_epoch(self) -> int:
        """Samples the current epoch has consumed over all ranks."""
        return self.iter_in_epoch * self.grad_accum_steps * self.batch_size_per_rank * self.world_size

    def layout(self) -> dict:
        """The process layout fields (world size, batch per rank, accumulation, workers)."""
        return {name: getattr(self, name) for name in LAYOUT_FIELDS}

    def state_dict(self) -> dict:
        """Every field."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        """Set the known fields from ``state``."""
        known = {f.name for f in dataclasses.fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
