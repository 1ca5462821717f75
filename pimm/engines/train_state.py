"""The trainer's position in training: what a checkpoint must restore besides
the participants' own ``state_dict``s."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass
class TrainState:
    epoch: int = 0  # epochs completed
    iter_in_epoch: int = 0  # optimizer steps completed inside the current epoch
    global_step: int = 0  # optimizer steps completed in the whole run
    samples_seen: int = 0  # global (all ranks) samples consumed by training
    world_size: int = 1
    batch_size_per_rank: int = 0
    grad_accum_steps: int = 1
    num_workers_per_rank: int = 0
    best_metric_name: str | None = None
    best_metric: float | None = None
    best_step: int | None = None
    finished: bool = False

    def samples_seen_in_epoch(self) -> int:
        return self.iter_in_epoch * self.grad_accum_steps * self.batch_size_per_rank * self.world_size

    def update_best(self, name: str, value: float, greater_is_better: bool = True) -> bool:
        """Record ``value`` if it beats the best so far; True when it does."""
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return False
        better = (
            self.best_metric is None
            or (greater_is_better and value > self.best_metric)
            or (not greater_is_better and value < self.best_metric)
        )
        if better:
            self.best_metric_name, self.best_metric, self.best_step = name, float(value), self.global_step
        return better

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        known = {f.name for f in dataclasses.fields(self)}
        for key, value in state.items():
            if key in known:
                setattr(self, key, value)
