"""The location dictionary of each column family: file-group ids (global mode: "partition\\0file group") stored
once per family, entries holding only the varint index of theirs (cache/codec.py).

The list lives in the family itself under LOCATIONS_KEY (written by the SST builder for a load, extended in the
same write batch as the entries that need a new location), so a family is self-describing; this class keeps its
decode and encode maps in memory per open family.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from dbidx.cache import codec, registry
from dbidx.cache.sst_builder import LOCATIONS_KEY
from dbidx.cache.store import Store, get, scan


class LocationDictionary:
    """Per column family: location list, stored value -> location, location -> stored value."""

    def __init__(self, cache_path: Path) -> None:
        self.cache_path = cache_path
        self._locations: dict[str, list[str]] = {}
        self._decoders: dict[str, dict[bytes | None, str | None]] = {}
        self._encoders: dict[str, dict[str, bytes]] = {}

    def load(self, store: Store, cf: str) -> None:
        """Read a family's stored dictionary (after open or ingest)."""
        raw = get(store.cf(cf), LOCATIONS_KEY)
        try:
            locations = registry.unpack_list(raw)
            if not all(isinstance(loc, str) and loc for loc in locations):
                raise ValueError("an entry is not a non-empty string")
        except Exception as exc:
            raise registry.damaged(self.cache_path, f"the location dictionary of column family {cf!r}", exc) from exc
        self.set(cf, locations)

    def set(self, cf: str, locations: list[str]) -> None:
        """Adopt a family's dictionary as a list (a load's SST carries the same list)."""
        self._locations[cf] = locations
        encoded = {codec.encode_index(i): loc for i, loc in enumerate(locations)}
        self._encoders[cf] = {loc: value for value, loc in encoded.items()}
        decoders: dict[bytes | None, str | None] = {value: loc for value, loc in encoded.items()}
        decoders[None] = None  # an absent key (a multi-get's None) decodes to None: lookups map without a test
        self._decoders[cf] = decoders

    def decoder(self, cf: str) -> dict[bytes | None, str | None]:
        """The stored value -> location map of a family, None -> None for an absent key (take it together with the
        family's view)."""
        return self._decoders[cf]

    def locations(self, cf: str) -> list[str]:
        """A family's whole dictionary, index order (a copy)."""
        return list(self._locations.get(cf, []))

    def decode(self, cf: str, raw: bytes) -> str:
        """The location of a stored value, also when it is not in the canonical map (a non-minimal varint); an
        index past the dictionary is a damaged cache (CacheCorruptError), never a missing key."""
        known = self._decoders[cf].get(raw)
        if known is not None:
            return known
        index = codec.decode_index(raw)
        locations = self._locations.get(cf, [])
        if index >= len(locations):
            raise registry.damaged(
                self.cache_path,
                f"column family {cf!r}",
                f"an entry has location #{index}, its dictionary holds {len(locations)}",
            )
        return locations[index]

    def encode(self, store: Store, cf: str, location: str, batch: Any) -> bytes:
        """The stored value of a location, extending the family's dictionary in the same write batch."""
        known = self._encoders[cf].get(location)
        if known is not None:
            return known
        locations = self._locations[cf]
        locations.append(location)
        value = codec.encode_index(len(locations) - 1)
        self._decoders[cf][value] = location
        self._encoders[cf][location] = value
        batch.put(LOCATIONS_KEY, registry.pack(locations), store.handle(cf))
        return value

    def count(self, store: Store, cf: str) -> tuple[int, dict[str, int]]:
        """(entries, live keys per location) of a family, read from its data (recovery after a crash)."""
        fills: dict[str, int] = defaultdict(int)
        entries = 0
        for key, raw in scan(store.cf(cf)):
            if key != LOCATIONS_KEY:
                fills[self.decode(cf, raw)] += 1
                entries += 1
        return entries, dict(fills)

    def forget(self, cf: str) -> None:
        """Drop a family's maps (the family was dropped or replaced)."""
        self._locations.pop(cf, None)
        self._decoders.pop(cf, None)
        self._encoders.pop(cf, None)
