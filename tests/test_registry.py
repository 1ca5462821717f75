"""Registry: registration forms, lookup errors, and building from ``dict(type=...)``.

Every pluggable component is found by name through a :class:`Registry`, so
these tests pin the behaviour users rely on: the ways to register, the
error a typo produces (with the closest names), and how a failing
constructor is reported (user mistake -> ``RegistryError`` / the user's own
``UserError`` class, anything else -> ``BuildError`` with context).
"""

from __future__ import annotations

import pytest

from pimm.utils.errors import ConfigError, RegistryError, UserError
from pimm.utils.registry import BuildError, Parameters, Registry, build_from_cfg, parameters_of, registries


@pytest.fixture
def reg() -> Registry:
    return Registry("widget")


# ----------------------------------------------------------------------------- registering


def test_decorator_forms_register_under_class_name_or_alias(reg):
    @reg.register_module()
    class Plain:
        pass

    @reg.register_module
    class Bare:  # decorator used without parentheses
        pass

    @reg.register_module("Nick")
    class Named:
        pass

    assert reg.get("Plain") is Plain
    assert reg.get("Bare") is Bare
    assert reg.get("Nick") is Named
    assert "Named" not in reg  # an explicit name replaces the class name
    assert reg.keys() == ["Bare", "Nick", "Plain"] and len(reg) == 3


def test_call_form_and_function_factories(reg):
    class Gear:
        def __init__(self, teeth=8):
            self.teeth = teeth

    def make_gear(teeth):
        return Gear(teeth * 2)

    assert reg.register_module(module=Gear) is Gear  # returns the object, usable inline
    reg.register_module("double_gear", module=make_gear)
    assert reg.get("Gear") is Gear
    assert reg.build(dict(type="double_gear", teeth=5)).teeth == 10


def test_list_of_aliases_registers_every_name(reg):
    @reg.register_module(["CosineLR", "WarmupCosine"])
    class Cos:
        pass

    assert reg.get("CosineLR") is Cos and reg.get("WarmupCosine") is Cos
    assert "Cos" not in reg


def test_duplicate_name_is_an_error_unless_forced(reg):
    @reg.register_module()
    class Thing:
        pass

    with pytest.raises(KeyError, match=r"'Thing' is already registered in widget.*force=True"):
        @reg.register_module("Thing")
        class Other:
            pass

    assert reg.get("Thing") is Thing  # the failed registration changed nothing

    @reg.register_module("Thing", force=True)
    class Replacement:
        pass

    assert reg.get("Thing") is Replacement


def test_failed_alias_registration_registers_nothing(reg):
    reg.register_module("Taken", module=type("Taken", (), {}))
    with pytest.raises(KeyError):
        reg.register_module(["Fresh", "Taken"], module=type("New", (), {}))
    assert "Fresh" not in reg


def test_registering_the_same_object_twice_is_harmless(reg):
    # A module imported twice (e.g. via custom_imports and a normal import) re-runs its decorators.
    class Once:
        pass

    reg.register_module(module=Once)
    reg.register_module(module=Once)
    assert reg.get("Once") is Once and len(reg) == 1


def test_only_callables_can_be_registered(reg):
    with pytest.raises(TypeError, match="widget"):
        reg.register_module("x", module=42)


# ----------------------------------------------------------------------------- lookup


def test_unknown_name_lists_closest_names(reg):
    for name in ("ResNet", "ResNeXt", "UNet", "Transformer"):
        reg.register_module(name, module=type(name, (), {}))
    with pytest.raises(RegistryError) as info:
        reg.get("ResNte")
    message = str(info.value)
    assert "widget" in message and "'ResNte'" in message
    assert "did you mean" in message and "'ResNet'" in message
    assert "Transformer" not in message  # only the close names, not the whole list
    assert isinstance(info.value, UserError)  # the CLI turns it into exit 2


def test_unknown_name_without_close_match_lists_all_names(reg):
    reg.register_module("Alpha", module=type("Alpha", (), {}))
    reg.register_module("Beta", module=type("Beta", (), {}))
    with pytest.raises(RegistryError, match=r"registered: Alpha, Beta"):
        reg.get("zzzzzz")


# ----------------------------------------------------------------------------- building


class Motor:
    def __init__(self, power, voltage=12, label="m"):
        self.power, self.voltage, self.label = power, voltage, label


