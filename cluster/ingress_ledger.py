"""IngressLedger: what several ingress replicas share, so that they act as one endpoint.

With one ingress replica its process holds the rate-limit buckets and the counts /metrics
shows. With more (``ingress_replicas``, or as many as ``ingress_autoscaling`` starts), Serve's
proxy spreads the requests over them, so:

- **Rate limits** are kept here, once per API key: each replica asks before it admits a
  request and charges a response's tokens here, so a key gets its rate once, not once per
  replica.
- **Usage per API key**: requests admitted and refused for a rate, and tokens charged,
  counted where the buckets are (``multilora_api_key_requests_total{key, outcome}``,
  ``multilora_api_key_tokens_total{key}``), for metering tenants.
- **Routing records**: each replica's routers remember which model-server replica was sent
  the start of which prompt (cluster/routing.py PrefixAffinity) and which adapter
  (ResidencyEstimate). A conversation's turns reach different ingress replicas, and each
  replica's router sees only its share of an adapter's requests, so each replica passes
  what its routers recorded through here and takes the others' (``exchange_routes``,
  twice a second): a turn goes where the turn before it is cached, whichever ingress
  replica took either, and every router counts the adapters the others sent where.
- **/metrics** answers the same from every replica. Each one reports what it counted (its
  routers' routing outcomes, the requests it admitted), and a scraped one also the
  model-server snapshots its routers last received; the ledger keeps each model server's
  newest snapshot by its time, so a counter read through one ingress and then another never
  goes back, and sums the routing outcomes over every ingress replica that ever reported
  (one that is gone keeps its share).

The ingress binds LedgerHost as a Serve deployment of one replica (deployments/app.py). It
runs the ledger as a Ray actor of its own and hands its handle to the ingress replicas,
which call the actor directly: a request with an API key then waits ~1.4 ms for the
ledger, not the ~5 ms of a Serve call. The actor goes with its host replica, so with the
app, and Serve restarts a host whose actor died (its health check asks the actor). The
ledger keeps its state in memory: a restarted one starts every key with a full bucket, and
its sums from what the ingress replicas report next.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping

from cluster.api_keys import ApiKey
from cluster.rate_limit import RateLimited, RateLimiter

logger = logging.getLogger("ray.serve")

# Longest an ingress replica waits for the shared ledger before going on with its own, and
# how long after a failure it goes on with its own before asking again.
LEDGER_TIMEOUT_S = 0.5
RETRY_AFTER_S = 1.0

# An ingress replica silent this long is gone: its admitted-requests series ends (its
# routing outcomes stay in the sums). A model-server replica none reports this long is
# dropped too.
FORGET_AFTER_S = 60.0

# Routing records (exchange_routes) kept for the ingress replicas to read each other's: at
# 100 requests/s, the last minute or more of them.
ROUTES_KEPT = 8192


class IngressLedger:
    """Rate-limit buckets per API key and the merged /metrics counts of the ingress replicas.
    Thread-safe: its actor runs calls on several threads (each holds the lock for
    microseconds)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._limiter = RateLimiter(clock)
        self._ingress: dict[str, dict] = {}  # ingress id -> {"at", "routing", "admitted"}
        self._retired = Counter()  # routing outcomes of ingress replicas that are gone
        self._replicas: dict[str, dict] = {}  # model-server replica id -> {"at", "as_of", "metrics"}
        self._usage: dict[str, Counter] = {}  # key name -> {"admitted", "rate_limited", "tokens"}
        self._routes: deque[tuple[int, str, object]] = deque(maxlen=ROUTES_KEPT)  # (number, ingress id, record)
        self._routes_added = 0
        self._route_serials: dict[str, int] = {}  # ingress id -> the number of its next record

    def admit(self, key: ApiKey) -> tuple[str, int] | None:
        """Takes one request from ``key``'s budget: None, or (why, retry-after seconds) when
        it is over a rate (taking nothing). Refusals are returned, not raised, so they cross
        the process boundary as plain data."""
        with self._lock:
            usage = self._usage.setdefault(key.name, Counter())
            try:
                self._limiter.admit(key)
            except RateLimited as e:
                usage["rate_limited"] += 1
                return str(e), e.retry_after_s
            usage["admitted"] += 1
        return None

    def charge(self, key: ApiKey, tokens: int) -> None:
        """A finished response's prompt and completion tokens, against its key's token rate."""
        if tokens > 0:
            with self._lock:
                self._limiter.charge(key, tokens)
                self._usage.setdefault(key.name, Counter())["tokens"] += tokens

    def forget(self, names: Iterable[str]) -> None:
        """Drops the buckets and usage of keys not in ``names`` (the keys file in force)."""
        kept = set(names)
        with self._lock:
            self._limiter.forget(kept)
            for name in set(self._usage) - kept:
                del self._usage[name]

    def report(self, ingress_id: str, routing: Mapping[str, int], admitted: int,
               replicas: Mapping[str, dict]) -> dict:
        """Takes one ingress replica's counts (cumulative: its routers' routing outcomes and
        the requests it admitted) and the model-server reports it holds (replica id ->
        ``{"as_of": time.time() of the report or None, "metrics": snapshot}``); returns what
        /metrics shows: ``{"replicas": id -> the newest snapshot any ingress reported, for
        the replicas in ``replicas`` (the caller's running set), "routing": outcome -> sum
        over every ingress replica, "admitted": ingress id -> requests, "keys": key name ->
        {"admitted", "rate_limited", "tokens"}}``."""
        with self._lock:
            return self._report(ingress_id, routing, admitted, replicas)

    def _report(self, ingress_id: str, routing: Mapping[str, int], admitted: int,
                replicas: Mapping[str, dict]) -> dict:
        now = self._clock()
        # Counts only grow: two reports of one replica may arrive out of order (its periodic
        # one and a scrape's), so the larger of each count stands.
        held = self._ingress.setdefault(ingress_id, {"routing": Counter(), "admitted": 0})
        held["at"] = now
        held["admitted"] = max(held["admitted"], int(admitted))
        for outcome, n in routing.items():
            held["routing"][outcome] = max(held["routing"][outcome], n)
        for rid, rep in replicas.items():
            kept = self._replicas.get(rid)
            if kept is None or _newer(rep.get("as_of"), kept["as_of"]):
                kept = self._replicas[rid] = {"as_of": rep.get("as_of"), "metrics": rep["metrics"]}
            kept["at"] = now
        self._forget_silent(now)
        routing_sum = Counter(self._retired)
        for entry in self._ingress.values():
            routing_sum.update(entry["routing"])
        return {
            "replicas": {rid: self._replicas[rid]["metrics"] for rid in replicas},
            "routing": dict(routing_sum),
            "admitted": {iid: entry["admitted"] for iid, entry in sorted(self._ingress.items())},
            "keys": {name: {k: usage[k] for k in ("admitted", "rate_limited", "tokens")}
                     for name, usage in sorted(self._usage.items())},
        }

    def _forget_silent(self, now: float) -> None:
        for iid in [i for i, e in self._ingress.items() if now - e["at"] > FORGET_AFTER_S]:
            self._retired.update(self._ingress.pop(iid)["routing"])
        for rid in [r for r, e in self._replicas.items() if now - e["at"] > FORGET_AFTER_S]:
            del self._replicas[rid]

    def exchange_routes(self, ingress_id: str, after: int, records: list, first: int = 0) -> tuple[int, list]:
        """Keeps ``records`` (the routing records ``ingress_id``'s routers made since it last
        called) and returns (a number to pass as ``after`` next time, the records of the
        other ingress replicas kept since ``after``, oldest first). An ``after`` this ledger
        never gave (it restarted since) returns every other replica's record it holds.

        ``first`` numbers ``records[0]`` among all the records ``ingress_id`` ever sent: a
        call its client sent again (the first one timed out there, yet arrived) keeps only
        the records this ledger has not kept before."""
        with self._lock:
            if after > self._routes_added:
                after = 0
            others = []
            for number, iid, record in reversed(self._routes):
                if number < after:
                    break
                if iid != ingress_id:
                    others.append(record)
            others.reverse()
            kept = self._route_serials.get(ingress_id, first)
            for record in records[max(0, kept - first):]:
                self._routes.append((self._routes_added, ingress_id, record))
                self._routes_added += 1
            self._route_serials[ingress_id] = max(kept, first + len(records))
            return self._routes_added, others

    def ping(self) -> bool:
        """Answers: the host's health check."""
        return True


