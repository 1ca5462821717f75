"""The hook contract.

A hook owns one job around the training loop (timing, logging,
checkpointing, evaluation, early stopping...). The trainer calls, in
priority order (lower first; ties keep config order)::

    modify_config(cfg)                   once, before anything reads the config
    (everything is built; a resume restores every participant, hooks included)
    after_load_checkpoint()              after a resume or a warm start
    before_train
      (before_epoch
         (before_step
            run_step: forward, backward, after_backward, optimizer step
          after_step)*
       after_epoch)*
    after_train                          always, also after a failure (in a finally)
    on_exception(exc)                    when training fails, before after_train

and, whenever they happen: ``before_val`` / ``after_val(metrics)`` around an
evaluation, ``before_save_checkpoint`` before the state is collected.

Only the hooks that override a phase are called for it (dispatch tuples are
built once), so a phase nobody uses costs nothing. A hook's ``state_dict``
goes into every checkpoint and comes back through ``load_state_dict`` before
``before_train``. ``self.trainer`` is a weak proxy to the trainer; hooks share
values through ``self.trainer.metrics`` (:mod:`pimm.engines.observe.metrics`).
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any

from pimm.engines.registries import HOOKS
from pimm.utils.errors import ConfigError

__all__ = ["HookBase", "EvalRun", "EVAL_KINDS", "PRIORITIES", "get_priority", "build_hooks", "calling_hook"]

#: Why an evaluation runs: ``scheduled`` (an evaluator's interval),
#: ``final`` (the weights training ended with, unless just scored),
#: ``on_demand`` (a signal or live control: metrics only, no best model,
#: no decision, no evaluator schedule moves).
EVAL_KINDS = ("scheduled", "final", "on_demand")

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

PHASES = ("before_train", "before_epoch", "before_step", "after_backward", "after_step", "after_epoch", "after_train",
          "before_val", "after_val", "before_save_checkpoint", "after_load_checkpoint", "on_exception")


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


@dataclass(frozen=True)
class EvalRun:
    """Which evaluation ``before_val`` / ``after_val`` are about.

    ``kind``: why it runs (:data:`EVAL_KINDS`). ``prefix``: the metrics'
    prefix (``val/acc``). ``step``: the global step of the weights.
    ``model``: the module being scored. ``evaluators``: the evaluator hooks
    that score it. ``weights``: whose weights they are, ``"trained"`` for
    the model being trained, otherwise the label of the hook that asked
    (``"ema"`` for EMAHook). An evaluation of other weights keeps the kind of
    the evaluation it follows, so an EMA evaluation after a scheduled one is
    ``scheduled`` too (EarlyStopping on ``val_ema/...`` counts it).
    """

    kind: str
    prefix: str
    step: int
    model: Any = None
    evaluators: tuple = ()
    weights: str = "trained"

    def __post_init__(self):
        if self.kind not in EVAL_KINDS:
            raise ValueError(f"EvalRun kind must be one of {EVAL_KINDS}, got {self.kind!r}")

    @property
    def of_trained_weights(self) -> bool:
        """True when the model being trained is what is scored."""
        return self.weights == "trained"


class HookBase:
    """Subclass, override the phases you need, register in ``HOOKS`` and list
    in the config's ``hooks``. See the module docstring for the order."""

    priority: int | str = "NORMAL"

    #: A weak proxy to the trainer, set when the hook is registered.
    trainer: Any = None

    #: Where its config entry came from (``default_hooks.timer``, ``hooks[2]``), set when it is built.
    origin: str = ""

    def modify_config(self, cfg) -> None:
        """Adjust the config before anything reads it (defaults, other hooks...)."""

    def before_train(self) -> None:
        """Training starts (the state is already restored on resume)."""

    def before_epoch(self) -> None:
        """An epoch starts (also a resumed, partly done one)."""

    def before_step(self) -> None:
        """A training step starts."""

    def after_backward(self) -> None:
        """Gradients of this step are present (unscaled, before clipping and the optimizer step)."""

    def after_step(self) -> None:
        """A training step finished (``trainer.global_step`` counts it)."""

    def after_epoch(self) -> None:
        """An epoch finished (``trainer.train_state.epoch`` counts it)."""

    def after_train(self) -> None:
        """Training ended: completed, stopped, pre-empted, interrupted (Ctrl-C), failed
        or aborted (a second Ctrl-C) (``trainer.outcome`` says which; after a
        failure or an abort avoid collectives)."""

    def on_exception(self, exc: BaseException) -> None:
        """Training failed with ``exc`` (called before ``after_train``)."""

    def before_val(self, run: EvalRun) -> None:
        """An evaluation starts; ``run`` says which (kind, prefix, step, model)."""

    def after_val(self, metrics: dict, run: EvalRun) -> None:
        """An evaluation finished; ``metrics`` maps prefixed names (``val/mIoU``) to
        values, ``run`` says which evaluation it was."""

    def before_save_checkpoint(self) -> None:
        """A checkpoint is about to be collected."""

    def after_load_checkpoint(self) -> None:
        """The trainer restored a checkpoint or warm-start weights."""

    def state_dict(self) -> dict:
        """This hook's state, saved in every checkpoint (per rank); empty by default."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what :meth:`state_dict` returned (on resume, before ``before_train``)."""

    def overrides(self, phase: str) -> bool:
        """True when this hook's class implements ``phase`` (only those are dispatched)."""
        return getattr(type(self), phase) is not getattr(HookBase, phase)

    def phase_callable(self, phase: str):
        """The callable the trainer dispatches ``phase`` to, decided once when the
        hook is registered. Hooks written for the earlier ``before_val(self)`` /
        ``after_val(self, metrics)`` signatures are adapted here (the run object
        is dropped), so they keep working without a per-call check."""
        fn = getattr(self, phase)
        wanted = _VAL_ARITY.get(phase)
        if wanted is None or _positional_arity(fn) >= wanted:
            return fn
        if phase == "before_val":
            def adapted(run):
                return fn()
        else:
            def adapted(metrics, run):
                return fn(metrics)
        adapted.__self__ = self  # dispatch introspection (which hook a phase calls) keeps working
        return adapted

    def __repr__(self) -> str:
        return f"{type(self).__name__}(priority={self.priority})"


