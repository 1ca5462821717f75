"""Checkpoint participants that are not components themselves: the RNG
streams, the hooks' states, and the metadata a resume compares against."""

from __future__ import annotations

from pimm.engines.data import train_sampler
from pimm.engines.resume import flatten_config
from pimm.utils.rng import capture_rng_state, restore_rng_state

__all__ = ["RNGParticipant", "HooksParticipant", "MetaParticipant", "LoaderParticipant"]


class RNGParticipant:
    """The process's RNG streams as a checkpoint participant."""

    def state_dict(self) -> dict:
        return capture_rng_state()

    def load_state_dict(self, state: dict) -> None:
        restore_rng_state(state)


class MetaParticipant:
    """What a resume compares against: the config and the schedule length."""

    def __init__(self, trainer):
        self.meta = {"config_flat": flatten_config(trainer.cfg), "iters_per_epoch": trainer.iters_per_epoch,
                     "total_steps": trainer.iters_per_epoch * trainer.max_epoch}

    def state_dict(self) -> dict:
        return self.meta

    def load_state_dict(self, state: dict) -> None:
        pass  # read by the resume logic, not restored


class HooksParticipant:
    """All hooks' states, matched back by position and type."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> list:
        return [{"type": type(h).__name__, "state": h.state_dict()} for h in self.trainer.hooks]

    def load_state_dict(self, states: list) -> None:
        hooks = self.trainer.hooks
        if [s["type"] for s in states] != [type(h).__name__ for h in hooks]:
            self.trainer.logger.warning(
                "The hooks differ from the checkpoint's; restoring hook states by type in order of appearance"
            )
            by_type: dict[str, list] = {}
            for s in states:
                by_type.setdefault(s["type"], []).append(s["state"])
            for hook in hooks:
                queue = by_type.get(type(hook).__name__)
                if queue:
                    hook.load_state_dict(queue.pop(0))
            return
        for hook, s in zip(hooks, states):
            hook.load_state_dict(s["state"])


class LoaderParticipant:
    """The training data position.

    Under a :class:`StatefulRandomSampler` a sample is a pure function of
    ``(seed, epoch, position)``, so the position alone restores the data
    stream exactly and in O(1): no worker state, no replayed batches. Other
    loaders (iterable data sets) save and restore ``StatefulDataLoader``'s
    own state, snapshotted at the checkpoint cadence."""

    def __init__(self, trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        trainer = self.trainer
        state = trainer.train_state
        if train_sampler(trainer.train_loader) is not None:
            return {"kind": "position", "epoch": state.epoch, "samples_in_epoch": state.samples_seen_in_epoch()}
        # Between epochs the loader still describes the finished epoch's iterator.
        return {"kind": "loader", "state": trainer.train_loader.state_dict() if state.iter_in_epoch else None}

    def load_state_dict(self, state: dict) -> None:
        if state["kind"] == "position":
            self.trainer.resume_position(state["samples_in_epoch"])
        elif state["state"] is not None:
            self.trainer.train_loader.load_state_dict(state["state"])
