"""An LRU cache of parsed adapters in host memory, bounded in bytes and in count."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from lora_runtime.lora.adapter import LoRAAdapter


class HostAdapterCache:
    """LRU of adapters keyed by content id (one copy however many names share it); not
    thread-safe (the manager locks)."""

    def __init__(self, *, max_bytes: int, max_count: int):
        if max_bytes <= 0:
            raise ValueError(f"{max_bytes=} must be positive")
        if max_count <= 0:
            raise ValueError(f"{max_count=} must be positive")
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._items: OrderedDict[Hashable, LoRAAdapter] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list[Hashable]:
        """Keys from least to most recently used."""
        return list(self._items)

    def get(self, key: Hashable) -> LoRAAdapter | None:
        """The adapter under `key` (marking it most recently used), or None."""
        adapter = self._items.get(key)
        if adapter is not None:
            self._items.move_to_end(key)
        return adapter

    def peek(self, key: Hashable) -> LoRAAdapter | None:
        """The adapter under `key`, or None, leaving the LRU order as it is."""
        return self._items.get(key)

    def put(self, key: Hashable, adapter: LoRAAdapter) -> list[Hashable]:
        """Inserts `adapter` as most recently used; returns the keys evicted to fit it.

        An adapter larger than the whole byte budget is not cached (nothing is evicted
        for it): it can still be written to a device slot straight from the fetch.
        """
        if adapter.nbytes > self.max_bytes:
            return []
        self.pop(key)
        self._items[key] = adapter
        self.nbytes += adapter.nbytes
        evicted = []
        while self.nbytes > self.max_bytes or len(self._items) > self.max_count:
            old_key, old = self._items.popitem(last=False)
            self.nbytes -= old.nbytes
            self.evictions += 1
            evicted.append(old_key)
        return evicted

    def pop(self, key: Hashable) -> LoRAAdapter | None:
        adapter = self._items.pop(key, None)
        if adapter is not None:
            self.nbytes -= adapter.nbytes
        return adapter
