"""Every extension point of the engine says what it is for: each public name
of a ``pimm.engines`` module, and each public method or property of a public
class, has a docstring (a method overriding a documented one inherits it, as
``help()`` shows it)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pimm.engines  # noqa: E402


def _engine_modules():
    yield pimm.engines
    for info in pkgutil.walk_packages(pimm.engines.__path__, prefix="pimm.engines."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            yield importlib.import_module(info.name)


def _public_names(module) -> list[str]:
    """The module's ``__all__``, else the public names it defines itself."""
    names = getattr(module, "__all__", None)
    if names is not None:
        return list(names)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and getattr(obj, "__module__", None) == module.__name__
            and (inspect.isclass(obj) or inspect.isfunction(obj))]


def _own_members(cls):
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member) or isinstance(member, property):
            yield name, member


def _undocumented() -> list[str]:
    missing = set()
    for module in _engine_modules():
        for name in _public_names(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue  # constants and registries are documented where they are defined
            qualified = f"{obj.__module__}.{obj.__qualname__}"
            if not (obj.__doc__ or "").strip():
                missing.add(qualified)
            if inspect.isclass(obj) and obj.__module__.startswith("pimm.engines"):
                for member_name, member in _own_members(obj):
                    doc = member.__doc__ if isinstance(member, property) else inspect.getdoc(getattr(obj, member_name))
                    if not (doc or "").strip():
                        missing.add(f"{qualified}.{member_name}")
    return sorted(missing)


def test_every_public_engine_name_and_method_has_a_docstring():
    missing = _undocumented()
    assert not missing, f"{len(missing)} public names of pimm.engines lack a docstring:\n" + "\n".join(missing)


def test_the_check_sees_an_undocumented_method():
    """The walk above would catch a public method without a docstring."""
    from pimm.engines.hooks.base import HookBase

    class Probe(HookBase):
        def undocumented_extension_point(self):
            pass
    assert [name for name, _ in _own_members(Probe)] == ["undocumented_extension_point"]
    assert not inspect.getdoc(Probe.undocumented_extension_point)


def test_the_walk_covers_every_engine_subpackage():
    names = {module.__name__ for module in _engine_modules()}
    for package in ("loop", "optim", "run", "observe", "hooks", "trainers", "state"):
        assert f"pimm.engines.{package}" in names
        assert any(name.startswith(f"pimm.engines.{package}.") for name in names), package
    # Every subpackage says what it owns (its docstring names its modules).
    for package in ("loop", "optim", "run", "observe"):
        module = next(m for m in _engine_modules() if m.__name__ == f"pimm.engines.{package}")
        assert module.__doc__ and len(module.__doc__.split()) > 40, package
