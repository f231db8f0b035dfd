"""kvq_lab.common.registry: the one registry type every kind of plug-in uses (names, aliases, lazy "module:Name"
entries, the collision rule, one-line errors)."""

import importlib
import sys
from dataclasses import dataclass

import pytest

from kvq_lab.common.errors import ConfigError
from kvq_lab.common.registry import Registry, UnknownName

# A registry the plug-in modules below register into (a module reads it as `test_registry.REG`, as a real plug-in
# imports its registry); each test sets it.
REG: Registry | None = None


@pytest.fixture
def plugin_module(tmp_path, monkeypatch):
    """Writes a plug-in module `tw_reg_plugin` (importable from tmp_path; forgotten after) holding `Thing`, which
    registers itself into REG when imported (as the `@register_x` decorators do) unless told not to."""

    def make(registry: Registry, self_registers: bool = True) -> None:
        monkeypatch.setattr(sys.modules[__name__], "REG", registry)
        body = f"import {__name__} as t\n\n\nclass Thing:\n    pass\n\n\nOTHER = object()\n"
        registers = "t.REG.register('thing', Thing)\n" if self_registers else ""
        (tmp_path / "tw_reg_plugin.py").write_text(body + registers)
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "tw_reg_plugin", raising=False)

    yield make
    sys.modules.pop("tw_reg_plugin", None)


def test_register_get_names_and_iteration_sorted():
    r = Registry("thing")
    r.register("b", 2)

    @r.register("a")
    def f():
        pass

    assert r["a"] is f and r.get("b") == 2 and r.names() == ["a", "b"] == list(r) == sorted(r)
    assert len(r) == 2 and "a" in r and "c" not in r and dict(r.items()) == {"a": f, "b": 2}


def test_unknown_name_is_one_line_naming_the_value_and_the_known_ones():
    r = Registry("policy", unknown="{kind}={name!r} is not a cache policy; choose one of: {known}")
    r.register("kivi", 1)
    r.register("evict", 2)
    for lookup in (lambda: r["snap"], lambda: r.get("snap")):
        with pytest.raises(UnknownName) as e:
            lookup()
        assert str(e.value) == "policy='snap' is not a cache policy; choose one of: evict, kivi"
    assert isinstance(e.value, ConfigError) and isinstance(e.value, KeyError)  # a config error; the Mapping contract
    assert r.get("snap", None) is None  # a default asks for no error
    with pytest.raises(UnknownName, match=r"^format='x' is not a registered format; choose one of: none registered$"):
        Registry("format")["x"]


def test_aliases_resolve_but_are_not_listed():
    r = Registry("format")
    r.register("fp8_e4m3", "E4M3", aliases=("fp8",))
    r.alias("e4m3", "fp8_e4m3")
    assert r["fp8"] == r["e4m3"] == "E4M3" and "fp8" in r and r.names() == ["fp8_e4m3"]
    r.alias("fp8", "fp8_e4m3")  # the same alias again: no change
    with pytest.raises(ValueError, match="^format name 'fp8' is already an alias of 'fp8_e4m3'$"):
        r.register("fp8", "other")
    with pytest.raises(ValueError, match="'int' is not registered"):
        r.alias("i", "int")
    r.unregister("fp8_e4m3")
    assert "fp8" not in r and not r


def test_duplicates_are_refused_but_the_same_object_or_a_reloaded_definition_is_not():
    r = Registry("format")

    @dataclass(frozen=True)
    class A:
        x: int = 0

    class B:
        pass

    r.register("a", A)
    assert r.register("a", A) is A  # the very same object: harmless
    with pytest.raises(ValueError, match=r"^format name 'a' is already registered by .*test_registry\..*A$"):
        r.register("a", B)
    # what importlib.reload makes: a new class object with the same module and qualified name
    reloaded = type("A", (), {"__module__": A.__module__, "__qualname__": A.__qualname__})
    assert r.register("a", reloaded) is reloaded and r["a"] is reloaded
    # instances: an equal but distinct instance of the same class is another registration, so refused
    r.register("i", A(1))
    with pytest.raises(ValueError, match=r"already registered by a .*A instance"):
        r.register("i", A(1))


def test_lazy_entries_import_on_first_lookup_only(plugin_module):
    r = Registry("thing", lazy={"thing": "tw_reg_plugin:Thing"})
    plugin_module(r)
    assert r.names() == ["thing"] and "thing" in r and "tw_reg_plugin" not in sys.modules  # listing imports nothing
    mod = sys.modules.get("tw_reg_plugin") or importlib.import_module("tw_reg_plugin")
    assert r["thing"] is mod.Thing and "tw_reg_plugin" in sys.modules  # the module filled its own entry
    assert r["thing"] is mod.Thing
    r.add_lazy("thing", "tw_reg_plugin:Thing")  # the same line again (or after the module registered): no change
    with pytest.raises(ValueError, match="^thing name 'thing' is already registered by tw_reg_plugin.Thing$"):
        r.add_lazy("thing", "elsewhere:Thing")


def test_a_lazy_entry_whose_module_does_not_register_takes_its_name(plugin_module):
    r = Registry("thing", lazy={"thing": "tw_reg_plugin:Thing"})
    plugin_module(r, self_registers=False)
    assert r["thing"] is importlib.import_module("tw_reg_plugin").Thing


def test_a_wrong_registry_line_fails_on_lookup(plugin_module):
    r = Registry("thing", lazy={"thing": "tw_reg_plugin:OTHER", "gone": "tw_reg_plugin:Missing"})
    plugin_module(r)
    with pytest.raises(ValueError, match="registry line says tw_reg_plugin:OTHER, but tw_reg_plugin.Thing registered"):
        r["thing"]
    with pytest.raises(ValueError, match="registry line says tw_reg_plugin:Missing, but tw_reg_plugin has no Missing"):
        r["gone"]
    with pytest.raises(ValueError, match="write 'package.module:Name'"):
        r.add_lazy("bad", "no_colon")


def test_another_module_cannot_take_a_lazy_name():
    r = Registry("format", lazy={"int": "kvq_lab.quant.formats.int_:IntFormat"})

    class Mine:
        pass

    with pytest.raises(
        ValueError, match="^format name 'int' is already registered by kvq_lab.quant.formats.int_:IntFormat"
    ):
        r.register("int", Mine)


def test_copy_is_independent():
    r = Registry("thing")
    r.register("a", 1)
    c = r.copy()
    c.register("b", 2)
    assert list(r) == ["a"] and list(c) == ["a", "b"]


def test_every_registry_is_one():
    """The plug-in registries of kvq_lab are all this type (their own collision rules are gone)."""
    from kvq_lab.cache.kv_cache import LAYERS  # with the layer modules imported (kv_cache assembles them)
    from kvq_lab.cache.policies import POLICIES
    from kvq_lab.plugins import TASKS
    from kvq_lab.probes.metrics import ERRORS
    from kvq_lab.quant.formats import FORMATS
    from kvq_lab.quant.residuals import RESIDUALS
    from kvq_lab.quant.transforms import TRANSFORMS

    for r in (LAYERS, POLICIES, TASKS, ERRORS, FORMATS, RESIDUALS, TRANSFORMS):
        assert isinstance(r, Registry) and len(r) > 0, r
