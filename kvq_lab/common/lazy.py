"""Lazy package exports: `from kvq_lab.cache import CacheConfig` without importing torch or transformers until a
name that needs them is used. Config validation relies on this to fail in seconds."""

from __future__ import annotations

from importlib import import_module


def lazy_getattr(package: str, exports: dict[str, str]):
    """A module-level `__getattr__` resolving `name` from the submodule `exports[name]` of `package`."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(import_module(f".{exports[name]}", package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
