"""AdapterAffinityRouter: the Serve RequestRouter plugin that applies cluster/routing.py.

Replicas publish the adapters they hold and their metrics through ``record_routing_stats``
(``{"resident": [...], "host_cached": [...], "slots": n, "host_slots": m, "metrics": {...}}``),
which Serve delivers once a stats period; the router corrects that report with where it
has sent requests since (ResidencyEstimate), ranks replicas for each request by device
holders, host holders, then the least loaded (the adapter's rendezvous order among equals),
within a load bound, and keeps the metrics for the ingress's ``GET /metrics``.
"""

from __future__ import annotations

import importlib
import threading
import time
import uuid
import weakref
from collections import Counter, deque

from ray.serve._private.request_router.pow_2_router import (
    PowerOfTwoChoicesRequestRouter,
)
from ray.serve.request_router import FIFOMixin, MultiplexMixin, PendingRequest, RequestRouter, RunningReplica

from cluster.routing import (
    HeldReport, HotAdapterTracker, InFlight, LoadBudget, PrefixAffinity, ReplicaView, ResidencyEstimate, prompt_text,
    route, routing_outcome,
)

# (app, deployment) -> replica id -> the report that replica last published: {"as_of": its
# time.time() or None, "metrics": its snapshot}. The router lives in the caller's process
# (the ingress), so /metrics there reads it directly.
_REPLICA_METRICS: dict[tuple[str, str], dict[str, dict]] = {}
# (app, deployment) -> routing outcome (cluster.routing.ROUTING_OUTCOMES) -> requests, as
# the routers in this process routed them.
_ROUTING_OUTCOMES: dict[tuple[str, str], Counter] = {}


# (app, deployment) -> the routing records the routers in this process made since the
# ingress last took them, for the other ingress replicas; kept only for deployments whose
# ingress shares them (share_routes), at most ROUTES_HELD. A record is a plain tuple (the
# ledger keeps them as they are):
#   ("prefix", prompt keys, replica id): a prompt went there (PrefixAffinity's block keys);
#   ("adapter", replica id, adapter, time.time() when sent): a request for the adapter went there;
#   ("inflight", this process's token, replica id -> calls in flight, time.time()): added by
#   take_routes, the load this process's routers have at each replica (InFlight).
_ROUTES_OUT: dict[tuple[str, str], deque] = {}
# (app, deployment) -> the affinity routers of this process (each applies the other ingress
# replicas' records given to it before it next routes).
_ROUTERS: dict[tuple[str, str], weakref.WeakSet] = {}
_ROUTERS_LOCK = threading.Lock()  # routers join on their thread, give_routes reads on the ingress's
ROUTES_HELD = 4096
# Names this process's routers in the records it shares.
_PROCESS_TOKEN = uuid.uuid4().hex

# The model server's method that generates (the requests whose routing outcomes count).
_INFERENCE_METHOD = "generate"


def _module():
    # Serve ships the router class inside the deployment config pickled by value, so its
    # methods see their own copy of this module's globals: reach the imported module.
    return importlib.import_module("cluster.serve_router")


def _store() -> dict[tuple[str, str], dict[str, dict]]:
    return _module()._REPLICA_METRICS


def replica_reports(app: str, deployment: str) -> dict[str, dict]:
    """The latest report of each running replica of ``deployment`` in ``app``, as routers in
    this process last saw them: ``{"as_of": when the replica took it (time.time(); None: not
    known), "metrics": its ReplicaMetrics snapshot}``."""
    return dict(_store().get((app, deployment), {}))


def routing_outcomes(app: str, deployment: str) -> dict[str, int]:
    """Requests the routers in this process sent to ``deployment`` in ``app``, by outcome
    (cluster.routing.routing_outcome)."""
    return dict(_module()._ROUTING_OUTCOMES.get((app, deployment), {}))


def share_routes(app: str, deployment: str) -> None:
    """From now on the routers of ``deployment`` keep their routing records (which prompts
    and adapters they sent where) for take_routes; the ingress passes them to its other
    replicas through the ledger."""
    _module()._ROUTES_OUT.setdefault((app, deployment), deque(maxlen=ROUTES_HELD))


