"""pimm: a training framework for particle-imaging models.

``pimm.from_pretrained`` and ``pimm.save_pretrained`` (:mod:`pimm.models.pretrained`)
load on first use, so ``import pimm`` stays light.
"""

__version__ = "0.1.0"

from pimm.utils.module_aliases import install as _install_module_aliases

# Modules that moved (pimm.engines.scheduler -> pimm.engines.optim.scheduler...) still import by their old paths.
_install_module_aliases()

_LAZY = {"from_pretrained": "pimm.models.pretrained", "save_pretrained": "pimm.models.pretrained"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pimm' has no attribute {name!r}")
