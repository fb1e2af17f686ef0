"""A deployment's live view of the adapter registry: the admin actor's entries for one base
model, kept current by long-polling the actor.

The ingress reads it to refuse an unknown model at the edge (so a misspelt or fuzzed name
never reaches the router, a replica or a metric label); a model-server replica also applies
each new snapshot to its adapter manager (`on_change`). A name missing from the view is
looked up once more before it is called unknown, so a client that registers and then calls
at once is served; concurrent lookups share that one read.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("ray.serve")

POLL_TIMEOUT_S = 5.0
RETRY_S = 0.25


class RegistryView:
    """The registry entries of one base model (by config fingerprint), as of the last poll."""

    def __init__(self, admin, fingerprint: str | None,
                 on_change: Callable[[dict], Awaitable[None]] | None = None):
        self._admin = admin
        self._fingerprint = fingerprint
        self._on_change = on_change
        self._lock = asyncio.Lock()
        self._refresh: asyncio.Task | None = None
        self._task: asyncio.Task | None = None
        self.version = -1
        self.entries: dict[str, dict] = {}

    async def start(self) -> RegistryView:
        """Reads the registry once, then keeps the view current in the background."""
        await self.apply(await self._admin.snapshot.remote(self._fingerprint))
        self._task = asyncio.create_task(self._poll())
        return self

    async def apply(self, snapshot: dict) -> None:
        """Takes a snapshot unless it is the version held; serialized, so a stale snapshot
        applied late differs from the admin's version and the next poll corrects it."""
        async with self._lock:
            if snapshot["version"] == self.version:
                return
            if self._on_change is not None:
                await self._on_change(snapshot)
            self.entries = snapshot["adapters"]
            self.version = snapshot["version"]

    async def lookup(self, name: str) -> dict | None:
        """The entry of `name`, read again from the admin actor if the view lacks it."""
        entry = self.entries.get(name)
        if entry is not None:
            return entry
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._read())
        await asyncio.shield(self._refresh)
        return self.entries.get(name)

    def check(self) -> None:
        """RuntimeError if the background poll stopped (the view would go stale)."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            raise RuntimeError(f"registry poll stopped: {self._task.exception()!r}")

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _read(self) -> None:
        await self.apply(await self._admin.snapshot.remote(self._fingerprint))

    async def _poll(self) -> None:
        while True:
            try:
                snap = await self._admin.wait_for_change.remote(self.version, POLL_TIMEOUT_S, self._fingerprint)
                await self.apply(snap)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the admin actor restarting: retry, it comes back
                from cluster.admin import unwrap_error

                logger.warning("registry poll failed, retrying: %s", unwrap_error(e))
                await asyncio.sleep(RETRY_S)
