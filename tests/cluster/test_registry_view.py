"""The deployments' registry view: current by long-poll, a missing name read once more, and
concurrent misses sharing that one read (the admin actor is a plain fake of its two reads)."""

import asyncio

import pytest

from cluster.registry_view import RegistryView


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakeAdmin:
    """The admin actor's snapshot and wait_for_change, counting the snapshot reads."""

    def __init__(self):
        self.doc = {"version": 1, "adapters": {"a": {"source": "x"}}}
        self.reads = 0
        self.changed = asyncio.Event()

        async def snapshot(fingerprint):
            self.reads += 1
            await asyncio.sleep(0.01)
            return {"version": self.doc["version"], "adapters": dict(self.doc["adapters"])}

        async def wait_for_change(version, timeout_s, fingerprint):
            if version == self.doc["version"]:
                try:
                    await asyncio.wait_for(self.changed.wait(), timeout_s)
                except TimeoutError:
                    pass
                self.changed.clear()
            return {"version": self.doc["version"], "adapters": dict(self.doc["adapters"])}

        self.snapshot = _Method(snapshot)
        self.wait_for_change = _Method(wait_for_change)

    def register(self, name: str, notify: bool) -> None:
        self.doc = {"version": self.doc["version"] + 1, "adapters": {**self.doc["adapters"], name: {"source": name}}}
        if notify:
            self.changed.set()


def test_a_missing_name_is_read_once_more_and_misses_share_the_read():
    async def run():
        admin = FakeAdmin()
        view = await RegistryView(admin, "fp").start()
        assert await view.lookup("a") == {"source": "x"} and admin.reads == 1
        # Registered a moment ago, not yet seen by the poll: the lookup reads it.
        admin.register("b", notify=False)
        assert await view.lookup("b") == {"source": "b"} and admin.reads == 2
        # Ten concurrent lookups of made-up names: one read between them, all None.
        found = await asyncio.gather(*(view.lookup(f"nope{i}") for i in range(10)))
        assert found == [None] * 10 and admin.reads == 3
        assert "nope0" not in view.entries
        view.stop()

    asyncio.run(run())


def test_the_poll_applies_each_new_version_once():
    async def run():
        admin = FakeAdmin()
        seen = []

        async def on_change(snapshot):
            seen.append(snapshot["version"])

        view = await RegistryView(admin, "fp", on_change).start()
        admin.register("c", notify=True)
        for _ in range(100):
            if view.version == 2:
                break
            await asyncio.sleep(0.01)
        assert "c" in view.entries and seen == [1, 2]
        await view.apply({"version": 2, "adapters": {}})  # the version held: nothing happens
        assert seen == [1, 2] and "c" in view.entries
        view.check()
        view.stop()

    asyncio.run(run())


def test_a_failed_read_reaches_the_caller():
    async def run():
        admin = FakeAdmin()
        view = await RegistryView(admin, "fp").start()

        async def down(fingerprint):
            raise ConnectionError("admin actor gone")

        admin.snapshot = _Method(down)
        with pytest.raises(ConnectionError):
            await view.lookup("zzz")
        view.stop()

    asyncio.run(run())
