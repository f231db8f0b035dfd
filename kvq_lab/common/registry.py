"""One registry type for every kind of plug-in (formats, transforms, residuals, cache policies, cache layers, tasks,
error metrics), after lm-eval's `api/registry.py`: named entries, aliases, lazy "module:Name" entries, one collision
rule and one-line errors.

    FORMATS = Registry("format", lazy={"int": "kvq_lab.quant.formats.int_:IntFormat", ...},
                       unknown="{kind}={name!r} is not a registered code format; allowed: {known}")

    @FORMATS.register("myfmt")          # decorator form (the `register_x` helpers wrap it)
    class MyFormat(CodeFormat): ...

    FORMATS["int"]                      # imports kvq_lab.quant.formats.int_ on first lookup
    sorted(FORMATS), "int" in FORMATS   # names only: nothing is imported

Lazy entries: the registry line of a built-in plug-in is its name and where it lives, so a registry lists its
plug-ins without importing them (config validation stays fast and torch-free) and imports one when it is looked up.
The module may register itself while it is imported (the `@register_x` decorators do, which is where they set the
class's name); otherwise, or in addition, the registry takes `Name` from it. Either way the entry must end up holding
`module.Name`: a registry line that points at the wrong thing fails on first lookup, not silently.

Collisions: a name (or alias) names one entry. Registering it again is refused with a one-line ValueError, except
  - the very same object (registering twice is harmless);
  - the same definition run again: a class or function with the same module and qualified name (importlib.reload
    makes a new class object), or an instance of such a re-created class; the new object replaces the old;
  - a lazy entry being filled by its own module (the module named in "module:Name" registering under that name).

Iteration and `names()` are sorted and list canonical names (aliases resolve on lookup but are not listed), so a
test matrix parametrized over a registry covers each entry once. Unknown names raise `UnknownName`, a one-line
ConfigError (also a KeyError, so `registry[name]` keeps the Mapping contract) naming the value and the known names.

Bottom layer: imports nothing of kvq_lab above `kvq_lab.common`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import Any, Generic, TypeVar

from kvq_lab.common.errors import ConfigError

T = TypeVar("T")
_MISSING: Any = object()


class UnknownName(ConfigError, KeyError):
    """A registry was asked for a name it does not hold; the message names the value and lists the known names."""

    __str__ = ConfigError.__str__  # one line as given, not KeyError's repr of it


class _Lazy:
    """A "module:Name" entry not yet imported."""

    __slots__ = ("module", "attr")

    def __init__(self, target: str):
        module, sep, attr = target.partition(":")
        if not (sep and module and attr):
            raise ValueError(f"lazy registry entry {target!r}: write 'package.module:Name'")
        self.module, self.attr = module, attr

    def __str__(self) -> str:
        return f"{self.module}:{self.attr}"


def _where(obj: Any) -> tuple[str, str]:
    """(module, qualified name) of a class or function, or of an instance's class."""
    d = obj if hasattr(obj, "__qualname__") else type(obj)
    return d.__module__, d.__qualname__


def _describe(obj: Any) -> str:
    if isinstance(obj, _Lazy):
        return str(obj)
    module, qualname = _where(obj)
    return f"{module}.{qualname}" if hasattr(obj, "__qualname__") else f"a {module}.{qualname} instance"


def _same_definition(old: Any, new: Any) -> bool:
    """`new` is `old` defined again (a reloaded module): a different object with the same module and qualified name;
    for instances, of a different class object with the same module and qualified name."""
    if hasattr(new, "__qualname__") != hasattr(old, "__qualname__") or _where(old) != _where(new):
        return False
    return hasattr(new, "__qualname__") or type(old) is not type(new)


