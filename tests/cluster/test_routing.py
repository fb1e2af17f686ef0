"""Adapter-affinity routing: rendezvous order, load bound, hot-adapter homes, churn, residency
estimates from stale reports, and the Serve RequestRouter plugin driven through Serve's own
routing loop."""

import asyncio
import time

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    RequestMetadata,
)
from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.test_utils import FakeRunningReplica

from cluster.routing import (
    HeldReport,
    HotAdapterTracker,
    InFlight,
    LoadBudget,
    PrefixAffinity,
    ReplicaView,
    ResidencyEstimate,
    load_cap,
    prompt_text,
    rendezvous_order,
    route,
    routing_outcome,
)
from cluster.serve_router import (
    AdapterAffinityRouter,
    MultiplexMetricsRouter,
    give_routes,
    replica_reports,
    replica_view,
    routing_outcomes,
    routing_stats as _routing_stats,
    share_routes,
    take_routes,
)

IDS = [f"replica-{i}" for i in range(5)]


def views(loads=None, resident=None, host=None):
    loads = loads or {}
    resident = resident or {}
    host = host or {}
    return [
        ReplicaView(r, loads.get(r, 0), frozenset(resident.get(r, ())), frozenset(host.get(r, ())))
        for r in IDS
    ]


def test_rendezvous_order_is_a_stable_permutation():
    order = rendezvous_order("a1", IDS)
    assert sorted(order) == sorted(IDS)
    assert rendezvous_order("a1", reversed(IDS)) == order
    # Different adapters get different homes: over many adapters every replica is a home.
    firsts = {rendezvous_order(f"adapter-{i}", IDS)[0] for i in range(200)}
    assert firsts == set(IDS)


def test_homes_are_balanced_over_replicas():
    counts = {r: 0 for r in IDS}
    for i in range(2000):
        counts[rendezvous_order(f"adapter-{i}", IDS)[0]] += 1
    assert max(counts.values()) < 1.25 * 2000 / len(IDS)


def test_churn_moves_only_the_keys_homed_on_the_leaving_replica():
    adapters = [f"adapter-{i}" for i in range(500)]
    before = {a: rendezvous_order(a, IDS)[0] for a in adapters}
    gone = "replica-2"
    after = {a: rendezvous_order(a, [r for r in IDS if r != gone])[0] for a in adapters}
    moved = {a for a in adapters if before[a] != after[a]}
    assert moved == {a for a in adapters if before[a] == gone}
    # Those that moved go to their second choice.
    assert all(after[a] == rendezvous_order(a, IDS)[1] for a in moved)
    # A replica joining takes only keys onto itself.
    grown = IDS + ["replica-5"]
    joined = {a: rendezvous_order(a, grown)[0] for a in adapters}
    assert all(joined[a] in (before[a], "replica-5") for a in adapters)
    assert 0 < sum(joined[a] == "replica-5" for a in adapters) < 150


def test_load_cap():
    assert load_cap([0, 0], 0.25) == 2  # mean 0.5: one replica may be a request ahead
    assert load_cap([4, 4, 4, 4], 0.5) == 7  # mean 4.25 -> ceil(6.375)
    assert load_cap([4, 4, 4, 4], 0.0) == 6  # at least one above the mean, rounded up
    with pytest.raises(ValueError, match="eps=-0.1"):
        load_cap([1], -0.1)
    with pytest.raises(ValueError, match="loads=\\[\\]"):
        load_cap([], 0.1)


def test_unloaded_cluster_sends_adapter_to_its_rendezvous_home():
    home = rendezvous_order("a1", IDS)[0]
    assert route("a1", views())[0] == home
    # Full preference lists the whole rendezvous order when all loads are equal.
    assert route("a1", views()) == rendezvous_order("a1", IDS)


def test_device_holder_beats_home_and_host_cache():
    order = rendezvous_order("a1", IDS)
    holder, cached = order[3], order[2]
    got = route("a1", views(resident={holder: ["a1"]}, host={cached: ["a1"]}))
    assert got[:3] == [holder, cached, order[0]]


def test_least_loaded_device_holder_is_chosen():
    order = rendezvous_order("a1", IDS)
    loads = {r: 2 for r in IDS} | {order[1]: 3}
    got = route("a1", views(loads=loads, resident={order[1]: ["a1"], order[2]: ["a1"]}))
    assert got[0] == order[2]


def test_overloaded_home_is_skipped_for_the_next_in_order():
    order = rendezvous_order("a1", IDS)
    loads = {order[0]: 10, order[1]: 1, order[2]: 1, order[3]: 1, order[4]: 1}
    got = route("a1", views(loads=loads, resident={order[0]: ["a1"]}))
    assert got[0] == order[1]
    assert got[-1] == order[0]  # over the cap: last resort only


