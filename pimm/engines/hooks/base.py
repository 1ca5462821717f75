"""The hook contract.

A hook owns one job around the training loop (timing, logging,
checkpointing, evaluation...). The trainer calls, in priority order,

    before_train
      (before_epoch
         (before_step, run_step, after_step)*
       after_epoch)*
    after_train

and only the hooks that override a method are called for it (dispatch
tables are built once). ``modify_config(cfg)`` runs once while the trainer is
built, before any component exists, so a hook can adjust the config it needs.
A hook's ``state_dict`` goes into every checkpoint and comes back through
``load_state_dict`` on resume.
"""

from __future__ import annotations

from typing import Any

from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError

__all__ = ["HookBase", "PRIORITIES", "get_priority", "build_hooks"]

PRIORITIES = {
    "HIGHEST": 0,
    "VERY_HIGH": 10,
    "HIGH": 30,
    "ABOVE_NORMAL": 40,
    "NORMAL": 50,
    "BELOW_NORMAL": 60,
    "LOW": 70,
    "VERY_LOW": 90,
    "LOWEST": 100,
}

PHASES = ("before_train", "before_epoch", "before_step", "after_step", "after_epoch", "after_train")


def get_priority(priority: int | str) -> int:
    """Lower runs first. Accepts an int in 0..100 or a name in :data:`PRIORITIES`."""
    if isinstance(priority, bool):
        raise ValueError(f"hook priority must be an int 0..100 or one of {list(PRIORITIES)}, got {priority!r}")
    if isinstance(priority, int):
        if not 0 <= priority <= 100:
            raise ValueError(f"hook priority must be within 0..100, got {priority}")
        return priority
    if isinstance(priority, str) and priority.upper() in PRIORITIES:
        return PRIORITIES[priority.upper()]
    raise ValueError(f"hook priority must be an int 0..100 or one of {list(PRIORITIES)}, got {priority!r}")


class HookBase:
    priority: int | str = "NORMAL"

    #: A weak proxy to the trainer, set when the hook is registered.
    trainer: Any = None

    def modify_config(self, cfg) -> None:
        pass

    def before_train(self) -> None:
        pass

    def before_epoch(self) -> None:
        pass

    def before_step(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def after_epoch(self) -> None:
        pass

    def after_train(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def overrides(self, phase: str) -> bool:
        return getattr(type(self), phase) is not getattr(HookBase, phase)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"


def build_hooks(hook_cfgs) -> list[HookBase]:
    """Build the config's ``hooks`` list. A ``priority`` key is taken here and
    set on the hook; the constructor never sees it."""
    hooks = []
    for index, hook_cfg in enumerate(hook_cfgs):
        if not isinstance(hook_cfg, dict):
            raise ConfigError(f"hooks[{index}] must be a dict(type=...), got {hook_cfg!r}")
        hook_cfg = dict(hook_cfg)
        priority = hook_cfg.pop("priority", None)
        hook = HOOKS.build(hook_cfg)
        if priority is not None:
            try:
                hook.priority = get_priority(priority)
            except ValueError as err:
                raise ConfigError(f"hooks[{index}] ({hook_cfg['type']}): {err}") from None
        hooks.append(hook)
    return hooks
