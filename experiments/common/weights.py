"""Rotating weight sets: enough copies of a matrix that their total exceeds the last-level
cache, so each call reads its weights from DRAM (the L3 here is 480 MiB: NOTES.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MIB = 1 << 20
GIB = 1 << 30


class RotatingSet:
    """`count` independent items from make(i), each `item_bytes`, so count * item_bytes >=
    total_bytes; next() returns them in turn (item i, i+1, ...)."""

    def __init__(self, make: Callable[[int], Any], item_bytes: int, total_bytes: int, min_count: int = 2):
        self.count = max(min_count, -(-int(total_bytes) // max(1, int(item_bytes))))
        self.items = [make(i) for i in range(self.count)]
        self.item_bytes = int(item_bytes)
        self._i = 0

    @property
    def total_bytes(self) -> int:
        return self.count * self.item_bytes

    def next(self) -> Any:
        item = self.items[self._i]
        self._i = (self._i + 1) % self.count
        return item

    def __len__(self) -> int:
        return self.count
