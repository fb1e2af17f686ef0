"""Per-key request and token rate limits: token buckets that refill continuously.

A key with ``requests_per_minute = R`` holds a bucket of R requests refilling at R/60 a
second, so it may burst to R at once and sustain R a minute. Tokens (prompt plus
completion) are charged when a response ends, as they are only known then; a new request
is admitted while the key's token bucket is not in debt, so one request may overshoot the
budget and the next waits until the debt is repaid. A refusal says when to retry.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from cluster.api_keys import ApiKey


class RateLimited(Exception):
    """A key is over one of its rates; ``retry_after_s`` is when it will be under again."""

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass
class _Bucket:
    per_minute: int
    level: float
    at: float

    def refill(self, now: float) -> None:
        self.level = min(float(self.per_minute), self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def wait_s(self, need: float) -> int:
        """Whole seconds (at least 1) until the level reaches ``need``."""
        return max(1, math.ceil((need - self.level) * 60.0 / self.per_minute - 1e-9))


class RateLimiter:
    """Buckets per key name; a key's buckets follow its current limits when the keys file changes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._requests: dict[str, _Bucket] = {}
        self._tokens: dict[str, _Bucket] = {}

    def _bucket(self, table: dict[str, _Bucket], name: str, per_minute: int | None, now: float) -> _Bucket | None:
        if per_minute is None:
            table.pop(name, None)
            return None
        bucket = table.get(name)
        if bucket is None:
            bucket = table[name] = _Bucket(per_minute, float(per_minute), now)
        elif bucket.per_minute != per_minute:  # the keys file changed this key's limit
            bucket.refill(now)
            bucket.level = min(bucket.level, float(per_minute))
            bucket.per_minute = per_minute
        bucket.refill(now)
        return bucket

    def admit(self, key: ApiKey) -> None:
        """Takes one request from the key's budget, or raises RateLimited (taking nothing)."""
        now = self._clock()
        requests = self._bucket(self._requests, key.name, key.requests_per_minute, now)
        tokens = self._bucket(self._tokens, key.name, key.tokens_per_minute, now)
        if requests is not None and requests.level < 1.0:
            raise RateLimited(f"API key {key.name!r} is over its {key.requests_per_minute} requests per minute",
                              requests.wait_s(1.0))
        if tokens is not None and tokens.level < 0.0:
            raise RateLimited(f"API key {key.name!r} is over its {key.tokens_per_minute} tokens per minute",
                              tokens.wait_s(0.0))
        if requests is not None:
            requests.level -= 1.0

    def charge(self, key: ApiKey, tokens: int) -> None:
        """Charges a finished response's prompt and completion tokens to the key."""
        bucket = self._bucket(self._tokens, key.name, key.tokens_per_minute, self._clock())
        if bucket is not None:
            bucket.level -= tokens

    def forget(self, names: set[str]) -> None:
        """Drops the buckets of keys no longer in the keys file."""
        for table in (self._requests, self._tokens):
            for name in set(table) - names:
                del table[name]
