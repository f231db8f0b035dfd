"""`Section`: one validated, read-only section of a run config (`task`, `model`, `calibration`, ...), read as
`cfg.task.windows` or `cfg.task.get("source")`. The runner builds them once from Hydra's config; nothing below it
sees Hydra or OmegaConf types (nested lists and mappings are plain, read-only Python values)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any


def _frozen(v: Any) -> Any:
    if isinstance(v, Mapping):
        return Section(v)
    if isinstance(v, (list, tuple)):
        return tuple(_frozen(x) for x in v)
    return v


class Section(Mapping):
    """A read-only mapping with attribute access; equal to a dict with the same items."""

    __slots__ = ("_items",)

    def __init__(self, items: Mapping[str, Any] | None = None, **more: Any):
        object.__setattr__(self, "_items", {k: _frozen(v) for k, v in {**(items or {}), **more}.items()})

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __getattr__(self, key: str) -> Any:
        try:
            return self._items[key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"a config section is read-only ({key}={value!r})")

    def __repr__(self) -> str:
        return f"Section({self._items!r})"

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in self._items.items())))

    def to_dict(self) -> dict[str, Any]:
        """Plain, mutable Python values (for JSON: records, hashes, W&B)."""

        def plain(v):
            if isinstance(v, Section):
                return v.to_dict()
            if isinstance(v, tuple):
                return [plain(x) for x in v]
            return v

        return {k: plain(v) for k, v in self._items.items()}
