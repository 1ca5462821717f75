"""Everything resume touches, and nothing else: the checkpoint manager, the
participants it collects from and restores into, the trainer's position, the
restore rules and model weight files."""

from pimm.engines.state.manager import CheckpointManager, LoadedCheckpoint, Retention, atomic_torch_save
from pimm.engines.state.restore import RestoreContext, restore_latest
from pimm.engines.state.train_state import TrainState
from pimm.engines.state.weights import load_weights, read_weights

__all__ = ["CheckpointManager", "LoadedCheckpoint", "Retention", "atomic_torch_save", "RestoreContext",
           "restore_latest", "TrainState", "load_weights", "read_weights"]
