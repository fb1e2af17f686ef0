"""The ledger several ingress replicas share (rate limits, /metrics counts), and each
replica's client of it, which goes on alone while the shared one is away. Through a real
Serve deployment: tests/integration/test_serve_app.py (the keyed deployment runs two
ingress replicas)."""

from __future__ import annotations

import asyncio
import logging
import threading

from cluster.api_keys import ApiKey
from cluster import ingress_ledger
from cluster.ingress_ledger import FORGET_AFTER_S, RETRY_AFTER_S, IngressLedger, LedgerClient


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


LIMITED = ApiKey(name="acme", sha256="0" * 64, requests_per_minute=3, tokens_per_minute=100)
OPEN = ApiKey(name="globex", sha256="1" * 64)


class _Method:
    def __init__(self, handle: "Handle", name: str):
        self._handle, self._name = handle, name

    async def remote(self, *args):
        await asyncio.sleep(0)  # another task may run meanwhile, as across processes
        if self._handle.hung:
            await asyncio.sleep(3600)
        if self._handle.down:
            raise ConnectionError("the ledger's replica is gone")
        if self._name == "ledger":  # LedgerHost.ledger: the actor's handle
            self._handle.handed += 1
            return self._handle
        result = getattr(self._handle.state, self._name)(*args)
        if self._handle.late:
            await asyncio.sleep(3600)
        return result


class Handle:
    """Stands for the Serve handle of one LedgerHost replica and for its ledger actor's
    handle (``handle.ledger.remote()`` gives this same object): ``handle.<method>.remote(...)``
    awaits the call; ``down`` makes every call fail as a dead replica's would."""

    def __init__(self, ledger: IngressLedger):
        self.state = ledger
        self.down = False
        self.hung = False  # every call waits (a replica that took the call and never answers)
        self.late = False  # every call is carried out, and its answer never comes back
        self.handed = 0  # how often the host gave the actor's handle

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)


def test_two_ingress_replicas_share_each_keys_rates():
    handle = Handle(IngressLedger(Clock()))
    a, b = LedgerClient(handle), LedgerClient(handle)

    async def run():
        assert a.shared and b.shared
        # 3 requests a minute in all, whichever replica a request reaches.
        assert [await c.admit(LIMITED) for c in (a, b, a)] == [None, None, None]
        assert handle.handed == 2  # each client asked the host once, then called the actor
        for c in (a, b):
            why, retry = await c.admit(LIMITED)
            assert "3 requests per minute" in why and retry == 20
        # A key with no limits is never refused.
        assert all([await c.admit(OPEN) is None for c in (a, b) for _ in range(50)])
        # Tokens charged through one replica count on the other.
        tokens = ApiKey(name="tokens", sha256="4" * 64, tokens_per_minute=100)
        assert await a.admit(tokens) is None
        a.charge(tokens, 130)
        await a.drain()
        why, retry = await b.admit(tokens)
        assert "100 tokens per minute" in why and retry == 18

    asyncio.run(run())


def test_each_keys_usage_is_counted_where_its_buckets_are():
    ledger = IngressLedger(Clock())
    for _ in range(5):
        ledger.admit(LIMITED)  # 3 admitted, 2 over the rate
    ledger.admit(OPEN)
    ledger.charge(LIMITED, 40)
    ledger.charge(OPEN, 7)
    ledger.charge(OPEN, 0)
    got = ledger.report("a", {}, 0, {})["keys"]
    assert got == {"acme": {"admitted": 3, "rate_limited": 2, "tokens": 40},
                   "globex": {"admitted": 1, "rate_limited": 0, "tokens": 7}}
    ledger.forget(["globex"])  # acme left the keys file: its series end
    assert list(ledger.report("a", {}, 0, {})["keys"]) == ["globex"]


def test_forget_drops_the_buckets_of_removed_keys_only():
    clock = Clock()
    ledger = IngressLedger(clock)
    other = ApiKey(name="initech", sha256="2" * 64, requests_per_minute=1)
    for key in (LIMITED, LIMITED, LIMITED, other):
        assert ledger.admit(key) is None
    ledger.forget(["acme"])  # initech left the keys file; acme stays, its budget spent
    assert ledger.admit(LIMITED) is not None
    assert ledger.admit(other) is None  # a key added back starts with a full bucket


def test_concurrent_admits_take_exactly_the_budget():
    ledger = IngressLedger(Clock())
    key = ApiKey(name="burst", sha256="3" * 64, requests_per_minute=100)
    admitted = []

    def worker():
        admitted.extend(ledger.admit(key) is None for _ in range(50))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(admitted) == 100 and len(admitted) == 400


