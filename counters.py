"""Counters: the one shape of every metric dbidx reports, from a cache partition to a commit's summary.

A counters class is a dataclass of numbers. Adding one counters object to another sums the numeric fields both
declare (so a shard's metrics take a cache's hits and a tagger's inserts by name, without a list of names kept in
sync by hand); fields marked `gauge()` (an id, a seq, a size measured once) are never summed. `to_dict` /
`from_dict` are the wire form: task results travel to the driver as dicts and are parsed strictly there, like any
other input read back.
"""

from __future__ import annotations

import copy
import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Mapping, TypeVar

T = TypeVar("T", bound="Counters")
_GAUGE = "dbidx_gauge"
_SUMMED: dict[type, frozenset[str]] = {}


def gauge(default: Any = 0) -> Any:
    """A field that describes rather than counts (an id, a seq, a size measured once): `add` leaves it alone."""
    return field(default=default, metadata={_GAUGE: True})


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class Counters:
    """Named numbers summed field by field (base of every metrics class)."""

    def add(self: T, *others: "Counters", **deltas: float) -> T:
        """Sum into this object the numeric non-gauge fields of each other counters object that this class also
        declares, then the named deltas (a name this class does not declare is a TypeError). Returns self."""
        mine = self._summed()
        for other in others:
            for name in mine & other._summed():
                setattr(self, name, getattr(self, name) + getattr(other, name))
        for name, delta in deltas.items():
            if name not in mine:
                raise TypeError(f"{type(self).__name__} has no counter {name!r}")
            setattr(self, name, getattr(self, name) + delta)
        return self

    @classmethod
    def _summed(cls) -> frozenset[str]:
        """The names `add` sums: public numeric fields that are not gauges (computed once per class)."""
        names = _SUMMED.get(cls)
        if names is None:
            names = _SUMMED[cls] = frozenset(
                f.name
                for f in fields(cls)
                if not f.name.startswith("_")
                and not f.metadata.get(_GAUGE)
                and f.default is not MISSING
                and _is_number(f.default)
            )
        return names

    def to_dict(self) -> dict[str, Any]:
        """Every public field, copied (lists and dicts included): the JSON and msgpack form."""
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if not f.name.startswith("_")}

    @classmethod
    def from_dict(cls: type[T], data: Mapping[str, Any]) -> T:
        """The counters of a dict another process wrote: every numeric field of this class must be present, >= 0,
        finite, and whole where the field is an int (KeyError / ValueError otherwise: callers turn those into their
        own typed error); keys this class does not declare are ignored, so a richer record reads as a narrower one."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name.startswith("_") or f.default is MISSING or not _is_number(f.default):
                continue
            value = data[f.name]
            whole = isinstance(f.default, int)
            if (
                not (isinstance(value, int) if whole else _is_number(value))
                or isinstance(value, bool)
                or not math.isfinite(value)
                or value < 0
            ):
                raise ValueError(
                    f"{cls.__name__}.{f.name} must be a {'whole' if whole else 'finite'} number >= 0, got {value!r}"
                )
            values[f.name] = value
        return cls(**values)
