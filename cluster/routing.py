"""Adapter-affinity routing: rendezvous hashing of adapters over replicas, within a load bound.

Pure logic (no Ray): the Serve plugin in cluster/serve_router.py feeds it replica views.
Each adapter gets a preference order over replicas from highest-random-weight hashing: a
hot adapter spreads over its first few, and an adapter held nowhere loads on its first
among the least loaded. A replica leaving moves only the adapters homed on it. What a
replica holds comes from its periodic report, replayed forward through the requests the
router has sent it since (ResidencyEstimate), since a report is up to a stats period old.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one replica: ongoing requests and adapters it holds."""

    replica_id: str
    load: int
    resident: frozenset[str] = field(default_factory=frozenset)  # adapters in device slots
    host_cached: frozenset[str] = field(default_factory=frozenset)  # adapters in host memory


def rendezvous_score(adapter: str, replica_id: str) -> int:
    """The highest-random-weight score of ``replica_id`` for ``adapter`` (stable across processes)."""
    digest = hashlib.blake2b(f"{adapter}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(adapter: str, replica_ids: Iterable[str]) -> list[str]:
    """Replica ids in ``adapter``'s preference order: highest score first, ties by id."""
    return sorted(replica_ids, key=lambda r: (-rendezvous_score(adapter, r), r))


def load_cap(loads: Sequence[int], eps: float) -> int:
    """Bounded-load capacity: a replica may take a request while its load is below this.

    The mean counts the request being placed; the cap is (1+eps) x mean, and at least one
    above the mean so small clusters are not forced away from affinity on every request.
    """
    if not loads:
        raise ValueError(f"{loads=} must name at least one replica")
    if eps < 0:
        raise ValueError(f"{eps=} must be >= 0")
    mean = (sum(loads) + 1) / len(loads)
    return max(math.ceil((1.0 + eps) * mean), math.ceil(mean) + 1)


def route(
    adapter: str | None,
    replicas: Sequence[ReplicaView],
    *,
    homes: int = 1,
    eps: float = 0.25,
    prefix_match: dict[str, int] | None = None,
    slack: int = 0,
) -> list[str]:
    """Replica ids in the order to try for a request for ``adapter`` (None: base model).

    Under the load cap, in order: replicas holding the adapter in device slots (with a hot
    adapter's homes, ``homes > 1``), then in host memory (each least loaded first), then
    the rest, least loaded first and in the adapter's rendezvous order among equally loaded
    ones (so an idle cluster sends it to its home). A request that must load its adapter
    goes where the load is least rather than to a home: at the load bound, host caches do
    not stay split by home anyway (a holder at the cap spills its adapter's requests, each
    a copy that evicts another adapter), and loading a busier home pushes it to the cap,
    so more of its holders spill and copy. Replicas over the cap come last, least loaded
    first. Base-model requests go, under the cap, to the
    replicas that served the longest start of their prompt first (``prefix_match``: replica
    id -> blocks matched, see PrefixAffinity), then least loaded first. Within each adapter
    tier too, the replica that served the longest start of the prompt (for this adapter)
    comes first: a hot adapter's conversation stays with one of its homes. With ``slack``
    (LoadBudget.slack), a device holder up to ``slack`` over the cap comes next, least
    loaded first, before any replica that would have to load the adapter.
    """
    if not replicas:
        raise ValueError("no replicas to route to")
    if homes < 1:
        raise ValueError(f"{homes=} must be >= 1")
    if slack < 0:
        raise ValueError(f"{slack=} must be >= 0")
    ids = [r.replica_id for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError(f"replica ids must be unique, got {ids!r}")
    cap = load_cap([r.load for r in replicas], eps)
    by_load = sorted(replicas, key=lambda r: (r.load, r.replica_id))
    over = [r.replica_id for r in by_load if r.load >= cap]
    depth = prefix_match or {}
    if adapter is None:
        under = sorted((r for r in replicas if r.load < cap),
                       key=lambda r: (-depth.get(r.replica_id, 0), r.load, r.replica_id))
        return [r.replica_id for r in under] + over

    order = rendezvous_order(adapter, ids)
    rank = {rid: i for i, rid in enumerate(order)}
    under = sorted((r for r in replicas if r.load < cap),
                   key=lambda r: (-depth.get(r.replica_id, 0), r.load, rank[r.replica_id]))
    # A hot adapter's homes rank with its device holders, so its load spreads over them.
    spread = set(order[:homes]) if homes > 1 else set()
    tiers = (
        [r.replica_id for r in under if adapter in r.resident or r.replica_id in spread],
        [r.replica_id for r in by_load if adapter in r.resident and cap <= r.load < cap + slack],
        [r.replica_id for r in under if adapter in r.host_cached],
        [r.replica_id for r in under],
    )
    chosen: list[str] = []
    seen: set[str] = set()
    for tier in tiers:
        for rid in tier:
            if rid not in seen:
                seen.add(rid)
                chosen.append(rid)
    return chosen + [rid for rid in over if rid not in seen]


class LoadBudget:
    """The recent mean of max/mean load over the replicas, and whether it leaves room for a
    device holder to take a request over the load cap.

    The cap counts whole requests, so it is coarse: with 4 replicas and 16 requests in
    flight it is 5 (1.25 x the mean), and one more would be 1.5. A holder at the cap turns
    its adapter's requests away, each a slot miss elsewhere (and often a second copy that
    evicts another adapter), while the cluster also spends moments evenly loaded (max/mean
    1.0): under a hard cap the mean of max/mean sits below the bound. The budget spends
    that gap on hits. While the decayed mean of max/mean, taken after each placement, is
    under ``bound - margin``, ``slack()`` is 1 (route lets a holder take one over the cap);
    after, 0. So the bound holds on average over about ``half_life`` routes rather than at
    every moment: a replica may hold one request over the cap for a while. Misses never go
    over the cap, so they cannot spend it. The mean swings about its target by a little
    within a half-life (the margin keeps it under the bound).
    """

    def __init__(self, *, bound: float, half_life: float = 200.0, margin: float = 0.01):
        if bound < 1.0:
            raise ValueError(f"{bound=} must be >= 1 (max/mean load is never below 1)")
        if half_life <= 0:
            raise ValueError(f"{half_life=} must be > 0")
        if margin < 0:
            raise ValueError(f"{margin=} must be >= 0")
        self.bound = bound
        self.margin = margin
        self._keep = 0.5 ** (1.0 / half_life)
        self._mean = 1.0  # an idle cluster is balanced

    @property
    def mean(self) -> float:
        """The decayed mean of max/mean load over the placements recorded."""
        return self._mean

    def record(self, loads: Sequence[int]) -> None:
        """Counts the replicas' loads just after a placement (that request included)."""
        total = sum(loads)
        if total > 0:
            ratio = max(loads) * len(loads) / total
            self._mean = self._keep * self._mean + (1.0 - self._keep) * ratio

    def slack(self) -> int:
        """How far over the load cap a device holder may take a request now (0 or 1)."""
        return 1 if self._mean < self.bound - self.margin else 0


# Where a routed request went, by what the router knew of the replicas then (routing_outcome).
ROUTING_OUTCOMES: tuple[str, ...] = ("resident", "host", "placed", "off_holder", "base")


def routing_outcome(adapter: str | None, chosen: ReplicaView, replicas: Sequence[ReplicaView]) -> str:
    """Where a request went: "resident" (the replica it went to held ``adapter`` in device
    slots), "host" (in its host cache only), "off_holder" (it held it nowhere while another
    replica held it, in slots or host cache: the load bound, or a hot adapter's extra home,
    sent it there), "placed" (no replica held it), "base" (no adapter)."""
    if adapter is None:
        return "base"
    if adapter in chosen.resident:
        return "resident"
    if adapter in chosen.host_cached:
        return "host"
    if any(adapter in r.resident or adapter in r.host_cached for r in replicas):
        return "off_holder"
    return "placed"


class HotAdapterTracker:
    """Decayed per-adapter request rates, and how many homes each adapter gets.

    An adapter whose recent rate exceeds ``hot_rate`` (requests/s) gets
    ``ceil(rate / hot_rate)`` homes, at most ``max_homes``, so its load spreads over the
    first few replicas of its rendezvous order rather than all of them.
    """

    def __init__(
        self,
        *,
        hot_rate: float,
        max_homes: int,
        half_life_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if hot_rate <= 0:
            raise ValueError(f"{hot_rate=} must be > 0")
        if max_homes < 1:
            raise ValueError(f"{max_homes=} must be >= 1")
        if half_life_s <= 0:
            raise ValueError(f"{half_life_s=} must be > 0")
        self.hot_rate = hot_rate
        self.max_homes = max_homes
        self._tau = half_life_s / math.log(2.0)
        self._clock = clock
        self._rates: dict[str, tuple[float, float]] = {}  # adapter -> (rate, as of time)

    def _decayed(self, adapter: str, now: float) -> float:
        rate, t = self._rates.get(adapter, (0.0, now))
        return rate * math.exp(-(now - t) / self._tau)

    def record(self, adapter: str) -> None:
        """Counts one request for ``adapter`` now."""
        now = self._clock()
        # An exponentially weighted rate: each request adds 1/tau, so a steady stream of
        # r requests/s converges to r.
        self._rates[adapter] = (self._decayed(adapter, now) + 1.0 / self._tau, now)
        self._forget(now)

    def rate(self, adapter: str) -> float:
        """The adapter's recent request rate, requests per second."""
        return self._decayed(adapter, self._clock())

    def homes(self, adapter: str, num_replicas: int) -> int:
        """How many replicas serve as homes for ``adapter`` (1 unless it is hot)."""
        k = max(1, math.ceil(self.rate(adapter) / self.hot_rate))
        return max(1, min(k, self.max_homes, num_replicas))

    def _forget(self, now: float) -> None:
        # Bound memory: drop adapters whose rate has decayed to nothing.
        if len(self._rates) > 4096:
            for name in [a for a in self._rates if self._decayed(a, now) < 1e-3]:
                del self._rates[name]


@dataclass(frozen=True)
class HeldReport:
    """What a replica last said it holds of one kind (its device slots, or its host cache)."""

    names: tuple[str, ...]  # in eviction order: the first leaves first
    capacity: int | None = None  # how many it has room for (None: not known)
    as_of: float | None = None  # when the replica took it (time.time()); None: not known
    # Least-used eviction (lora_runtime/lora/eviction.py): each name's decayed use count, and
    # the half-life of a count in uses of the whole pool. None: least recently used leaves first.
    scores: tuple[float, ...] | None = None
    half_life: float | None = None

    def __post_init__(self):
        if self.capacity is not None and self.capacity < 0:
            raise ValueError(f"capacity={self.capacity} must be >= 0")
        if self.scores is not None and (len(self.scores) != len(self.names) or not self.half_life
                                        or self.half_life <= 0):
            raise ValueError(f"{len(self.names)} names need as many scores (got "
                             f"{len(self.scores)}) and a half_life > 0 (got {self.half_life})")


class _Shadow:
    """A replica's slots or host cache as this router models them: the report, then each
    request this router sent there since, evicting as the replica does."""

    def __init__(self, report: HeldReport):
        self.capacity = report.capacity
        self._rate = math.log(2.0) / report.half_life if report.scores is not None else 0.0
        self.step = 0
        # name -> (decayed uses as of `at`, at, last use); reported names used "before" any send
        self.held: dict[str, tuple[float, int, int]] = {
            name: (report.scores[i] if report.scores is not None else 0.0, 0, i - len(report.names))
            for i, name in enumerate(report.names)}
        while self.capacity is not None and len(self.held) > self.capacity:
            self._evict()

    def _score(self, name: str) -> float:
        value, at, _ = self.held[name]
        return value * math.exp(-self._rate * (self.step - at))

    def _evict(self) -> None:
        del self.held[min(self.held, key=lambda n: (self._score(n), self.held[n][2]))]

    def use(self, name: str) -> bool:
        """Counts a request for ``name``; returns whether it was not held (a load)."""
        self.step += 1
        missed = name not in self.held
        if not missed:
            score = self._score(name)
        else:
            if self.capacity is not None and len(self.held) >= self.capacity:
                if self.capacity == 0:
                    return True
                self._evict()
            score = 0.0
        self.held[name] = (score + 1.0, self.step, self.step)
        return missed


class ResidencyEstimate:
    """What one router believes each replica holds: the replica's last report, replayed
    forward through the requests this router has sent it since.

    Reports come once a stats period and arrive later still, so one can miss an adapter
    this router sent there a moment ago, and still show one that sending others there has
    evicted since. Each request this router sends is logged with its time; a report says
    when it was taken (``as_of``), so the sends after it are applied to it with the
    replica's own eviction: least used lately for device slots (the report carries the use
    counts), least recently loaded for the host cache (only a send that loads a slot reads
    it, see ``held``). Sends within ``skew_s`` before a report count as after it (still in
    flight when it was taken, or clocks apart). A report without a time is taken as
    ``horizon_s`` old. Other routers' sends (other ingress
    replicas') are known as they pass them on, with their times, a moment late: each is
    applied after the sends logged before it arrived, and not at all if the replica's
    report is newer than it; one that arrives more than ``late_s`` after it was sent is
    dropped (a report has shown it by then).
    """

    def __init__(self, *, horizon_s: float, skew_s: float = 0.1, clock: Callable[[], float] = time.time,
                 per_replica: int = 1024, late_s: float = 5.0):
        if horizon_s < 0:
            raise ValueError(f"{horizon_s=} must be >= 0")
        if skew_s < 0:
            raise ValueError(f"{skew_s=} must be >= 0")
        if per_replica < 1:
            raise ValueError(f"{per_replica=} must be >= 1")
        if late_s < 0:
            raise ValueError(f"{late_s=} must be >= 0")
        self.horizon_s = horizon_s
        self.skew_s = skew_s
        self.late_s = late_s
        self._clock = clock
        self._per_replica = per_replica
        self._sent: dict[str, deque[tuple[int, float, str]]] = {}  # replica -> (number, time, adapter)
        self._count = 0
        # (replica, kind) -> (the report it was built from, its shadow, next send number to apply)
        self._shadows: dict[tuple[str, str], tuple[HeldReport, _Shadow, int]] = {}

    def record(self, replica_id: str, adapter: str, at: float | None = None) -> None:
        """A request for ``adapter`` went to ``replica_id``: from this router now, or from
        another at time ``at`` (this router's clock, time.time())."""
        now = self._clock()
        if at is not None and at < now - self.late_s:
            return
        sent = self._sent.setdefault(replica_id, deque(maxlen=self._per_replica))
        sent.append((self._count, now if at is None else at, adapter))
        self._count += 1

    def held(self, replica_id: str, report: HeldReport, kind: str = "slots",
             slots: HeldReport | None = None) -> frozenset[str]:
        """The adapters ``replica_id`` likely holds of ``kind`` (its slots, its host cache),
        given its last ``report`` of them. ``slots``: for the host cache, the replica's report
        of its slots: a replica reads its host cache only to load a slot
        (lora_runtime/lora/manager.py), so a send whose adapter the slots hold then (replayed
        alongside) leaves the host cache as it is."""
        sent = self._sent.get(replica_id, ())
        key = (replica_id, kind)
        cached = self._shadows.get(key)
        if report.as_of is None:  # its age unknown: as old as the horizon, rebuilt each time
            since = self._clock() - self.horizon_s
            shadow, gate, start = _Shadow(report), None if slots is None else _Shadow(slots), None
        elif cached is not None and cached[0] == report and cached[1] == slots:  # sends applied up to `start`
            since, (_, _, shadow, gate, start) = report.as_of - self.skew_s, cached
        else:
            since = report.as_of - self.skew_s
            shadow, gate, start = _Shadow(report), None if slots is None else _Shadow(slots), None
        new = []  # the sends to apply, newest logged first: the log's tail, less what the report has seen
        for number, t, adapter in reversed(sent):
            # Another router's send is logged up to late_s after it was sent, after newer ones:
            # once a send is that much older than the report, every one logged before it is too.
            if (start is not None and number < start) or t < since - self.late_s:
                break
            if t >= since:
                new.append(adapter)
        for adapter in reversed(new):
            if gate is None or gate.use(adapter):
                shadow.use(adapter)
        if report.as_of is not None:
            self._shadows[key] = (report, slots, shadow, gate, self._count)
        return frozenset(shadow.held)

    def forget_others(self, replica_ids: Iterable[str]) -> None:
        """Drops the history of replicas not in ``replica_ids`` (they left)."""
        keep = set(replica_ids)
        for rid in [r for r in self._sent if r not in keep]:
            del self._sent[rid]
        for key in [k for k in self._shadows if k[0] not in keep]:
            del self._shadows[key]


def prompt_text(payload: dict, adapter: str = "") -> str:
    """The text a request's prompt starts with, as prefix routing compares prompts: the
    adapter (its K/V differ from another's for the same tokens), then a completion's prompt
    (token ids as text), or a chat's messages in order."""
    if payload.get("kind") == "chat":
        text = "".join(f"\x00{m.get('role')}\x00{m.get('content')}" for m in payload.get("messages") or ())
    else:
        prompt = payload.get("prompt")
        text = " ".join(map(str, prompt)) if isinstance(prompt, list) else prompt if isinstance(prompt, str) else ""
    return f"{adapter}\x01{text}" if adapter else text


class InFlight:
    """Requests in flight at each replica, as the load bound counts them.

    Serve's cached queue length of a replica is the replica's own count as of its answer to
    the router's last send there, moved by one for each send and completion since. It stays
    high after a burst: a completion applied before the answer that still counted it leaves
    the request counted until the entry times out (10 s), and a replica that looks over the
    bound is sent nothing that would correct it. So the router counts its own requests in
    flight exactly (``sent``/``done``: Serve's on_send_request, which it calls before it could
    learn of the call's end, and on_request_completed, which it calls once for every call
    sent, refused or not), hears the other ingress replicas' counts through the
    ingress ledger (``heard``, half a second late), and takes as a replica's load the lesser
    of the two (``load``): Serve's count still covers callers that share nothing.
    """

    def __init__(self, *, horizon_s: float = 3.0, clock: Callable[[], float] = time.time):
        """``horizon_s``: how long another router's count stands without a newer one (it
        sends one twice a second while its ingress replica runs)."""
        if horizon_s <= 0:
            raise ValueError(f"{horizon_s=} must be > 0")
        self.horizon_s = horizon_s
        self._clock = clock
        self._mine: dict[str, int] = {}  # replica id -> this router's calls in flight there
        self._others: dict[str, tuple[dict[str, int], float]] = {}  # router -> (its counts, when sent)

    def sent(self, replica_id: str) -> None:
        """A call went to ``replica_id`` (whether the replica then takes it or not)."""
        self._mine[replica_id] = self._mine.get(replica_id, 0) + 1

    def done(self, replica_id: str) -> None:
        """A call ``sent`` there finished, whatever its outcome (a refusal included)."""
        left = self._mine.get(replica_id, 0) - 1
        if left > 0:
            self._mine[replica_id] = left
        else:
            self._mine.pop(replica_id, None)

    def mine(self) -> dict[str, int]:
        """This router's calls in flight by replica (a copy: another thread shares it)."""
        return self._mine.copy()

    def heard(self, router: str, counts: dict[str, int], at: float) -> None:
        """Another router's ``mine()``, taken at ``at`` (its clock, time.time())."""
        held = self._others.get(router)
        if held is None or at >= held[1]:
            self._others[router] = (dict(counts), at)

    def forget_others(self, live: Iterable[str]) -> None:
        """Drops what is counted at replicas not in ``live`` (they stopped)."""
        live = set(live)
        for rid in [r for r in self._mine if r not in live]:
            del self._mine[rid]

    def load(self, replica_id: str, cached: int | None) -> int:
        """``replica_id``'s load: this router's calls in flight there plus the other routers'
        recent counts, or Serve's cached queue length ``cached`` where that is less (None:
        Serve holds none)."""
        now = self._clock()
        for router in [r for r, (_, at) in self._others.items() if now - at > self.horizon_s]:
            del self._others[router]  # its ingress replica stopped, or cannot reach the ledger
        counted = self._mine.get(replica_id, 0) + sum(c.get(replica_id, 0) for c, _ in self._others.values())
        return counted if cached is None else min(counted, cached)


class PrefixAffinity:
    """Which replicas recently served prompts starting with which text, so that a prompt
    goes where its start is likely in the prefix cache.

    Prompts are cut into blocks of ``block`` characters; block i is keyed by a hash of the
    whole text up to its end, so a key names a prefix, not a block. Each key remembers the
    replicas that served it; about ``capacity`` keys are kept, least recently used dropped.
    """

    def __init__(self, *, block: int = 64, max_blocks: int = 128, capacity: int = 50_000):
        if block < 1 or max_blocks < 1 or capacity < 1:
            raise ValueError(f"{block=}, {max_blocks=} and {capacity=} must all be >= 1")
        self.block = block
        self.max_blocks = max_blocks
        self.capacity = capacity  # about 190 bytes each: 50 000 keys take about 10 MB
        self._owners: dict[int, tuple[str, ...]] = {}  # oldest use first (reinserted when used)

    def _keys(self, text: str) -> list[int]:
        h = hashlib.blake2b(digest_size=8)
        keys = []
        for i in range(min(len(text) // self.block, self.max_blocks)):
            h.update(text[i * self.block : (i + 1) * self.block].encode("utf-8", "surrogatepass"))
            keys.append(int.from_bytes(h.copy().digest(), "big"))
        return keys

    def match(self, text: str) -> dict[str, int]:
        """For each replica that served a start of ``text``: how many blocks of it."""
        depth: dict[str, int] = {}
        for i, key in enumerate(self._keys(text), start=1):
            owners = self._owners.get(key)
            if not owners:
                break
            for replica_id in owners:
                depth[replica_id] = i
        return depth

    def record(self, text: str, replica_id: str) -> tuple[int, ...]:
        """``replica_id`` was sent a request whose prompt is ``text``; returns the prompt's
        keys (``record_keys`` records them in another PrefixAffinity)."""
        keys = tuple(self._keys(text))
        self.record_keys(keys, replica_id)
        return keys

    def record_keys(self, keys: Iterable[int], replica_id: str) -> None:
        """``replica_id`` was sent a request whose prompt has ``keys`` (as ``record`` returned
        them: another router's send)."""
        for key in keys:
            owners = self._owners.pop(key, ())
            self._owners[key] = owners if replica_id in owners else (*owners, replica_id)
        if len(self._owners) > self.capacity + self.capacity // 8:
            # Keep the most recently used `capacity` (at once: amortized O(1) per key).
            drop = len(self._owners) - self.capacity
            self._owners = dict(itertools.islice(self._owners.items(), drop, None))


__all__ = [
    "HeldReport",
    "HotAdapterTracker",
    "InFlight",
    "LoadBudget",
    "PrefixAffinity",
    "ROUTING_OUTCOMES",
    "ReplicaView",
    "ResidencyEstimate",
    "load_cap",
    "prompt_text",
    "rendezvous_order",
    "rendezvous_score",
    "route",
    "routing_outcome",
]
