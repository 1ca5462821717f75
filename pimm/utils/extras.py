"""Optional dependencies: a feature whose package is not installed says which
extra brings it, in one line (exit 2), instead of an ImportError traceback.

The extras (pyproject.toml): ``plot`` (matplotlib: ``pimm plot``, event
displays), ``wandb`` (``use_wandb=True``), ``tensorboard`` (the viewer for
``save_path/tensorboard``), ``slurm`` (submitit: ``pimm submit``), ``docs``,
``test``.
"""

from __future__ import annotations

import importlib
import logging

from .errors import UserError

__all__ = ["require", "MissingExtra", "skip_without_extra"]

#: The optional packages a feature may go without, and the extra that brings each.
EXTRA_OF = {"matplotlib": "plot"}
_warned: set[tuple[str, str]] = set()


class MissingExtra(UserError):
    """A feature's optional package is not installed."""


def require(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming ``pip install "pimm[extra]"`` when ``module`` cannot be imported."""
    try:
        importlib.import_module(module)  # the feature imports it next anyway
    except ImportError:
        raise MissingExtra(f"{feature} needs {module}, which is not installed: pip install \"pimm[{extra}]\" "
                           f"(or pip install {module})")


def skip_without_extra(err: ModuleNotFoundError, feature: str) -> bool:
    """True when ``err`` is a missing optional package (:data:`EXTRA_OF`): the
    ``feature`` is skipped, with one warning per process naming the extra to
    install. False for any other missing module (the caller re-raises it)."""
    module = (err.name or "").partition(".")[0]
    extra = EXTRA_OF.get(module)
    if extra is None:
        return False
    if (module, feature) not in _warned:
        _warned.add((module, feature))
        logging.getLogger("pimm").warning(f"{feature} skipped: {module} is not installed (pip install "
                                          f"\"pimm[{extra}]\" to get them); training goes on")
    return True
