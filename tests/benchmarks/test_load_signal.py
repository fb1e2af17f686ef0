"""The load-signal benchmark runs against a real Serve app, and the router's own count of its
calls in flight (the load its bound reads) rises while calls run and is back at 0 after every
burst: Serve calls the router's send and completion hooks once per call."""

from __future__ import annotations

import subprocess
import sys


def test_the_routers_in_flight_count_rises_during_a_burst_and_ends_at_zero():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.load_signal", "--bursts", "3", "--calls", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = dict(part.split("=") for part in proc.stdout.strip().splitlines()[-1].split())
    assert last["bursts"] == "3" and last["stale_bursts_in_flight"] == "0", proc.stdout
    assert int(last["least_peak_in_flight"]) > 0, proc.stdout
