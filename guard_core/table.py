"""The tables the reducers copy on every request event, at a cost that does not grow with them.

Reads: nothing but its arguments.
Guarantees:
- :func:`filed` and :func:`forgotten` return a new mapping and leave the one they were given as
  it was: a plain ``dict`` copy while it is small (under :data:`_SMALL` entries), else a
  :class:`Table`, a read-only :class:`~collections.abc.Mapping` that never changes after it is
  made;
- whatever a reader can see of it (lookups, length, iteration order, equality with other
  mappings) is what a ``dict`` copied and changed the same way would show: a changed key keeps
  its place, a new key goes last, a key forgotten and filed again goes last (so forgetting the
  first key and filing another is a least-recently-used table's eviction and touch);
- a change costs the changes made since the table's last merge, at most about the square root
  of its size, instead of a copy of every entry (a dict copy per event made each admission and
  release cost grow with the requests in flight: about 50 µs more per 1,000 held).

How: a table is a base ``dict`` that no one changes, a small ``dict`` of the values filed since
(base keys changed in place, then the keys filed last), and the set of base keys forgotten
since. Each change copies only the small parts; once they outgrow their bound they are merged
into a new base (one dict copy, at C speed), so a change costs O(sqrt n), amortised.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, Mapping, ValuesView
from math import isqrt
from typing import Final, TypeVar

__all__ = ("Table", "filed", "forgotten")

K = TypeVar("K")
V = TypeVar("V")

#: Changes a table may hold on top of its base before they are merged, at the least.
_MIN_CHANGES: Final = 16
#: Below this many entries a table is kept as a plain ``dict``: copying it whole costs less than
#: a table's bookkeeping (about 2 µs a change, what a dict copy of some 300 entries costs).
_SMALL: Final = 256


class Table(Mapping[K, V]):
    """An insertion-ordered, never-changing mapping (see the module)."""

    __slots__ = ("_base", "_changes", "_gone", "_size")

    #: Never changed once the table is made.
    _base: dict[K, V]
    #: Filed since the base: base keys changed in place first, in the base's order when read,
    #: then the keys filed last (new ones, and base keys forgotten and filed again).
    _changes: dict[K, V]
    #: Base keys forgotten since the base (also in ``_changes`` when filed again).
    _gone: frozenset[K]
    _size: int

    def __init__(self, entries: Mapping[K, V] | None = None) -> None:
        self._base = dict(entries) if entries else {}
        self._changes = {}
        self._gone = frozenset()
        self._size = len(self._base)

    @classmethod
    def _made(
        cls, base: dict[K, V], changes: dict[K, V], gone: frozenset[K], size: int
    ) -> Table[K, V]:
        table = cls.__new__(cls)
        table._base, table._changes, table._gone, table._size = base, changes, gone, size
        return table

    # -- reading ---------------------------------------------------------------------------

    def __getitem__(self, key: K) -> V:
        changes = self._changes
        if key in changes:
            return changes[key]
        if key in self._gone:
            raise KeyError(key)
        return self._base[key]

    def get(self, key: K, default: object = None) -> V | object:  # type: ignore[override]
        changes = self._changes
        if key in changes:
            return changes[key]
        if key in self._gone:
            return default
        return self._base.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._changes or (key not in self._gone and key in self._base)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[K]:
        if not self._changes and not self._gone:
            return iter(self._base)
        return (key for key, _ in self._pairs())

    def _pairs(self) -> Iterator[tuple[K, V]]:
        base, changes, gone = self._base, self._changes, self._gone
        if not changes and not gone:
            yield from base.items()
            return
        for key, value in base.items():
            if key not in gone:
                yield key, changes.get(key, value)
        for key, value in changes.items():
            if key in gone or key not in base:
                yield key, value

    def items(self) -> ItemsView[K, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def __repr__(self) -> str:
        return f"Table({dict(self._pairs())!r})"

    def __reduce__(self) -> tuple[type[Table[K, V]], tuple[dict[K, V]]]:
        return Table, (dict(self._pairs()),)  # pickled and copied merged

    # -- changing (into a new table) -------------------------------------------------------

    def _changed(self, changes: dict[K, V], gone: frozenset[K], size: int) -> Mapping[K, V]:
        base = self._base
        if len(changes) + len(gone) <= max(_MIN_CHANGES, isqrt(len(base))):
            return Table._made(base, changes, gone, size)
        merged = dict(base)
        for key in gone:
            del merged[key]
        merged.update(changes)  # in place for base keys, last for the others: the dict's order
        return merged if size < _SMALL else Table._made(merged, {}, frozenset(), size)

    def set(self, key: K, value: V) -> Mapping[K, V]:
        """This table with ``key`` filed as ``value``."""
        changes = self._changes
        present = key in changes or (key not in self._gone and key in self._base)
        changes = dict(changes)
        changes[key] = value
        return self._changed(changes, self._gone, self._size if present else self._size + 1)

    def without(self, key: K) -> Mapping[K, V]:
        """This table with ``key`` forgotten (itself when it holds no such key)."""
        if key not in self:
            return self
        changes, gone = self._changes, self._gone
        if key in changes:
            changes = dict(changes)
            del changes[key]
        if key in self._base and key not in gone:
            gone = gone | {key}
        return self._changed(changes, gone, self._size - 1)


class _Items(ItemsView[K, V]):
    __slots__ = ()
    _mapping: Table[K, V]

    def __iter__(self) -> Iterator[tuple[K, V]]:
        return self._mapping._pairs()


class _Values(ValuesView[V]):
    __slots__ = ()
    _mapping: Table[object, V]

    def __iter__(self) -> Iterator[V]:
        return (value for _, value in self._mapping._pairs())


def filed(entries: Mapping[K, V], key: K, value: V) -> Mapping[K, V]:
    """``entries`` with ``key`` filed as ``value`` (``entries`` is left as it was): a plain dict
    while small, else a table."""
    if type(entries) is Table:  # not isinstance: an ABC check costs a call per change
        return entries.set(key, value)
    if len(entries) < _SMALL:
        copied = dict(entries)
        copied[key] = value
        return copied
    return Table(entries).set(key, value)


def forgotten(entries: Mapping[K, V], key: K) -> Mapping[K, V]:
    """``entries`` without ``key`` (``entries`` is left as it was; itself when it holds no
    such key): a plain dict while small, else a table."""
    if type(entries) is Table:  # not isinstance: an ABC check costs a call per change
        return entries.without(key)
    if key not in entries:
        return entries
    if len(entries) <= _SMALL:
        copied = dict(entries)
        del copied[key]
        return copied
    return Table(entries).without(key)