def test_build_passes_arguments_and_default_args_fill_gaps_only(reg):
    reg.register_module(module=Motor)
    cfg = dict(type="Motor", power=3, voltage=24)
    motor = reg.build(cfg, default_args=dict(voltage=5, label="default"))
    assert (motor.power, motor.voltage, motor.label) == (3, 24, "default")  # the config wins
    assert cfg == dict(type="Motor", power=3, voltage=24)  # the config itself is not mutated


def test_type_may_be_a_class(reg):
    motor = build_from_cfg(dict(type=Motor, power=1), reg)  # not registered: used as is
    assert isinstance(motor, Motor) and motor.power == 1


@pytest.mark.parametrize("cfg, fragment", [
    ("Motor", "expected a dict"),
    (dict(power=1), "no 'type' key"),
    (dict(type=3), "'type' must be a name or a class"),
])
def test_malformed_build_config(reg, cfg, fragment):
    reg.register_module(module=Motor)
    with pytest.raises(RegistryError, match=fragment):
        reg.build(cfg)


def test_misspelt_parameter_names_the_nearest_real_one(reg):
    reg.register_module(module=Motor)
    with pytest.raises(RegistryError) as info:
        reg.build(dict(type="Motor", power=2, voltge=9))
    assert str(info.value) == (
        "widget Motor: unknown parameter 'voltge' (did you mean 'voltage'?); Motor takes: power, voltage, label"
    )
    with pytest.raises(RegistryError, match=r"unknown parameters 'torque', 'lable' \(did you mean 'label'\?\)"):
        reg.build(dict(type="Motor", power=2, torque=9, lable="x"))


def test_unknown_parameter_is_refused_before_the_constructor_runs(reg):
    calls = []

    @reg.register_module()
    class Counted:
        def __init__(self, n=1):
            calls.append(n)

    with pytest.raises(RegistryError, match="unknown parameter 'm'"):
        reg.build(dict(type="Counted", m=2))
    assert calls == []


def test_constructor_with_kwargs_accepts_any_key(reg):
    @reg.register_module()
    class Open:
        def __init__(self, a=1, **rest):
            self.a, self.rest = a, rest

    built = reg.build(dict(type="Open", a=2, anything=3))
    assert built.a == 2 and built.rest == {"anything": 3}


def test_key_rejected_by_parent_through_kwargs_names_nearest_parent_parameter(reg):
    class Base:
        def __init__(self, cfg, find_unused_parameters=False, stop_check_every=10):
            pass

    @reg.register_module()
    class Child(Base):
        def __init__(self, cfg, ratios=None, **options):
            super().__init__(cfg, **options)

    with pytest.raises(RegistryError) as info:  # a config error (exit 2), not a BuildError
        reg.build(dict(type="Child", ratio=[1]), default_args=dict(cfg=None))
    assert str(info.value) == (
        "widget Child: unknown parameter 'ratio' (did you mean 'ratios'?); "
        "Child takes: cfg, ratios, find_unused_parameters, stop_check_every"
    )


def test_parameters_of_reads_keyword_parameters_only():
    def fn(a, /, b, *args, c=1, **kw):
        pass

    def closed(x, y=2):
        pass

    assert parameters_of(fn) == Parameters(("b", "c"), True)
    assert parameters_of(closed) == Parameters(("x", "y"), False)
    assert parameters_of(Motor).names == ("power", "voltage", "label")  # no self
    assert parameters_of(Motor).nearest("powr") == "power" and parameters_of(Motor).nearest("zzz") is None


def test_every_live_registry_is_indexed_by_name():
    import gc

    first, second = Registry("gizmo-index-test"), Registry("gizmo-index-test")
    assert registries("gizmo-index-test") == [first, second]
    assert first in registries()
    del first
    gc.collect()
    assert registries("gizmo-index-test") == [second]  # a dropped registry is forgotten