def take_routes(app: str, deployment: str) -> list[tuple]:
    """The routing records (see _ROUTES_OUT) this process's routers made since the last
    call, oldest first, then what this process's routers have in flight at each replica
    (share_routes must have been called)."""
    module = _module()
    out = module._ROUTES_OUT[app, deployment]
    taken = []
    while out:  # the routers append meanwhile, on their own thread
        taken.append(out.popleft())
    with module._ROUTERS_LOCK:
        routers = list(module._ROUTERS.get((app, deployment), ()))
    if routers:
        in_flight = Counter()
        for router in routers:
            in_flight.update(router._in_flight.mine())
        taken.append(("inflight", module._PROCESS_TOKEN, dict(in_flight), time.time()))
    return taken


def give_routes(app: str, deployment: str, records: list) -> None:
    """Routing records of the other ingress replicas' routers (as take_routes returns them
    there): each router of ``deployment`` here applies them before it next routes."""
    module = _module()
    with module._ROUTERS_LOCK:
        routers = list(module._ROUTERS.get((app, deployment), ()))
    for router in routers:
        router._routes_in.extend(records)


def routing_stats(adapters: list[dict], metrics: dict, *, slots: int, host_slots: int,
                  residency: dict | None = None, as_of: float | None = None) -> dict:
    """The stats a replica publishes: adapters it holds (``LoRAManager.list_adapters()``
    rows; in eviction order with their use counts where ``residency``, its
    ``LoRAManager.residency()``, is given), how many it has device slots and host-cache
    entries for, when it took them (``as_of``, time.time(); None: not known) and its
    ``ReplicaMetrics.snapshot()``."""
    if residency is None:
        residency = {"resident": sorted(a["name"] for a in adapters if a["slot"] is not None),
                     "host_cached": sorted(a["name"] for a in adapters if a["host_cached"])}
    return {**residency, "slots": slots, "host_slots": host_slots, "as_of": as_of, "metrics": metrics}


class ReplicaMetricsMixin:
    """Keeps each replica's published metrics snapshot where the ingress can read it, and
    counts where each routed request went (cluster.routing.routing_outcome) by what the
    router knew: the replicas' reports replayed forward through its sends (``_residency``,
    which the router's ``initialize_state`` makes)."""

    _residency: ResidencyEstimate

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._residency.forget_others(r.replica_id.unique_id for r in replicas)
        _store()[self._deployment_id.app_name, self._deployment_id.name] = {
            r.replica_id.unique_id: {"as_of": r.routing_stats.get("as_of"), "metrics": r.routing_stats["metrics"]}
            for r in replicas
            if "metrics" in (r.routing_stats or {})
        }

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        # Counted once per routed request (choose_replicas may run again on a retry).
        adapter = pending_request.metadata.multiplexed_model_id or None
        rid = replica_id.unique_id
        if pending_request.metadata.call_method == _INFERENCE_METHOD:  # not tokenizer or health calls
            views = [replica_view(r, 0, self._residency) for r in self._replicas.values()]
            chosen = next((v for v in views if v.replica_id == rid), None)
            if chosen is not None:  # not one a replica update removed meanwhile
                key = (self._deployment_id.app_name, self._deployment_id.name)
                outcomes = _module()._ROUTING_OUTCOMES.setdefault(key, Counter())
                outcomes[routing_outcome(adapter, chosen, views)] += 1
        if adapter is not None:
            self._residency.record(rid, adapter)
        super().on_request_routed(pending_request, replica_id, result)


