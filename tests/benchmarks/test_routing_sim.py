"""The routing simulation runs, and affinity routing keeps what it is for: within the load
bound, fewer slot misses than Serve's multiplexing held to the same bound, about as few
storage fetches, as few misses as an oracle that knows every adapter's popularity held to
the same bound, and reports replayed forward well enough that a once-a-period view routes
about as well as a live one."""

from __future__ import annotations

from benchmarks import routing_sim

SMALL = ["--requests", "6000"]


def test_affinity_misses_less_than_multiplexing_within_the_same_load_bound(capsys):
    got = routing_sim.main(SMALL)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("miss_rate_affinity=") and "fetch_rate_multiplex_bounded=" in last
    assert got["max_load_ratio"] <= 1.25
    assert got["miss_rate_affinity"] < got["miss_rate_multiplex_bounded"] - 0.04
    assert got["fetch_rate_affinity"] < 1.15 * got["fetch_rate_multiplex_bounded"]
    assert got["miss_rate_affinity"] < got["miss_rate_least_loaded"]
    # Serve's own multiplexing sticks to the replicas that served an adapter whatever their load.
    assert got["fetch_rate_multiplex"] < 0.05 and got["miss_rate_multiplex"] < got["miss_rate_affinity"]
    assert got["max_load_ratio_multiplex"] > 1.4


def test_affinity_misses_as_few_slots_as_a_popularity_oracle_within_the_same_bound():
    got = routing_sim.main(SMALL)
    # Homes balanced by true popularity miss few slots only while nothing bounds the load:
    # random arrivals still pile up on one home.
    assert got["miss_rate_partition"] < got["miss_rate_affinity"] - 0.05
    assert got["max_load_ratio_partition"] > 1.4
    assert got["max_load_ratio_partition_bounded"] <= 1.25
    assert got["miss_rate_affinity"] < got["miss_rate_partition_bounded"] + 0.01
    assert got["fetch_rate_affinity"] < got["fetch_rate_partition_bounded"]


def test_replayed_reports_route_about_as_well_as_live_state():
    periodic = routing_sim.main(SMALL)
    live = routing_sim.main([*SMALL, "--report-ticks", "1", "--report-delay", "0"])
    assert abs(periodic["miss_rate_affinity"] - live["miss_rate_affinity"]) < 0.02
    assert abs(periodic["fetch_rate_affinity"] - live["fetch_rate_affinity"]) < 0.02


def test_the_soft_bound_buys_fewer_misses_within_the_same_mean_imbalance():
    got = routing_sim.main(SMALL)
    assert got["max_load_ratio"] <= 1.25 and got["max_load_ratio_affinity_hard"] <= 1.25
    assert got["miss_rate_affinity"] < got["miss_rate_affinity_hard"] - 0.01
    assert got["fetch_rate_affinity"] < got["fetch_rate_affinity_hard"] + 0.01
    # Serve's multiplexing loaded no more unevenly than affinity misses more.
    assert got["max_load_ratio_multiplex_matched"] <= got["max_load_ratio"]
    assert got["miss_rate_multiplex_matched"] > got["miss_rate_affinity"] + 0.04