def test_adapter_held_nowhere_goes_to_the_least_loaded_replica_its_home_first_among_equals():
    order = rendezvous_order("a1", IDS)
    loads = {order[0]: 2, order[1]: 1, order[2]: 1, order[3]: 0, order[4]: 1}
    # Not to its busier first homes: least loaded first, rendezvous order among equals.
    assert route("a1", views(loads=loads)) == [order[3], order[1], order[2], order[4], order[0]]
    # A host-cache holder still comes first: it saves a fetch from storage.
    got = route("a1", views(loads=loads, host={order[2]: ["a1"]}))
    assert got[:3] == [order[2], order[3], order[1]]


def test_a_holder_takes_requests_up_to_the_load_cap_and_no_further():
    order = rendezvous_order("a1", IDS)
    # cap = max(ceil(1.25 * 9 / 5), ceil(9 / 5) + 1) = 3
    loads = {order[0]: 2, order[1]: 2, order[2]: 2, order[3]: 2, order[4]: 0}
    assert route("a1", views(loads=loads, resident={order[3]: ["a1"]}))[0] == order[3]
    loads[order[3]] = 3  # now at the cap (9 -> 10 in all: cap still 3)
    got = route("a1", views(loads=loads, resident={order[3]: ["a1"]}))
    assert got[0] != order[3] and got[-1] == order[3]


def test_slack_lets_a_holder_take_a_request_over_the_cap_but_never_a_miss():
    order = rendezvous_order("a1", IDS)
    # cap = 3 (as above); the holder sits at it, one other replica is past cap + 1.
    loads = {order[0]: 4, order[1]: 3, order[2]: 1, order[3]: 1, order[4]: 0}
    held = {order[1]: ["a1"]}
    assert route("a1", views(loads=loads, resident=held))[0] != order[1]
    got = route("a1", views(loads=loads, resident=held), slack=1)
    assert got[0] == order[1]
    assert sorted(got) == sorted(IDS)  # each replica once
    # A holder past cap + slack, and a replica at the cap that would load it, still wait.
    loads |= {order[1]: 4, order[2]: 0}  # 9 in all still: cap 3
    got = route("a1", views(loads=loads, resident=held), slack=1)
    assert got[0] not in (order[0], order[1]) and set(got[-2:]) == {order[0], order[1]}
    loads[order[1]] = 3
    got = route("a1", views(loads=loads, host=held), slack=1)  # host-cached only: a miss there
    assert got[0] != order[1]


def test_load_budget_grants_slack_while_the_mean_imbalance_is_under_its_bound():
    budget = LoadBudget(bound=1.25, half_life=10.0)
    assert budget.slack() == 1 and budget.mean == 1.0
    for _ in range(40):
        budget.record([6, 4, 3, 3])  # max/mean 1.5
    assert budget.mean > 1.4 and budget.slack() == 0
    for _ in range(40):
        budget.record([4, 4, 4, 4])  # evenly loaded: the budget refills
    assert budget.mean < 1.1 and budget.slack() == 1
    budget.record([0, 0, 0, 0])  # an idle cluster says nothing of imbalance
    assert budget.mean < 1.1
    # The margin keeps the mean from settling on the bound itself.
    assert LoadBudget(bound=1.0, margin=0.0).slack() == 0
    assert LoadBudget(bound=1.2, margin=0.25).slack() == 0
    with pytest.raises(ValueError, match="bound=0.9"):
        LoadBudget(bound=0.9)
    with pytest.raises(ValueError, match="half_life=0"):
        LoadBudget(bound=1.25, half_life=0)
    with pytest.raises(ValueError, match="margin=-0.1"):
        LoadBudget(bound=1.25, margin=-0.1)


def test_base_model_goes_to_least_loaded():
    loads = {IDS[0]: 3, IDS[1]: 2, IDS[2]: 0, IDS[3]: 1, IDS[4]: 2}
    assert route(None, views(loads=loads))[:2] == [IDS[2], IDS[3]]


SYSTEM = "You are a careful assistant. Answer in one sentence and cite nothing. " * 3  # 213 chars


def test_routing_outcome_says_whether_the_replica_or_another_held_the_adapter():
    vs = views(resident={IDS[0]: ["a"]}, host={IDS[1]: ["a", "b"]})
    assert routing_outcome("a", vs[0], vs) == "resident"
    assert routing_outcome("a", vs[1], vs) == "host"  # warm there, though another holds it in slots
    assert routing_outcome("a", vs[2], vs) == "off_holder"
    assert routing_outcome("b", vs[0], vs) == "off_holder"  # another's host cache counts as holding
    assert routing_outcome("c", vs[3], vs) == "placed"
    assert routing_outcome(None, vs[0], vs) == "base"


