"""Adapter-affinity routing: rendezvous order, load bound, hot-adapter homes, churn."""

import pytest

from cluster.routing import HotAdapterTracker, ReplicaView, load_cap, rendezvous_order, route

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


def test_base_model_goes_to_least_loaded():
    loads = {IDS[0]: 3, IDS[1]: 2, IDS[2]: 0, IDS[3]: 1, IDS[4]: 2}
    assert route(None, views(loads=loads))[:2] == [IDS[2], IDS[3]]


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