# What LedgerClient._shared_call returns while the shared ledger cannot be reached.
_UNREACHABLE = object()

# Calls the ledger actor runs at once (each holds its lock for microseconds).
_LEDGER_CONCURRENCY = 64


class LedgerHost:
    """The Serve deployment that owns the shared IngressLedger, as a Ray actor it started
    (the module's docstring says why)."""

    def __init__(self):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ledger = ray.remote(IngressLedger).options(
            num_cpus=0,
            max_concurrency=_LEDGER_CONCURRENCY,
            # Never in a placement group of its host's: it would go with it.
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=None),
        ).remote()

    async def ledger(self):
        """The ledger actor's handle (the ingress replicas call it directly)."""
        return self._ledger

    async def check_health(self) -> None:
        """Serve restarts this replica, and so the ledger, when the ledger does not answer."""
        await self._ledger.ping.remote()


def _newer(as_of: float | None, than: float | None) -> bool:
    """Whether a report taken at ``as_of`` is newer than one taken at ``than`` (a report
    whose time is not known is older than any that has one, and replaces another such)."""
    if as_of is None:
        return than is None
    return than is None or as_of >= than


class LedgerClient:
    """An ingress replica's side of the ledger: an IngressLedger of its own (the only ingress
    replica) or the shared one (``shared``: a Serve deployment handle of LedgerHost, whose
    ledger actor this client then calls directly).

    While the shared ledger cannot be reached (it is restarting), this replica goes on with
    a ledger of its own, and says so in its log once: requests are admitted against its own
    buckets (a key gets its rate once per ingress replica meanwhile), and /metrics shows its
    own counts. Both recover by themselves when the shared ledger answers again (the next
    call after a failure asks the host for the ledger's handle again)."""

    def __init__(self, shared=None, clock: Callable[[], float] = time.monotonic):
        self._shared = shared
        self._clock = clock
        self._ledger = None  # the shared ledger actor's handle, once the host gave it
        self._retry_at = -math.inf  # after a failure: not asked again before this (clock)
        self._own = IngressLedger(clock)
        self._unreachable = False
        self._pending: set[asyncio.Task] = set()
        # Routing records the shared ledger has not taken yet, and the number of the first.
        self._unsent: deque = deque(maxlen=ROUTES_KEPT)
        self._unsent_first = 0

    @property
    def shared(self) -> bool:
        return self._shared is not None

    async def _call(self, method: str, *args):
        if self._shared is None:
            return getattr(self._own, method)(*args)
        result = await self._shared_call(method, *args)
        return getattr(self._own, method)(*args) if result is _UNREACHABLE else result

    async def _shared_call(self, method: str, *args):
        """The shared ledger's answer, or _UNREACHABLE while it cannot be reached."""
        if self._ledger is None and self._clock() < self._retry_at:
            return _UNREACHABLE  # failed a moment ago: no request waits on it
        try:
            if self._ledger is None:
                # While Serve replaces the host, a call to it would wait for the new one.
                self._ledger = await asyncio.wait_for(self._shared.ledger.remote(), LEDGER_TIMEOUT_S)
            result = await asyncio.wait_for(getattr(self._ledger, method).remote(*args), LEDGER_TIMEOUT_S)
        except Exception as e:  # Serve or Ray wrap what went wrong there: go on here, say so once
            self._ledger = None
            self._retry_at = self._clock() + RETRY_AFTER_S
            if not self._unreachable:
                logger.error("the shared ingress ledger failed (%r): rate limits and /metrics counts are this "
                             "ingress replica's own until it answers again", e)
            self._unreachable = True
            return _UNREACHABLE
        if self._unreachable:
            logger.info("the shared ingress ledger answers again: rate limits and /metrics counts are shared")
            self._unreachable = False
        return result

    async def admit(self, key: ApiKey) -> tuple[str, int] | None:
        """None, or (why, retry-after seconds): IngressLedger.admit."""
        return await self._call("admit", key)

    def charge(self, key: ApiKey, tokens: int) -> None:
        """IngressLedger.charge, without waiting for the shared ledger."""
        self._send("charge", key, tokens)

    def forget(self, names: Iterable[str]) -> None:
        """IngressLedger.forget, without waiting for the shared ledger."""
        self._send("forget", sorted(names))

    async def report(self, ingress_id: str, routing: Mapping[str, int], admitted: int,
                     replicas: Mapping[str, dict]) -> dict:
        """IngressLedger.report."""
        return await self._call("report", ingress_id, dict(routing), admitted, dict(replicas))

    async def exchange_routes(self, ingress_id: str, after: int, records: list) -> tuple[int, list]:
        """IngressLedger.exchange_routes. While the shared ledger does not answer, ``records``
        wait here (the newest ROUTES_KEPT of them) and go with the next call that reaches it,
        and (``after``, no records) comes back: no other ingress replica would read them in
        this replica's own ledger. Each record is numbered, so one that reached the ledger
        in a call that timed out here is not kept there twice."""
        if self._shared is None:
            return self._own.exchange_routes(ingress_id, after, records)
        dropped = max(0, len(self._unsent) + len(records) - ROUTES_KEPT)
        self._unsent.extend(records)
        self._unsent_first += dropped
        batch = list(self._unsent)
        result = await self._shared_call("exchange_routes", ingress_id, after, batch, self._unsent_first)
        if result is _UNREACHABLE:
            return after, []
        for _ in batch:  # records taken meanwhile wait for the next call
            self._unsent.popleft()
        self._unsent_first += len(batch)
        return result

    def _send(self, method: str, *args) -> None:
        if self._shared is None:
            getattr(self._own, method)(*args)
            return
        task = asyncio.get_running_loop().create_task(self._call(method, *args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        """Waits for the charges and forgets sent so far (for tests)."""
        while self._pending:
            await asyncio.gather(*list(self._pending))


__all__ = [
    "FORGET_AFTER_S", "LEDGER_TIMEOUT_S", "RETRY_AFTER_S", "ROUTES_KEPT", "IngressLedger", "LedgerClient", "LedgerHost",
]
