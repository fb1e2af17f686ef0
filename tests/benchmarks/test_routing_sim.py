"""The routing simulation runs, and affinity routing keeps what it is for: fewer storage
fetches than Serve's multiplexing within the load bound, and reports replayed forward well
enough that a once-a-period view routes about as well as a live one."""

from __future__ import annotations

from benchmarks import routing_sim

SMALL = ["--requests", "6000"]


def test_affinity_fetches_less_within_the_load_bound(capsys):
    got = routing_sim.main(SMALL)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("miss_rate_affinity=") and "fetch_rate_multiplex_bounded=" in last
    assert got["fetch_rate_affinity"] < 0.8 * got["fetch_rate_multiplex"]
    assert got["fetch_rate_affinity"] < 0.6 * got["fetch_rate_multiplex_bounded"]
    assert got["max_load_ratio"] <= 1.25
    assert got["miss_rate_affinity"] < got["miss_rate_least_loaded"]


def test_replayed_reports_route_about_as_well_as_live_state():
    periodic = routing_sim.main(SMALL)
    live = routing_sim.main([*SMALL, "--report-ticks", "1", "--report-delay", "0"])
    assert abs(periodic["miss_rate_affinity"] - live["miss_rate_affinity"]) < 0.02
    assert abs(periodic["fetch_rate_affinity"] - live["fetch_rate_affinity"]) < 0.02