def test_prefix_affinity_matches_whole_blocks_of_a_prompts_start():
    prefixes = PrefixAffinity(block=64)
    prefixes.record(SYSTEM + "What is a fox?", IDS[1])
    prefixes.record("Something else entirely, " * 4, IDS[2])
    assert prefixes.match(SYSTEM + "And a dog?") == {IDS[1]: 3}  # 3 whole blocks shared
    assert prefixes.match(SYSTEM[:100] + "different from here on" * 3) == {IDS[1]: 1}
    assert prefixes.match("short") == {}  # under one block: nothing to match
    assert prefixes.match("x" + SYSTEM) == {}  # a shifted text shares no prefix
    prefixes.record(SYSTEM + "Again", IDS[3])
    assert prefixes.match(SYSTEM) == {IDS[1]: 3, IDS[3]: 3}


def test_prefix_affinity_forgets_least_recently_used_prefixes():
    prefixes = PrefixAffinity(block=4, capacity=6)
    prefixes.record("aaaabbbbcccc", IDS[0])  # 3 keys
    prefixes.record("xxxxyyyyzzzz", IDS[1])  # 3 more: full
    prefixes.record("aaaabbbb", IDS[0])  # touches the first two keys
    prefixes.record("qqqq", IDS[2])  # evicts the least recently used key: aaaabbbbcccc
    assert prefixes.match("aaaabbbbcccc") == {IDS[0]: 2}
    assert prefixes.match("xxxxyyyyzzzz") == {IDS[1]: 3}
    prefixes.record("rrrr", IDS[2])  # evicts xxxx: the longer prefixes of it match no more
    assert prefixes.match("xxxxyyyyzzzz") == {}
    with pytest.raises(ValueError, match="block"):
        PrefixAffinity(block=0)


def test_base_model_goes_where_its_prompt_start_went_within_the_load_bound():
    match = {IDS[3]: 2, IDS[1]: 3}
    assert route(None, views(), prefix_match=match)[:3] == [IDS[1], IDS[3], IDS[0]]
    # The deepest match is over the cap (max(ceil(1.25 * 11 / 5), 3 + 1) = 4): the next one.
    loads = {IDS[1]: 4, IDS[0]: 3, IDS[2]: 2, IDS[3]: 1, IDS[4]: 0}
    got = route(None, views(loads=loads), prefix_match=match)
    assert got[0] == IDS[3] and got[-1] == IDS[1]


def test_an_adapters_holders_are_ordered_by_prompt_start_then_load():
    """Two homes of a hot adapter hold it: the one that served this conversation's start comes
    first even when busier (within the cap); the holder tier still beats a deeper non-holder."""
    order = rendezvous_order("hot", IDS)
    resident = {order[0]: ["hot"], order[1]: ["hot"]}
    loads = {order[0]: 0, order[1]: 1}
    match = {order[1]: 2, order[2]: 5}
    got = route("hot", views(loads=loads, resident=resident), homes=2, prefix_match=match)
    assert got[:3] == [order[1], order[0], order[2]]