_VAL_ARITY = {"before_val": 1, "after_val": 2}


def calling_hook() -> str:
    """The hook whose method is on the call stack (the innermost one), as an
    error line names it: ``MyHook (hooks[2])``; ``""`` when no hook is. For the
    messages of calls hooks make (``trainer.writer.add_scalar``...): it walks
    the stack, so it is for the error path only."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        try:
            is_hook = isinstance(owner, HookBase)
        except ReferenceError:  # a weak proxy whose object is gone
            is_hook = False
        if is_hook:
            origin = getattr(owner, "origin", "")
            return f"{type(owner).__name__} ({origin})" if origin else type(owner).__name__
        frame = frame.f_back
    return ""


def _positional_arity(fn) -> int:
    """How many positional arguments a bound method takes (a ``*args`` counts as many)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 99
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 99
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def build_hooks(hook_cfgs, origins=None) -> list[HookBase]:
    """Build a list of hook configs. A ``priority`` key is taken here and set on
    the hook; the constructor never sees it. ``origins``: where each entry
    comes from, for errors (default: ``hooks[i]``)."""
    hooks = []
    for index, hook_cfg in enumerate(hook_cfgs):
        where = origins[index] if origins is not None else f"hooks[{index}]"
        if not isinstance(hook_cfg, dict):
            raise ConfigError(f"{where} must be a dict(type=...), got {hook_cfg!r}")
        hook_cfg = dict(hook_cfg)
        priority = hook_cfg.pop("priority", None)
        hook = HOOKS.build(hook_cfg)
        if priority is not None:
            try:
                hook.priority = get_priority(priority)
            except ValueError as err:
                raise ConfigError(f"{where} ({hook_cfg['type']}): {err}") from None
        hooks.append(hook)
    return hooks
