"""Old import paths of modules that moved, kept working without files at the
old places.

``pimm.engines`` was regrouped into subpackages (``loop/``, ``optim/``,
``run/``, ``observe/``) and ``pimm.tools`` merged into ``pimm.cli``. Users'
configs, upstream plug-ins and checkpoints pickled before the move still name
the old paths (``pimm.engines.scheduler``, ``pimm.tools.plot``...); upstream
pimm's ``pimm.utils.checkpoints`` names code that lives in the engine here
(the utils layer cannot import it). A finder on
``sys.meta_path`` answers those names with the module at the new path: the
*same* module object, registered under both names in ``sys.modules``, so a
registry filled through one name is the registry seen through the other, and
``monkeypatch.setattr("pimm.engines.runtime.X", ...)`` patches the module the
engine really uses.

:func:`install` is called by ``import pimm``, so every old path resolves
whatever was imported first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys

__all__ = ["MOVED", "install"]

_ENGINES = "pimm.engines"

#: old dotted module name -> new dotted module name.
MOVED: dict[str, str] = {
    **{f"{_ENGINES}.{name}": f"{_ENGINES}.loop.{name}" for name in (
        "trainer_base", "train", "test", "testers", "prepare", "default_hooks", "hook_contract",
        "run_summary", "sync_points")},
    # ``pimm.engines.optim`` is now the package; it re-exports what optim.py held.
    f"{_ENGINES}.optim_parts": f"{_ENGINES}.optim.parts",
    f"{_ENGINES}.optim_step": f"{_ENGINES}.optim.step",
    **{f"{_ENGINES}.{name}": f"{_ENGINES}.optim.{name}" for name in (
        "scheduler", "compile", "grad_checkpoint", "oom_backoff")},
    **{f"{_ENGINES}.{name}": f"{_ENGINES}.run.{name}" for name in (
        "launch", "run_dir", "run_records", "resume_config", "runtime", "parallel", "data")},
    **{f"{_ENGINES}.{name}": f"{_ENGINES}.observe.{name}" for name in (
        "metrics", "writers", "tracing", "wandb_options")},
    # Upstream's checkpoint helpers live with pimm's checkpoint code (the engine), under upstream's path too.
    "pimm.utils.checkpoints": f"{_ENGINES}.state.upstream_checkpoints",
    # ``pimm.tools`` was a package; ``pimm.cli`` re-exports its helpers (ToolParser...).
    "pimm.tools": "pimm.cli",
    **{f"pimm.tools.{name}": f"pimm.cli.{name}" for name in (
        "export", "jsonl", "plot", "register", "submit", "trace_reader", "trace_report")},
}


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name by importing the new one and handing back that module."""

    def __init__(self, new_name: str):
        self.new_name = new_name

    def create_module(self, spec):
        return importlib.import_module(self.new_name)

    def get_code(self, fullname):
        """The new module's code, for ``python -m <old path>`` (runpy runs it as ``__main__``)."""
        spec = importlib.util.find_spec(self.new_name)
        return spec.loader.get_code(self.new_name)

    def is_package(self, fullname):
        """Whether the new module is a package (runpy asks before running it)."""
        return importlib.util.find_spec(self.new_name).submodule_search_locations is not None

    def exec_module(self, module):
        # The import system stamped the old name's spec on the shared module;
        # the module's own spec (its real file) is the truthful one.
        module.__spec__ = module.__dict__["__real_spec__"]


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Finds only the names in :data:`MOVED`; everything else falls through."""

    def find_spec(self, fullname, path=None, target=None):
        new_name = MOVED.get(fullname)
        if new_name is None:
            return None
        module = importlib.import_module(new_name)
        # Remember the real spec before the import system overwrites __spec__.
        module.__dict__.setdefault("__real_spec__", module.__spec__)
        real = module.__dict__["__real_spec__"]
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new_name), origin=real.origin,
                                              is_package=hasattr(module, "__path__"))


_FINDER = _AliasFinder()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