class _Records(logging.Handler):
    """The records of one logger, caught directly (Ray may set "ray.serve" not to propagate)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_goes_on_alone_while_the_ledger_is_away_and_says_so_once():
    handle = Handle(IngressLedger(Clock()))
    clock = Clock()
    client = LedgerClient(handle, clock=clock)
    caught, log = _Records(), logging.getLogger("ray.serve")
    level = log.level
    log.addHandler(caught)
    log.setLevel(logging.INFO)

    async def run():
        assert await client.admit(LIMITED) is None
        handle.down = True
        # Its own buckets now: a full one for this key.
        assert [await client.admit(LIMITED) for _ in range(3)] == [None, None, None]
        assert await client.admit(LIMITED) is not None
        client.charge(LIMITED, 10)
        await client.drain()
        got = await client.report("ingress-a", {"resident": 2}, 5, {})
        assert got["admitted"] == {"ingress-a": 5} and got["routing"] == {"resident": 2}
        handle.down = False
        # For a second after a failure the client does not ask again (no request waits on a
        # ledger that just failed): still its own buckets, this key's spent.
        assert await client.admit(LIMITED) is not None
        clock.t += RETRY_AFTER_S
        # Back on the shared ledger: its bucket had 2 left, and no tokens were charged there.
        assert [await client.admit(LIMITED) for _ in range(2)] == [None, None]
        assert "3 requests per minute" in (await client.admit(LIMITED))[0]
        assert handle.handed == 2  # asked again after the failure

    try:
        asyncio.run(run())
    finally:
        log.removeHandler(caught)
        log.setLevel(level)
    messages = [r.getMessage() for r in caught.records]
    errors = [m for r, m in zip(caught.records, messages) if r.levelno == logging.ERROR and "shared ingress ledger" in m]
    assert len(errors) == 1 and "ConnectionError" in errors[0], messages
    assert any("answers again" in m for m in messages), messages


def test_a_ledger_that_does_not_answer_holds_a_request_no_longer_than_the_timeout(monkeypatch):
    monkeypatch.setattr(ingress_ledger, "LEDGER_TIMEOUT_S", 0.05)
    handle = Handle(IngressLedger(Clock()))
    client = LedgerClient(handle)

    async def run():
        assert await client.admit(LIMITED) is None
        handle.hung = True
        loop = asyncio.get_running_loop()
        start = loop.time()
        assert await client.admit(LIMITED) is None  # its own bucket, after the timeout
        assert loop.time() - start < 1.0
        start = loop.time()
        assert [await client.admit(LIMITED) for _ in range(2)] == [None, None]  # no wait at all now
        assert loop.time() - start < 0.04

    asyncio.run(run())


def _report(ledger: IngressLedger, ingress: str, routing: dict, admitted: int, replicas: dict) -> dict:
    return ledger.report(ingress, routing, admitted, {r: {"as_of": t, "metrics": {"n": n}}
                                                      for r, (t, n) in replicas.items()})


def test_metrics_read_through_any_ingress_replica_never_go_back():
    ledger = IngressLedger(Clock())
    got = _report(ledger, "a", {"resident": 4, "placed": 1}, 5, {"r1": (10.0, 7), "r2": (10.0, 3)})
    assert got["replicas"] == {"r1": {"n": 7}, "r2": {"n": 3}}
    # Replica b's routers got r1's last report later than a's: what a saw stays.
    got = _report(ledger, "b", {"resident": 1, "host": 2}, 3, {"r1": (9.0, 6), "r2": (11.0, 4)})
    assert got["replicas"] == {"r1": {"n": 7}, "r2": {"n": 4}}
    assert got["routing"] == {"resident": 5, "placed": 1, "host": 2}
    assert got["admitted"] == {"a": 5, "b": 3}
    # Only the replicas the caller knows run: a stopped one's series end.
    got = _report(ledger, "a", {"resident": 6, "placed": 1}, 7, {"r2": (12.0, 5)})
    assert got["replicas"] == {"r2": {"n": 5}} and got["routing"]["resident"] == 7
    # An earlier report of a's that arrives late (its periodic one after a scrape's) changes nothing.
    got = _report(ledger, "a", {"resident": 5, "placed": 1}, 6, {"r2": (11.5, 4)})
    assert got["replicas"] == {"r2": {"n": 5}} and got["routing"]["resident"] == 7 and got["admitted"]["a"] == 7


def test_a_gone_ingress_replica_keeps_its_routing_share():
    clock = Clock()
    ledger = IngressLedger(clock)
    _report(ledger, "a", {"resident": 4}, 4, {"r1": (1.0, 1)})
    _report(ledger, "b", {"resident": 3, "placed": 1}, 4, {"r1": (1.0, 1)})
    clock.t += FORGET_AFTER_S + 1.0  # b stopped (scaled down, or restarted under another id)
    got = _report(ledger, "a", {"resident": 6}, 6, {"r1": (2.0, 2)})
    assert got["admitted"] == {"a": 6}  # b's series ends
    assert got["routing"] == {"resident": 9, "placed": 1}  # the sum does not go back
    got = _report(ledger, "a", {"resident": 7}, 7, {"r1": (3.0, 3)})
    assert got["routing"] == {"resident": 10, "placed": 1}


def test_the_only_ingress_replica_keeps_its_own_ledger():
    client = LedgerClient(clock=Clock())

    async def run():
        assert not client.shared
        assert [await client.admit(LIMITED) for _ in range(3)] == [None, None, None]
        assert "3 requests per minute" in (await client.admit(LIMITED))[0]
        client.forget(["globex"])  # acme left the keys file: its spent bucket goes
        assert await client.admit(LIMITED) is None
        client.charge(LIMITED, 500)  # applied at once, no task
        assert "100 tokens per minute" in (await client.admit(LIMITED))[0]
        got = await client.report("only", {"placed": 1}, 4, {"r1": {"as_of": 5.0, "metrics": {"n": 1}}})
        assert got == {"replicas": {"r1": {"n": 1}}, "routing": {"placed": 1}, "admitted": {"only": 4},
                       "keys": {"acme": {"admitted": 1, "rate_limited": 1, "tokens": 500}}}  # since forget

    asyncio.run(run())


def test_ingress_replicas_read_each_others_routing_records_once():
    """Each replica passes its routers' records and gets the others' since its last call,
    never its own; a cursor the ledger never gave (it restarted) reads all it holds."""
    handle = Handle(IngressLedger(Clock()))
    a, b = LedgerClient(handle), LedgerClient(handle)

    async def run():
        after_a, got = await a.exchange_routes("ingress-a", 0, [((1, 2), "r0"), ((3,), "r1")])
        assert got == []
        after_b, got = await b.exchange_routes("ingress-b", 0, [((9,), "r1")])
        assert got == [((1, 2), "r0"), ((3,), "r1")]
        after_a, got = await a.exchange_routes("ingress-a", after_a, [])
        assert got == [((9,), "r1")]  # b's, not a's own again
        after_b, got = await b.exchange_routes("ingress-b", after_b, [])
        assert got == []  # nothing new
        # A new ledger (Serve restarted its host): b's cursor is past anything it gave.
        handle.state = IngressLedger(Clock())
        await a.exchange_routes("ingress-a", 0, [((5,), "r0")])
        _, got = await b.exchange_routes("ingress-b", after_b, [])
        assert got == [((5,), "r0")]

    asyncio.run(run())


def test_routing_records_wait_while_the_ledger_is_away_and_arrive_once(monkeypatch):
    """Records an ingress replica's routers made while the shared ledger did not answer reach
    the others when it answers again (they are not left in the replica's own ledger), and a
    call that timed out yet reached the ledger does not have its records kept twice."""
    monkeypatch.setattr(ingress_ledger, "LEDGER_TIMEOUT_S", 0.05)
    clock = Clock()
    handle = Handle(IngressLedger(Clock()))
    a, b = LedgerClient(handle, clock=clock), LedgerClient(handle)

    async def run():
        after_a, _ = await a.exchange_routes("ingress-a", 0, [((1,), "r0")])
        after_b, got = await b.exchange_routes("ingress-b", 0, [])
        assert got == [((1,), "r0")]
        handle.down = True
        assert await a.exchange_routes("ingress-a", after_a, [((2,), "r1")]) == (after_a, [])
        clock.t += RETRY_AFTER_S  # a asks again; the ledger is still away
        assert await a.exchange_routes("ingress-a", after_a, [((3,), "r0")]) == (after_a, [])
        handle.down = False
        handle.late = True  # the call arrives, its answer is lost
        clock.t += RETRY_AFTER_S
        assert await a.exchange_routes("ingress-a", after_a, [((4,), "r1")]) == (after_a, [])
        handle.late = False
        clock.t += RETRY_AFTER_S
        after_a, got = await a.exchange_routes("ingress-a", after_a, [((5,), "r0")])
        assert got == []
        _, got = await b.exchange_routes("ingress-b", after_b, [])
        assert got == [((2,), "r1"), ((3,), "r0"), ((4,), "r1"), ((5,), "r0")]  # each once, in order

    asyncio.run(run())


def test_the_ledger_keeps_the_newest_routing_records(monkeypatch):
    monkeypatch.setattr(ingress_ledger, "ROUTES_KEPT", 4)
    ledger = IngressLedger(Clock())
    ledger.exchange_routes("ingress-a", 0, [((i,), "r0") for i in range(10)])
    _, got = ledger.exchange_routes("ingress-b", 0, [])
    assert got == [((i,), "r0") for i in range(6, 10)]
