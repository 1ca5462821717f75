"""Loading every registering package at once, for the commands that build
whatever a config names (``train``, ``test``, ``submit``, ``export``). Its
own module so :mod:`pimm.cli` and the tools it dispatches to both import it
without importing each other."""

from __future__ import annotations

__all__ = ["register_all"]


def register_all() -> None:
    """Import every package that registers data sets, transforms, models and evaluators."""
    import pimm.datasets  # noqa: F401
    import pimm.evaluation  # noqa: F401
    import pimm.models  # noqa: F401