def replica_view(replica: RunningReplica, load: int, residency: ResidencyEstimate) -> ReplicaView:
    """What routing needs of a Serve replica: its id, load and the adapters it likely holds
    (its last report, replayed forward by ``residency``, this router's sends since)."""
    rid = replica.replica_id.unique_id
    stats = replica.routing_stats or {}
    as_of = stats.get("as_of")
    resident = tuple(stats.get("resident", ()))
    scores = stats.get("resident_scores")
    if scores is None or len(scores) != len(resident):  # no counts: least recently used first
        slots = HeldReport(resident, stats.get("slots"), as_of)
    else:
        slots = HeldReport(resident, stats.get("slots"), as_of, tuple(scores), stats.get("half_life"))
    # Serve's multiplexed ids are adapters this replica has served lately: at least host-warm
    # (where the report leaves them out, they count as the oldest entries).
    host_names = tuple(stats.get("host_cached", ()))
    seen = set(host_names)
    host_names = tuple(sorted(m for m in replica.multiplexed_model_ids if m not in seen)) + host_names
    return ReplicaView(
        replica_id=rid,
        load=load,
        resident=residency.held(rid, slots, "slots"),
        host_cached=residency.held(rid, HeldReport(host_names, stats.get("host_slots"), as_of), "host", slots=slots),
    )


def _prompt_of(pending_request: PendingRequest | None) -> str:
    """The prompt a request to a replica's ``generate`` carries, keyed by its adapter; ""
    for other calls (they take keyword arguments and fill no prefix cache)."""
    if pending_request is None or not pending_request.args or not isinstance(pending_request.args[0], dict):
        return ""
    return prompt_text(pending_request.args[0], pending_request.metadata.multiplexed_model_id)


