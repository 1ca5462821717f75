"""Gradient (activation) checkpointing of named submodules.

``gradient_checkpointing = ["backbone.enc*", "head"]`` (a runtime key) names
submodules by ``fnmatch`` patterns over ``model.named_modules()``. Each
matching module's forward then runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` while the
model trains: its activations are dropped after the forward pass and
recomputed during the backward pass, trading compute for memory.

How a module is wrapped: its class is swapped for a subclass (created once per
class, with the same name) whose ``forward`` calls the original through
``checkpoint``. Unlike a wrapper module this leaves ``state_dict`` keys, and
so checkpoints and weight files, unchanged; unlike a closure assigned to the
instance's ``forward`` it survives ``copy.deepcopy`` (an EMA copy of the model
runs its own weights, not the original's).

Gradients are those of the plain model: torch saves and restores the RNG
state around the recomputation (``preserve_rng_state=True``), so dropout draws
the same masks twice, and the global RNG streams advance exactly as without
checkpointing (exact resume is unaffected). In evaluation mode or under
``torch.no_grad`` the plain forward runs.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch.utils.checkpoint import checkpoint

from pimm.utils.errors import ConfigError

__all__ = ["apply_gradient_checkpointing", "is_checkpointed"]

_SUBCLASSES: dict[type, type] = {}


def _checkpointed_class(cls: type) -> type:
    if getattr(cls, "_pimm_checkpointed", False):
        return cls
    if cls not in _SUBCLASSES:
        plain_forward = cls.forward

        def forward(self, *args, **kwargs):
            if self.training and torch.is_grad_enabled():
                return checkpoint(plain_forward, self, *args, use_reentrant=False, **kwargs)
            return plain_forward(self, *args, **kwargs)

        _SUBCLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "_pimm_checkpointed": True, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
        })
    return _SUBCLASSES[cls]


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s activations are recomputed in backward."""
    return getattr(type(module), "_pimm_checkpointed", False)


def apply_gradient_checkpointing(model: torch.nn.Module, patterns, logger: logging.Logger | None = None) -> list[str]:
    """Checkpoint every submodule of ``model`` whose name matches one of
    ``patterns``; returns the names wrapped. A match inside an already
    wrapped module is skipped (its activations are recomputed anyway). A
    pattern that matches nothing is a ConfigError naming some modules."""
    if not patterns:
        return []
    names = [name for name, _ in model.named_modules() if name]  # the root ("") is never wrapped
    modules = dict(model.named_modules())
    selected: list[str] = []
    for pattern in patterns:
        matches = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not matches:
            raise ConfigError(
                f"gradient_checkpointing: {pattern!r} matches no submodule of {type(model).__name__}; "
                f"module names look like {_sample_names(names)}"
            )
        selected += [name for name in matches if name not in selected]
    wrapped = []
    for name in sorted(selected, key=lambda n: n.count(".")):
        if any(name.startswith(outer + ".") for outer in wrapped):
            continue
        module = modules[name]
        module.__class__ = _checkpointed_class(type(module))
        wrapped.append(name)
    order = {name: index for index, name in enumerate(names)}
    wrapped.sort(key=order.__getitem__)
    if logger is not None:
        shown = ", ".join(wrapped[:8]) + (f" and {len(wrapped) - 8} more" if len(wrapped) > 8 else "")
        logger.info(f"Gradient checkpointing {len(wrapped)} module(s): {shown}")
    return wrapped


def _sample_names(names: list[str], limit: int = 12) -> str:
    """Up to ``limit`` names, the shallowest first (they are the useful anchors)."""
    if not names:
        return "(it has no submodules)"
    ordered = sorted(names, key=lambda n: n.count("."))  # stable: model order within a depth
    return ", ".join(ordered[:limit]) + (", ..." if len(names) > limit else "")
