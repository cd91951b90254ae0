"""One registry style for everything chosen by name: model families, training methods, adapter types,
adapter output formats and serving back ends.

A `Registry` holds records in order (the order they are tried, documented and listed in messages),
each known by its `name` attribute:

    FORMATS = Registry("adapter format", (DIFFUSERS, COMFYUI))
    FORMATS.get("comfyui")            # the record, or a ValueError naming the known ones
    FORMATS.register(toy)             # added last (first=True: first); one of the same name is replaced in place
    FORMATS.unregister("toy")         # gone (nothing happens for an unknown name)
    FORMATS.names(), FORMATS.items(), list(FORMATS), "toy" in FORMATS

It lives in the runtime package (logged with the served model, which cannot import the project) so
that the served model's back ends use it too; the stages import it from here. No torch, no imports.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Records by name, in order. `what` names a record in messages ("unknown {what} 'x'; choose one
    of a, b"); `key` gives a record's name (default: its `name` attribute)."""

    def __init__(self, what: str, items: Iterable[T] = (), key: Callable[[T], str] = lambda item: item.name) -> None:
        self.what = what
        self._key = key
        self._items: dict[str, T] = {}
        for item in items:
            self.register(item)

    def register(self, item: T, first: bool = False) -> None:
        """Add `item`, last (or first with `first`: e.g. a family detection must try before the others).
        A record of the same name is replaced where it stands (moved first with `first`)."""
        name = self._key(item)
        if first:
            self._items = {name: item, **{k: v for k, v in self._items.items() if k != name}}
        else:
            self._items[name] = item

    def unregister(self, name: str) -> None:
        """Remove the record called `name` (a test's toy one, once the test is done); unknown: nothing."""
        self._items.pop(name, None)

    def get(self, name: str) -> T:
        """The record called `name`, or a ValueError naming the known ones."""
        if name not in self._items:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {', '.join(self._items)}")
        return self._items[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._items)

    def items(self) -> tuple[T, ...]:
        return tuple(self._items.values())

    def where(self, test: Callable[[T], bool]) -> tuple[T, ...]:
        """The records for which `test(record)` holds, in order."""
        return tuple(item for item in self._items.values() if test(item))

    def __iter__(self) -> Iterator[T]:
        return iter(self.items())

    def __contains__(self, name: Any) -> bool:
        return name in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._items)})"