def test_what_a_config_type_resolves_to_follows_registrations_removals_and_dropped_registries():
    """The config checks keep what a type name resolves to (pimm.utils.config_slots);
    that memo must never outlive a change to the registries."""
    import gc

    from pimm.utils.config_slots import resolve

    node = dict(type="ResolveMemoProbe", width=1)
    assert resolve(node, "somewhere") is None  # no registry knows it: plain data
    reg = Registry("resolve-memo-test")

    @reg.register_module("ResolveMemoProbe")
    class Narrow:
        def __init__(self, width=1):
            self.width = width

    assert resolve(node, "somewhere").params.names == ("width",)

    @reg.register_module("ResolveMemoProbe", force=True)
    class Wide:
        def __init__(self, width=1, depth=2):
            self.width, self.depth = width, depth

    assert resolve(node, "somewhere").params.names == ("width", "depth")
    assert reg.remove("ResolveMemoProbe") is Wide
    assert resolve(node, "somewhere") is None
    with pytest.raises(KeyError, match="'ResolveMemoProbe' is not registered in resolve-memo-test"):
        reg.remove("ResolveMemoProbe")
    reg.register_module("ResolveMemoProbe", module=Narrow)
    assert resolve(node, "somewhere").params.names == ("width",)
    del reg, Narrow, Wide
    gc.collect()
    assert resolve(node, "somewhere") is None  # a dropped registry's names are gone with it


def test_missing_required_argument_is_a_registry_error(reg):
    reg.register_module(module=Motor)
    with pytest.raises(RegistryError, match=r"widget Motor\(voltage=3\).*'power'"):
        reg.build(dict(type="Motor", voltage=3))


def test_exception_inside_constructor_is_reraised_with_context(reg):
    @reg.register_module()
    class Fragile:
        def __init__(self, size):
            raise RuntimeError(f"cannot allocate {size}")

    with pytest.raises(BuildError) as info:
        reg.build(dict(type="Fragile", size=7))
    message = str(info.value)
    assert "widget Fragile(size=7) failed" in message and "cannot allocate 7" in message
    assert isinstance(info.value.__cause__, RuntimeError)  # the original traceback is kept
    assert not isinstance(info.value, UserError)  # a real failure: exit 1, not 2


def test_type_error_raised_deeper_than_the_call_is_not_blamed_on_the_config(reg):
    # The arguments fit the signature; the TypeError comes from the body, i.e. a bug.
    @reg.register_module()
    class Buggy:
        def __init__(self, n=1):
            len(n)

    with pytest.raises(BuildError, match="object of type 'int' has no len"):
        reg.build(dict(type="Buggy", n=3))


def test_user_error_inside_constructor_keeps_its_class_and_gains_context(reg):
    @reg.register_module()
    class Picky:
        def __init__(self, path):
            raise ConfigError(f"{path} does not exist")

    with pytest.raises(ConfigError) as info:
        reg.build(dict(type="Picky", path="/no/such"))
    assert str(info.value) == "widget Picky: /no/such does not exist"


def test_user_error_subclass_with_own_constructor_keeps_its_class(reg):
    class DataFileError(UserError):
        def __init__(self, path, why):
            super().__init__(f"{path}: {why}")

    @reg.register_module()
    class Reader:
        def __init__(self, path):
            raise DataFileError(path, "not an HDF5 file")

    with pytest.raises(DataFileError, match="x.h5: not an HDF5 file"):
        reg.build(dict(type="Reader", path="x.h5"))


# ----------------------------------------------------------------------------- the shared registries


def test_public_import_paths_share_one_registry_per_kind():
    import pimm.datasets
    import pimm.engines
    import pimm.engines.registries as registries
    import pimm.models

    assert pimm.engines.HOOKS is registries.HOOKS and pimm.engines.TRAINERS is registries.TRAINERS
    assert pimm.models.MODELS is registries.MODELS
    assert pimm.datasets.DATASETS is registries.DATASETS and pimm.datasets.TRANSFORMS is registries.TRANSFORMS
    # The engine's own pieces are registered on import.
    for name in ("CheckpointSaver", "CheckpointLoader", "InformationWriter", "IterationTimer", "ProgressBar"):
        assert name in registries.HOOKS
    assert "DefaultTrainer" in registries.TRAINERS


def test_misspelt_parameter_in_a_config_file_is_one_line_at_build_time(tmp_path):
    import pimm.models  # noqa: F401  (registers RingCNN)
    from pimm.engines.registries import MODELS
    from pimm.utils.config import Config

    path = tmp_path / "cfg.py"
    path.write_text("model = dict(type='RingCNN', widht=8, num_classes=2)\n")
    with pytest.raises(RegistryError) as info:
        MODELS.build(Config.fromfile(path).model)
    message = str(info.value)
    assert message.startswith("model RingCNN: unknown parameter 'widht' (did you mean 'width'?); "
                              "RingCNN takes: in_channels, num_classes, width, depth,")
    assert "\n" not in message