def test_prompt_text_of_payloads():
    assert prompt_text({"kind": "completion", "prompt": "abc"}) == "abc"
    assert prompt_text({"kind": "completion", "prompt": [1, 22, 3]}) == "1 22 3"
    chat = {"kind": "chat", "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}
    assert prompt_text(chat) == "\x00system\x00S\x00user\x00U"
    assert prompt_text({}) == ""
    # Keyed by the adapter: the same prompt under another adapter shares no prefix.
    assert prompt_text({"kind": "completion", "prompt": "abc"}, "a1") == "a1\x01abc"


def test_hot_adapter_spreads_over_its_first_homes():
    order = rendezvous_order("hot", IDS)
    loads = {r: 2 for r in IDS} | {order[0]: 3}
    got = route("hot", views(loads=loads, resident={order[0]: ["hot"]}), homes=2)
    assert got[0] == order[1]  # second home, less loaded than the holder
    cold = route("hot", views(loads=loads, resident={order[0]: ["hot"]}), homes=1)
    assert cold[0] == order[0]


def test_route_rejects_bad_input():
    with pytest.raises(ValueError, match="homes=0"):
        route("a", views(), homes=0)
    with pytest.raises(ValueError, match="slack=-1"):
        route("a", views(), slack=-1)
    with pytest.raises(ValueError, match="no replicas"):
        route("a", [])
    with pytest.raises(ValueError, match="unique"):
        route("a", [ReplicaView("x", 0), ReplicaView("x", 1)])


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_hot_tracker_gives_hot_adapters_more_homes_and_decays():
    clock = FakeClock()
    tracker = HotAdapterTracker(hot_rate=2.0, max_homes=3, half_life_s=5.0, clock=clock)
    for _ in range(200):  # 10 requests/s for 20 s
        clock.t += 0.1
        tracker.record("hot")
        if int(clock.t * 10) % 10 == 0:
            tracker.record("cold")  # 1 request/s
    assert 7.0 < tracker.rate("hot") < 11.0
    assert tracker.homes("hot", num_replicas=5) == 3  # capped by max_homes
    assert tracker.homes("hot", num_replicas=2) == 2  # capped by replicas
    assert tracker.homes("cold", num_replicas=5) == 1
    assert tracker.homes("never-seen", num_replicas=5) == 1
    clock.t += 60.0
    assert tracker.homes("hot", num_replicas=5) == 1


def test_hot_tracker_rejects_bad_config():
    with pytest.raises(ValueError, match="hot_rate=0"):
        HotAdapterTracker(hot_rate=0, max_homes=2)
    with pytest.raises(ValueError, match="max_homes=0"):
        HotAdapterTracker(hot_rate=1.0, max_homes=0)


def test_in_flight_counts_each_call_until_it_finishes_and_the_others_until_they_go_quiet():
    now = [100.0]
    counts = InFlight(horizon_s=3.0, clock=lambda: now[0])
    for rid in ("r0", "r0", "r0", "r1"):
        counts.sent(rid)
    assert counts.mine() == {"r0": 3, "r1": 1}
    counts.done("r0")
    counts.done("r1")
    counts.done("r1")  # a call Serve failed to send, yet says finished: no count below 0
    assert counts.mine() == {"r0": 2}
    counts.heard("ingress-b", {"r0": 4, "r1": 2}, at=99.0)
    counts.heard("ingress-b", {"r0": 9}, at=98.0)  # an older count, arriving late: kept out
    assert [counts.load(r, None) for r in ("r0", "r1")] == [6, 2]
    assert counts.load("r0", 1) == 1  # Serve's cached count is less: it stands
    now[0] = 101.9
    assert counts.load("r1", None) == 2
    now[0] = 102.1  # ingress-b sent nothing for more than the horizon: it is gone
    assert [counts.load(r, None) for r in ("r0", "r1")] == [2, 0]
    counts.forget_others(["r1"])  # r0 stopped
    assert counts.mine() == {} and counts.load("r0", None) == 0
    counts.done("r0")  # its last call's completion, after it stopped: nothing
    assert counts.mine() == {}
    with pytest.raises(ValueError, match="horizon_s"):
        InFlight(horizon_s=0)


def test_residency_estimate_replays_the_sends_after_the_report():
    clock = FakeClock()
    est = ResidencyEstimate(horizon_s=2.0, skew_s=0.1, clock=clock)
    est.record("r0", "new")
    clock.t = 1.0
    # A report taken before the send has not seen it: replayed onto it.
    assert est.held("r0", HeldReport(("old",), 4, as_of=-1.0)) == {"new", "old"}
    assert est.held("r0", HeldReport(("old",), 4, as_of=0.05)) == {"new", "old"}  # within the skew
    # One taken after it has: the adapter left since (evicted by other routers' traffic).
    assert est.held("r0", HeldReport(("old",), 4, as_of=0.5)) == {"old"}
    assert est.held("r1", HeldReport(("old",), 4, as_of=-1.0)) == {"old"}  # sent elsewhere
    # A report without its time counts as horizon_s old.
    assert est.held("r0", HeldReport(("old",), 4)) == {"new", "old"}
    clock.t = 2.5
    assert est.held("r0", HeldReport(("old",), 4)) == {"old"}


def test_residency_estimate_evicts_as_the_replica_does():
    clock = FakeClock()
    est = ResidencyEstimate(horizon_s=10.0, skew_s=0.0, clock=clock)
    least_used = HeldReport(("cold", "hot"), 2, as_of=0.0, scores=(0.5, 5.0), half_life=8.0)
    lru = HeldReport(("cold", "hot"), 2, as_of=0.0)
    for t, name in ((1.0, "new"), (2.0, "other")):
        clock.t = t
        est.record("r0", name)
    # Least used lately: "hot" stays through two one-off adapters, the first of which leaves.
    assert est.held("r0", least_used, "slots") == {"hot", "other"}
    # Least recently used (the host cache): both reported ones leave.
    assert est.held("r0", lru, "host") == {"new", "other"}
    assert est.held("r0", HeldReport(("x",), None, as_of=0.0)) == {"x", "new", "other"}
    assert est.held("r0", HeldReport(("x",), 0, as_of=0.0)) == frozenset()
    # Sends after a report already replayed are applied on top of it.
    est.record("r0", "new")
    est.record("r0", "third")
    assert est.held("r0", least_used, "slots") == {"hot", "third"}
    assert est.held("r0", lru, "host") == {"new", "third"}


def test_sends_for_adapters_in_slots_leave_the_host_cache_as_it_is():
    """A replica reads its host cache only to load a slot: a request for an adapter its
    slots hold then does not make it the host cache's most recently used, and one that
    loads an adapter does."""
    clock = FakeClock()
    est = ResidencyEstimate(horizon_s=10.0, skew_s=0.0, clock=clock)
    host = HeldReport(("a", "b"), 2, as_of=0.0)  # "a" least recently loaded
    slots = HeldReport(("a",), 1, as_of=0.0)
    for t, name in ((1.0, "a"), (2.0, "c"), (3.0, "a")):
        clock.t = t
        est.record("r0", name)
    # "a" in the slot: the host cache untouched; "c" loads (and takes the slot): "a" leaves
    # the host cache; "a" loads again: back in, "b" out.
    assert est.held("r0", host, "host", slots=slots) == {"c", "a"}
    assert est.held("r0", host, "host", slots=HeldReport(("a",), 2, as_of=0.0)) == {"b", "c"}
    assert est.held("r0", host, "host") == {"c", "a"}  # without the slots, every send is a load
    assert est.held("r1", host, "host", slots=slots) == {"a", "b"}  # nothing sent there


def test_residency_estimate_takes_other_routers_sends_late_with_their_times():
    """Another ingress replica's sends arrive up to a second late, logged after newer sends of
    this router's: each applies if the replica's report is older than it, whatever was
    logged around it, and one later than late_s is dropped."""
    clock = FakeClock()
    est = ResidencyEstimate(horizon_s=2.0, skew_s=0.0, clock=clock, late_s=5.0)
    report = HeldReport((), 2, as_of=10.0)  # the replica's host cache, least recently used
    clock.t = 11.0
    est.record("r0", "mine")
    clock.t = 11.5
    est.record("r0", "before-report", at=9.5)  # the report has seen it: not applied
    est.record("r0", "theirs", at=10.5)  # sent before "mine", logged after it
    est.record("r0", "stale", at=6.0)  # more than late_s late: dropped
    assert est.held("r0", report, "host") == {"mine", "theirs"}
    # Logged order is use order: a third adapter evicts the one logged first.
    est.record("r0", "third", at=11.2)
    assert est.held("r0", report, "host") == {"theirs", "third"}
    # A newer report has seen all of them.
    assert est.held("r0", HeldReport(("x",), 2, as_of=11.4), "host") == {"x"}
    with pytest.raises(ValueError, match="late_s=-1"):
        ResidencyEstimate(horizon_s=1.0, late_s=-1)


def test_residency_estimate_forgets_replicas_that_left_and_bounds_its_memory():
    clock = FakeClock()
    est = ResidencyEstimate(horizon_s=10.0, clock=clock, per_replica=2)
    for name in ("a", "b", "c"):
        est.record("r0", name)
    assert est.held("r0", HeldReport((), as_of=-1.0)) == {"b", "c"}  # "a" aged out of the bounded history
    est.record("r1", "a")
    est.forget_others(["r1"])
    assert est.held("r0", HeldReport((), as_of=-1.0)) == frozenset()
    assert est.held("r1", HeldReport((), as_of=-1.0)) == {"a"}
    with pytest.raises(ValueError, match="horizon_s=-1"):
        ResidencyEstimate(horizon_s=-1)
    with pytest.raises(ValueError, match="capacity=-1"):
        HeldReport((), capacity=-1)
    with pytest.raises(ValueError, match="2 names need as many scores"):
        HeldReport(("a", "b"), scores=(1.0,), half_life=8.0)


# --- the Serve RequestRouter plugin, with Serve's in-memory replica stand-in -----------



class StatsReplica(FakeRunningReplica):
    """Serve's fake replica plus the routing stats a LoRAModelServer publishes."""

    def __init__(self, unique_id: str, stats: dict):
        super().__init__(unique_id)
        self._stats = stats
        self.set_queue_len_response(0)

    @property
    def routing_stats(self) -> dict:
        return self._stats


def _pending(adapter: str, payload: dict | None = None, method: str = "generate") -> PendingRequest:
    meta = RequestMetadata(request_id="r", internal_request_id="i", multiplexed_model_id=adapter,
                           call_method=method)
    return PendingRequest(args=[] if payload is None else [payload], kwargs={}, metadata=meta)


def _router(app: str = "test-app") -> AdapterAffinityRouter:
    router = AdapterAffinityRouter(
        deployment_id=DeploymentID(name="LoRAModelServer", app_name=app),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(eps=0.25, hot_rate=1000.0, max_homes=2)
    return router


def routing_stats(rows, metrics, slots=4, host_slots=16):
    return _routing_stats(rows, metrics, slots=slots, host_slots=host_slots)


def _rows(slot_names=(), host_names=()):
    names = sorted(set(slot_names) | set(host_names))
    return [{"name": n, "slot": 0 if n in slot_names else None, "host_cached": n in host_names} for n in names]


def test_serve_router_sends_an_adapter_to_its_holder_and_routes_through_serve():
    async def run():
        router = _router()
        ids = ["r0", "r1", "r2"]
        home = rendezvous_order("a1", ids)[0]
        holder = next(r for r in ids if r != home)
        replicas = [
            StatsReplica(r, routing_stats(_rows(slot_names=["a1"] if r == holder else []), {"n": r}))
            for r in ids
        ]
        router.update_replicas(replicas)
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == holder
        assert all(len(rank) == 1 for rank in ranks)
        # Through Serve's own routing loop (queue-length probes included).
        chosen = await router._choose_replica_for_request(_pending("a1"))
        assert chosen.replica_id.unique_id == holder
        # An adapter nobody holds goes to its rendezvous home.
        chosen = await router._choose_replica_for_request(_pending("zz"))
        assert chosen.replica_id.unique_id == rendezvous_order("zz", ids)[0]
        # Each replica's published metrics are kept for the ingress's /metrics (with the
        # report's time, which these reports do not give).
        assert replica_reports("test-app", "LoRAModelServer") == {r: {"as_of": None, "metrics": {"n": r}} for r in ids}

    asyncio.run(run())


def _two_replicas_one_holding(adapter: str):
    """A router over replicas r0 and r1, the adapter's rendezvous home holding it: (router,
    replicas, the holder's id, its ReplicaID)."""
    router = _router()
    ids = ["r0", "r1"]
    holder = rendezvous_order(adapter, ids)[0]
    replicas = [StatsReplica(r, routing_stats(_rows(slot_names=[adapter] if r == holder else []), {})) for r in ids]
    router.update_replicas(replicas)
    return router, replicas, holder, replicas[ids.index(holder)].replica_id


def test_serve_router_skips_a_full_holder():
    async def run():
        router, replicas, holder, holder_id = _two_replicas_one_holding("a1")
        for _ in range(5):
            router.on_send_request(holder_id)
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id != holder
        for i in range(5):
            router.on_request_completed(holder_id, f"q{i}")
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == holder

    asyncio.run(run())


def test_serve_router_does_not_skip_a_holder_only_serves_stale_count_calls_busy():
    """Serve's cached queue length of a replica can stay high after a burst (a completion
    applied before the replica's answer that still counted it): while this router has
    nothing in flight there and no other ingress replica says it has, the holder is not
    over the bound. A replica Serve counts as less busy than the router does is as busy as
    Serve says (it counts every caller, and knows of finished calls first)."""
    async def run():
        router, replicas, holder, holder_id = _two_replicas_one_holding("a1")
        router._replica_queue_len_cache.update(holder_id, 6)  # a burst's leftover
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == holder
        for _ in range(5):
            router.on_send_request(holder_id)
        router._replica_queue_len_cache.update(holder_id, 1)  # four of them finished there already
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == holder
        router._replica_queue_len_cache.update(holder_id, 5)
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id != holder

    asyncio.run(run())


@pytest.mark.parametrize("router_class", [AdapterAffinityRouter, MultiplexMetricsRouter])
def test_serve_routers_count_where_each_generate_request_went(router_class):
    """Both routers count each routed generate call by what they knew the replicas held: their
    reports, replayed forward through the router's own sends. Other calls are not counted."""
    app = f"outcomes-{router_class.__name__}"

    async def run():
        router = router_class(deployment_id=DeploymentID(name="LoRAModelServer", app_name=app),
                              handle_source=DeploymentHandleSource.UNKNOWN, use_replica_queue_len_cache=True)
        router.initialize_state(residency_horizon_s=2.0)
        r0 = StatsReplica("r0", routing_stats(_rows(slot_names=["a1"]), {}))
        r1 = StatsReplica("r1", routing_stats(_rows(host_names=["a2"]), {}))
        router.update_replicas([r0, r1])
        for adapter, replica in (("a1", r0), ("a2", r1), ("a1", r1), ("zz", r0), ("zz", r0), ("", r1)):
            router.on_request_routed(_pending(adapter), replica.replica_id, None)
        router.on_request_routed(_pending("a2", method="tokenize"), r0.replica_id, None)

    asyncio.run(run())
    assert routing_outcomes(app, "LoRAModelServer") == {
        # a1 on its holder; a2 warm in r1's host cache; a1 where it was not, but is now
        "resident": 2, "host": 1, "off_holder": 1,
        "placed": 1,  # zz the first time; the second follows it (resident)
        "base": 1,
    }
    assert routing_outcomes(app, "OtherDeployment") == {}


def test_a_conversation_finds_its_replica_through_another_ingress_replicas_router():
    """Two ingress replicas' routers (apps of their own here, as processes of their own
    there): what one sent where reaches the other through take_routes / give_routes (the
    ledger between them), so the next turn goes where the first is cached."""
    first = SYSTEM + "What is a fox?"

    async def run():
        a, b = _router("ingress-a"), _router("ingress-b")
        share_routes("ingress-a", "LoRAModelServer")
        r0, r1 = StatsReplica("r0", routing_stats([], {})), StatsReplica("r1", routing_stats([], {}))
        for router in (a, b):
            router.update_replicas([r0, r1])
        # r0 is busy, so the first turn goes to r1 (its least loaded).
        for _ in range(3):
            a.on_send_request(r0.replica_id)
        [[chosen], _] = await a.choose_replicas([r0, r1], _pending("", {"prompt": first}))
        assert chosen is r1
        a.on_send_request(r1.replica_id)
        a.on_request_routed(_pending("", {"prompt": first}), r1.replica_id, None)
        second = {"prompt": first + " A small wild dog. And what is a cat?"}
        # Without a's records, b sends the second turn to r0 (no load known, first by id).
        [[alone], _] = await b.choose_replicas([r0, r1], _pending("", second))
        assert alone is r0
        records = take_routes("ingress-a", "LoRAModelServer")
        # A base-model request: no adapter. Then what a has in flight where.
        assert [(r[0], r[2]) for r in records] == [("prefix", "r1"), ("inflight", {"r0": 3, "r1": 1})]
        assert [r[0] for r in take_routes("ingress-a", "LoRAModelServer")] == ["inflight"]  # each record once
        give_routes("ingress-b", "LoRAModelServer", records)
        [[shared], _] = await b.choose_replicas([r0, r1], _pending("", second))
        assert shared is r1
        # b counts a's calls in flight in the replicas' loads, until a says otherwise.
        assert [b._in_flight.load(r, None) for r in ("r0", "r1")] == [3, 1]
        for i in range(3):
            a.on_request_completed(r0.replica_id, f"busy{i}")
        give_routes("ingress-b", "LoRAModelServer", take_routes("ingress-a", "LoRAModelServer"))
        await b.choose_replicas([r0, r1], _pending("", second))  # b applies what it was given
        assert [b._in_flight.load(r, None) for r in ("r0", "r1")] == [0, 1]

    asyncio.run(run())
    # Only a deployment whose ingress shares them keeps records for take_routes.
    with pytest.raises(KeyError):
        take_routes("ingress-b", "LoRAModelServer")


def test_an_adapter_sent_through_another_ingress_replica_counts_as_held_there():
    """Router A (one ingress replica) sends adapter x away from its rendezvous home, where no
    report shows it yet. Router B (another ingress replica) would send x's next request to
    the home; with A's records it sends it where x is, and counts A's requests in x's rate."""
    async def run():
        a, b = _router("ingress-c"), _router("ingress-d")
        share_routes("ingress-c", "LoRAModelServer")
        ids = ["r0", "r1"]
        home = rendezvous_order("x", ids)[0]
        other = next(r for r in ids if r != home)
        taken = time.time() - 0.5  # the reports were taken before the sends
        replicas = {r: StatsReplica(r, dict(routing_stats([], {}), as_of=taken)) for r in ids}
        for router in (a, b):
            router.update_replicas(list(replicas.values()))
        a.on_request_routed(_pending("x"), replicas[other].replica_id, None)  # its home was full
        [[alone], _] = await b.choose_replicas(list(replicas.values()), _pending("x"))
        assert alone.replica_id.unique_id == home and b._hot.rate("x") == 0
        records = take_routes("ingress-c", "LoRAModelServer")
        assert [r[:3] for r in records if r[0] != "inflight"] == [("adapter", other, "x")]
        give_routes("ingress-d", "LoRAModelServer", records)
        [[shared], _] = await b.choose_replicas(list(replicas.values()), _pending("x"))
        assert shared.replica_id.unique_id == other and b._hot.rate("x") > 0

    asyncio.run(run())


def test_routing_stats_from_manager_rows():
    stats = routing_stats(_rows(slot_names=["b", "a"], host_names=["a", "c"]), {"x": 1})
    assert stats == {"resident": ["a", "b"], "host_cached": ["a", "c"], "slots": 4, "host_slots": 16,
                     "as_of": None, "metrics": {"x": 1}}
    # With the manager's residency: its order and counts, and when it was taken.
    held = {"resident": ["b", "a"], "resident_scores": [0.5, 3.0], "half_life": 32, "host_cached": ["c", "a"]}
    stats = _routing_stats([], {}, slots=4, host_slots=16, residency=held, as_of=12.5)
    assert stats == {**held, "slots": 4, "host_slots": 16, "as_of": 12.5, "metrics": {}}


def test_serve_router_replays_its_sends_onto_a_timed_report():
    """A replica's report says when it was taken and in what order its slots leave: the
    router applies the requests it sent after that with the replica's own eviction."""
    async def run():
        router = _router()
        clock = FakeClock()
        router._residency = ResidencyEstimate(horizon_s=2.0, skew_s=0.0, clock=clock)
        held = {"resident": ["cold", "hot"], "resident_scores": [0.2, 6.0], "half_life": 16,
                "host_cached": ["cold", "hot"]}
        replica = StatsReplica("r0", _routing_stats([], {}, slots=2, host_slots=2, residency=held, as_of=1.0))
        router.update_replicas([replica])
        clock.t = 0.5  # before the report: it has seen this one
        router.on_request_routed(_pending("early"), replica.replica_id, None)
        clock.t = 1.5
        router.on_request_routed(_pending("new"), replica.replica_id, None)
        view = replica_view(replica, 0, router._residency)
        assert view.resident == {"hot", "new"}  # the least used left, not the least recent
        assert view.host_cached == {"hot", "new"}

    asyncio.run(run())


@pytest.mark.parametrize("affinity, router", [(True, "AdapterAffinityRouter"), (False, "MultiplexMetricsRouter")])
def test_build_app_puts_the_chosen_router_on_the_model_server(affinity, router):
    from deployments.app import build_app

    ingress = build_app({"adapter_affinity_routing": affinity})._bound_deployment
    server = ingress.init_args[0]._bound_deployment
    config = server._deployment_config.request_router_config
    assert server.name == "LoRAModelServer"
    assert config.request_router_class == f"cluster.serve_router.{router}"
    assert config.request_routing_stats_period_s == 1.0


def test_serve_router_routes_concurrent_calls_of_one_request():
    """The n choices of one HTTP request share Serve's internal request id: each must still
    be handed a replica (the base router would match only one of them)."""
    async def run():
        router = _router()
        replicas = [StatsReplica(r, routing_stats(_rows(), {})) for r in ("r0", "r1")]
        router.update_replicas(replicas)
        pending = [_pending(a) for a in ("a1", "a1", "a2", "")]
        assert len({p.metadata.internal_request_id for p in pending}) == 1
        chosen = await asyncio.wait_for(
            asyncio.gather(*(router._choose_replica_for_request(p) for p in pending)), timeout=20)
        assert len(chosen) == 4 and all(c is not None for c in chosen)
        assert all(p.routing_context.should_backoff for p in pending)

    asyncio.run(run())


def test_serve_router_sends_a_base_model_prompt_where_its_start_went():
    async def run():
        router = _router()
        ids = ["r0", "r1", "r2"]
        replicas = [StatsReplica(r, routing_stats([], {})) for r in ids]
        router.update_replicas(replicas)
        first = {"kind": "completion", "prompt": SYSTEM + "first question"}
        chosen = await router._choose_replica_for_request(_pending("", first))
        router.on_request_routed(_pending("", first), chosen.replica_id, None)
        # The first replica is now busier than the others; the shared start still wins.
        router.on_send_request(chosen.replica_id)
        second = {"kind": "completion", "prompt": SYSTEM + "second question"}
        ranks = await router.choose_replicas(replicas, _pending("", second))
        assert ranks[0][0].replica_id == chosen.replica_id
        other = {"kind": "completion", "prompt": "nothing in common with the others, at all. " * 3}
        ranks = await router.choose_replicas(replicas, _pending("", other))
        assert ranks[0][0].replica_id != chosen.replica_id  # least loaded

    asyncio.run(run())


def test_serve_router_keeps_an_adapter_conversation_on_one_of_its_holders():
    async def run():
        router = _router()
        ids = ["r0", "r1", "r2"]
        # Both r0 and r1 hold the adapter; r2 does not.
        replicas = [StatsReplica(r, routing_stats(_rows(slot_names=["a1"] if r != "r2" else []), {}))
                    for r in ids]
        router.update_replicas(replicas)
        first = {"kind": "chat", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "1"}]}
        ranks = await router.choose_replicas(replicas, _pending("a1", first))
        went = ranks[0][0].replica_id
        router.on_request_routed(_pending("a1", first), went, None)
        router.on_send_request(went)  # busier than the other holder now
        second = {"kind": "chat", "messages": first["messages"] + [{"role": "assistant", "content": "ok"}]}
        ranks = await router.choose_replicas(replicas, _pending("a1", second))
        assert ranks[0][0].replica_id == went
        # The same prompt for another adapter (or the base model) matches nothing.
        assert router._prefixes.match(prompt_text(second, "a2")) == {}
        assert router._prefixes.match(prompt_text(second)) == {}

    asyncio.run(run())


