"""pimm: a training framework for particle-imaging models.

``pimm.from_pretrained``, ``pimm.save_pretrained`` and ``pimm.push_to_hub``
(:mod:`pimm.export`) load on first use, so ``import pimm`` stays light.
"""

__version__ = "0.1.0"

from pimm.utils.module_aliases import install as _install_module_aliases

# Modules that moved (pimm.engines.scheduler -> pimm.engines.optim.scheduler...) still import by their old paths.
_install_module_aliases()

_LAZY = {"from_pretrained": "pimm.export", "save_pretrained": "pimm.export", "push_to_hub": "pimm.export"}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name == "export":  # ``import pimm; pimm.export.push_to_hub(...)`` without importing the package first
        return importlib.import_module("pimm.export")
    raise AttributeError(f"module 'pimm' has no attribute {name!r}")
