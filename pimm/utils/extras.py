"""Optional dependencies: a feature whose package is not installed says which
extra brings it, in one line (exit 2), instead of an ImportError traceback.

The extras (pyproject.toml): ``plot`` (matplotlib: ``pimm plot``, event
displays), ``wandb`` (``use_wandb=True``), ``tensorboard`` (the viewer for
``save_path/tensorboard``), ``slurm`` (submitit: ``pimm submit``), ``docs``,
``test``.
"""

from __future__ import annotations

import importlib

from .errors import UserError

__all__ = ["require", "MissingExtra"]


class MissingExtra(UserError):
    """A feature's optional package is not installed."""


def require(module: str, extra: str, feature: str) -> None:
    """Raise :class:`MissingExtra` naming ``pip install "pimm[extra]"`` when ``module`` cannot be imported."""
    try:
        importlib.import_module(module)  # the feature imports it next anyway
    except ImportError:
        raise MissingExtra(f"{feature} needs {module}, which is not installed: pip install \"pimm[{extra}]\" "
                           f"(or pip install {module})")