def test_serve_router_counts_its_own_routes_until_a_report_shows_them():
    """Reports arrive once a stats period: a replica just sent an adapter holds it though its
    report does not say so yet, so the next request for that adapter follows it there."""
    async def run():
        router = _router()
        clock = FakeClock()
        router._residency = ResidencyEstimate(horizon_s=2.0, clock=clock)
        ids = ["r0", "r1", "r2"]
        home = rendezvous_order("a1", ids)[0]
        replicas = [StatsReplica(r, routing_stats(_rows(), {}, slots=1, host_slots=1)) for r in ids]
        router.update_replicas(replicas)
        other = next(r for r in replicas if r.replica_id.unique_id != home)
        router.on_request_routed(_pending("a1"), other.replica_id, None)
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id == other.replica_id
        # One slot and one host entry there: a later route to it has evicted a1.
        clock.t = 0.5
        router.on_request_routed(_pending("b9"), other.replica_id, None)
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == home
        # Past the horizon, an empty report is believed: a1 is not held there any more.
        router.on_request_routed(_pending("a1"), other.replica_id, None)
        clock.t = 3.0
        ranks = await router.choose_replicas(replicas, _pending("a1"))
        assert ranks[0][0].replica_id.unique_id == home
        # A replica that left is forgotten.
        router.update_replicas([r for r in replicas if r is not other])
        assert router._residency.held(other.replica_id.unique_id, HeldReport(())) == frozenset()

    asyncio.run(run())