class AdapterAffinityRouter(ReplicaMetricsMixin, FIFOMixin, MultiplexMixin, RequestRouter):
    """Routes each adapter to a replica that holds it, else the least loaded, within a load bound.

    Base-model requests go to the replica that was sent the longest start of their prompt
    (so likely holds it in its prefix cache), within the same bound, else the least loaded;
    adapter requests prefer it among equally good holders (a hot adapter's homes). With
    several ingress replicas, what the other replicas' routers sent where reaches this one
    through the ingress ledger (share_routes, take_routes, give_routes), half a second late:
    a conversation's next turn finds its replica whichever ingress replica takes it, each
    router's view of which adapters the replicas hold includes the others' sends, and an
    adapter is hot by the requests of every ingress replica, not one's share.

    A replica's load under the bound is what this router has in flight there plus what the
    other ingress replicas last said they have, or Serve's cached queue length where that is
    less (cluster.routing.InFlight says why Serve's alone would not do). The bound is soft:
    a holder of the adapter may take a request one over it while the recent mean of max/mean
    load is under 1 + eps (cluster.routing.LoadBudget).

    A replica found for a request goes to the oldest pending request for the same adapter,
    else the oldest pending request (FIFOMixin, as Serve's default router). The base
    router would match only the exact request, by an internal id that the calls of one
    HTTP request share (its n choices): the others would never be handed a replica.
    """

    def initialize_state(
        self,
        eps: float = 0.25,
        hot_rate: float = 20.0,
        max_homes: int = 2,
        half_life_s: float = 10.0,
        residency_horizon_s: float = 2.0,
        budget_half_life: float = 200.0,
    ) -> None:
        """``residency_horizon_s``: how long a request this router sent counts as making its
        adapter held there without a report showing it (about two stats periods).
        ``budget_half_life``: over how many routes the mean of max/mean load is held under
        1 + eps (cluster.routing.LoadBudget)."""
        if eps < 0:
            raise ValueError(f"{eps=} must be >= 0")
        self._eps = eps
        self._hot = HotAdapterTracker(hot_rate=hot_rate, max_homes=max_homes, half_life_s=half_life_s)
        self._prefixes = PrefixAffinity()
        self._residency = ResidencyEstimate(horizon_s=residency_horizon_s)
        self._in_flight = InFlight()  # the load the bound counts
        # The bound holds on average over about 10 s of routes at 20 a second (LoadBudget).
        self._budget = LoadBudget(bound=1.0 + eps, half_life=budget_half_life)
        self._loads_seen: dict[str, int] = {}  # replica id -> load, as the last choice saw them
        # Other ingress replicas' routing records (give_routes), for this router's thread to apply.
        self._routes_in: deque = deque(maxlen=ROUTES_HELD)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        # Known to give_routes from its first replicas on (it routes nothing before).
        key, module = (self._deployment_id.app_name, self._deployment_id.name), _module()
        with module._ROUTERS_LOCK:
            module._ROUTERS.setdefault(key, weakref.WeakSet()).add(self)
        super().update_replicas(replicas)
        self._in_flight.forget_others(r.replica_id.unique_id for r in replicas)

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        adapter = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self._apply_routes_in()
        views = [
            replica_view(r, self._in_flight.load(r.replica_id.unique_id, self._replica_queue_len_cache.get(r.replica_id)),
                         self._residency)
            for r in candidate_replicas
        ]
        homes = self._hot.homes(adapter, len(views)) if adapter else 1
        match = self._prefixes.match(_prompt_of(pending_request))
        order = route(adapter or None, views, homes=homes, eps=self._eps, prefix_match=match,
                      slack=self._budget.slack())
        self._loads_seen = {v.replica_id: v.load for v in views}  # for the budget, once routed
        if pending_request is not None:
            # Every replica is ranked on every attempt, so when none can take the request
            # now Serve must back off before asking again; without this it re-asks at once,
            # spinning the caller's event loop until its queue-length probes time out.
            pending_request.routing_context.should_backoff = True
        # One replica per rank: Serve tries them in order, skipping full ones.
        return [[by_id[rid]] for rid in order]

    def _apply_routes_in(self) -> None:
        """Applies the other ingress replicas' records given since (give_routes): their
        prompts to prefix affinity, their adapter sends to the residency estimate (replicas
        this router knows of) and to the adapters' rates."""
        if not self._routes_in:
            return
        known = {r.replica_id.unique_id for r in self._replicas.values()}
        while self._routes_in:
            record = self._routes_in.popleft()
            if record[0] == "prefix":
                self._prefixes.record_keys(record[1], record[2])
            elif record[0] == "adapter":
                _, rid, adapter, sent_at = record
                self._hot.record(adapter)
                if rid in known:
                    self._residency.record(rid, adapter, at=sent_at)
            elif record[0] == "inflight":
                _, token, counts, at = record
                self._in_flight.heard(token, counts, at)

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        # Counted once per routed request (choose_replicas may run again on a retry).
        adapter = pending_request.metadata.multiplexed_model_id
        rid = replica_id.unique_id
        if adapter:
            self._hot.record(adapter)
        if rid in self._loads_seen:  # the loads it was routed by, with it placed
            self._budget.record([load + (r == rid) for r, load in self._loads_seen.items()])
        keys = self._prefixes.record(_prompt_of(pending_request), rid)
        out = _module()._ROUTES_OUT.get((self._deployment_id.app_name, self._deployment_id.name))
        if out is not None:
            if keys:
                out.append(("prefix", keys, rid))
            if adapter:
                out.append(("adapter", rid, adapter, time.time()))
        super().on_request_routed(pending_request, replica_id, result)  # outcome, then residency

    def on_send_request(self, replica_id) -> None:
        self._in_flight.sent(replica_id.unique_id)
        super().on_send_request(replica_id)

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self._in_flight.done(replica_id.unique_id)
        super().on_request_completed(replica_id, internal_request_id)


class MultiplexMetricsRouter(ReplicaMetricsMixin, PowerOfTwoChoicesRequestRouter):
    """Serve's default multiplex-aware router, with replica metrics kept for /metrics and its
    routing outcomes counted as the affinity router's are."""

    def initialize_state(self, residency_horizon_s: float = 2.0) -> None:
        super().initialize_state()
        self._residency = ResidencyEstimate(horizon_s=residency_horizon_s)


__all__ = [
    "AdapterAffinityRouter",
    "MultiplexMetricsRouter",
    "ROUTES_HELD",
    "ReplicaMetricsMixin",
    "give_routes",
    "replica_reports",
    "replica_view",
    "routing_outcomes",
    "routing_stats",
    "share_routes",
    "take_routes",
]
