"""Upstream pimm's import path for the hook registry.

``from pimm.engines.hooks.builder import HOOKS`` is the same registry as
``pimm.engines.HOOKS``: a hook registered through either name is listed in the
config's ``hooks`` the same way (see docs/architecture.md, "Upstream import paths").
"""

from pimm.engines.registries import HOOKS

__all__ = ["HOOKS"]
