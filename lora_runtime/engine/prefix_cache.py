"""Prefix caching over KV cache rows: which tokens each row holds, and for whom.

A finished sequence leaves its keys and values in its row until another sequence
overwrites them; a running one holds its prompt's (as far as it has been computed). A new
sequence whose prompt starts with what a row holds computes only the rest: it takes
that row if it is free, or copies it into a free row if a running sequence holds it.
K/V depend on the adapter that produced them, so a row's content is keyed by the adapter's
registration (name and generation: registering a name again, even at the same version,
gives a new generation); the base model's key is BASE.

Free rows are handed out least recently freed first, so recent content lives longest.
"""

from __future__ import annotations

import dataclasses

import numpy as np

AdapterKey = tuple[str, int]  # (adapter name, generation)
BASE: AdapterKey = ("", 0)


@dataclasses.dataclass(frozen=True)
class PrefixHit:
    """A row holding the first `length` tokens of a prompt, for the same adapter."""

    row: int
    length: int


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class RowContents:
    """What each cache row holds: the adapter key and tokens whose K/V are written there."""

    def __init__(self, rows: int):
        self._content: list[tuple[AdapterKey, np.ndarray] | None] = [None] * rows

    def set(self, row: int, key: AdapterKey, tokens) -> None:
        self._content[row] = (key, np.asarray(tokens, np.int64)) if len(tokens) else None

    def clear(self, row: int) -> None:
        self._content[row] = None

    def clear_all(self) -> None:
        self._content = [None] * len(self._content)

    def get(self, row: int) -> tuple[AdapterKey, np.ndarray] | None:
        return self._content[row]

    def best(self, key: AdapterKey, prompt: np.ndarray, rows, limit: int) -> PrefixHit | None:
        """The row among `rows` sharing the longest prefix with `prompt` (at most `limit`
        tokens) under `key`; ties go to the earliest of `rows`. None if nothing is shared."""
        best: PrefixHit | None = None
        for row in rows:
            content = self._content[row]
            if content is None or content[0] != key:
                continue
            length = min(common_prefix(content[1], prompt), limit)
            if length > 0 and (best is None or length > best.length):
                best = PrefixHit(row, length)
        return best