class Registry(Mapping[str, T], Generic[T]):
    """Named plug-ins of one kind (module docstring). `kind`: the setting that names them (`format`, `policy`), used in
    messages; `lazy`: {name: "module:Name"} entries imported on first lookup; `unknown`: the message for an unknown
    name, a format string with `{kind}`, `{name}` and `{known}` (the sorted names, comma-separated)."""

    def __init__(self, kind: str, lazy: Mapping[str, str] | None = None, *, unknown: str | None = None):
        self.kind = kind
        self.unknown = unknown or "{kind}={name!r} is not a registered {kind}; choose one of: {known}"
        self._entries: dict[str, Any] = {}  # name -> object, or _Lazy until first lookup
        self._aliases: dict[str, str] = {}  # alias -> name
        for name, target in (lazy or {}).items():
            self.add_lazy(name, target)

    # -- adding ----------------------------------------------------------------------------------------------------
    def register(self, name: str, obj: T = _MISSING, *, aliases: tuple[str, ...] = ()) -> Any:
        """Register `obj` under `name` (and `aliases`) and return it; without `obj`, a decorator that does so."""
        if obj is _MISSING:
            return lambda o: self.register(name, o, aliases=aliases)
        old = self._entries.get(name, _MISSING)
        if old is _MISSING:
            self._check_free(name)
        elif not (old is obj or self._fills(old, obj) or (not isinstance(old, _Lazy) and _same_definition(old, obj))):
            raise ValueError(f"{self.kind} name {name!r} is already registered by {_describe(old)}")
        self._entries[name] = obj
        for a in aliases:
            self.alias(a, name)
        return obj

    def add_lazy(self, name: str, target: str) -> None:
        """A built-in's registry line: `name` is `target` ("package.module:Name"), imported on first lookup. Adding
        the same line again, or after its module registered the name itself (it was imported first), changes nothing."""
        lazy = _Lazy(target)
        old = self._entries.get(name, _MISSING)
        if old is _MISSING:
            self._check_free(name)
            self._entries[name] = lazy
        elif not (str(old) == target if isinstance(old, _Lazy) else self._fills(lazy, old)):
            raise ValueError(f"{self.kind} name {name!r} is already registered by {_describe(old)}")

    def alias(self, alias: str, name: str) -> None:
        """Make `alias` another spelling of `name` (resolved on lookup, not listed by `names()`)."""
        if name not in self._entries:
            raise ValueError(f"{self.kind} alias {alias!r}: {name!r} is not registered")
        if self._aliases.get(alias) == name:
            return
        self._check_free(alias)
        self._aliases[alias] = name

    def unregister(self, name: str) -> None:
        """Remove `name` and its aliases (tests that register a throwaway plug-in clean up with it)."""
        self._raw(name)  # UnknownName if absent
        del self._entries[name]
        self._aliases = {a: n for a, n in self._aliases.items() if n != name}

    def copy(self) -> Registry[T]:
        """An independent registry with the same entries (tests register into a copy and leave the real one as is)."""
        new = Registry(self.kind, unknown=self.unknown)
        new._entries, new._aliases = dict(self._entries), dict(self._aliases)
        return new

    # -- looking up ------------------------------------------------------------------------------------------------
    def names(self) -> list[str]:
        """The registered names, sorted (aliases not included); imports nothing."""
        return sorted(self._entries)

    def get(self, name: str, default: Any = _MISSING) -> T:
        """The entry `name` (or an alias of it), imported if lazy; unknown: `default` if given, else UnknownName."""
        if default is not _MISSING and name not in self:
            return default
        canonical = self._aliases.get(name, name)
        entry = self._raw(name)
        return self._load(canonical, entry) if isinstance(entry, _Lazy) else entry

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._entries or name in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"

    # -- internals -------------------------------------------------------------------------------------------------
    def _raw(self, name: str) -> Any:
        entry = self._entries.get(self._aliases.get(name, name), _MISSING)
        if entry is _MISSING:
            known = ", ".join(self.names()) or "none registered"
            raise UnknownName(self.unknown.format(kind=self.kind, name=name, known=known))
        return entry

    def _check_free(self, name: str) -> None:
        if name in self._aliases:
            raise ValueError(f"{self.kind} name {name!r} is already an alias of {self._aliases[name]!r}")
        if name in self._entries:
            raise ValueError(f"{self.kind} name {name!r} is already registered by {_describe(self._entries[name])}")

    @staticmethod
    def _fills(old: Any, obj: Any) -> bool:
        """`obj`, registered from the module a lazy entry names, fills that entry."""
        return isinstance(old, _Lazy) and _where(obj)[0] == old.module

    def _load(self, name: str, lazy: _Lazy) -> T:
        module = import_module(lazy.module)  # a module that registers itself fills the entry while it is imported
        obj = getattr(module, lazy.attr, _MISSING)
        if obj is _MISSING:
            raise ValueError(
                f"{self.kind} {name!r}: its registry line says {lazy}, but {lazy.module} has no {lazy.attr}"
            )
        now = self._entries.get(name)
        if now is not lazy and now is not obj:
            raise ValueError(f"{self.kind} {name!r}: its registry line says {lazy}, but {_describe(now)} registered it")
        self._entries[name] = obj
        return obj
