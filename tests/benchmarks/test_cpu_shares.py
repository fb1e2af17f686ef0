"""The serving benchmark's CPU accounting: threads' CPU time from /proc, by process role and
thread name."""

import os
import subprocess
import sys
import time

import pytest

from benchmarks.cpu_shares import (
    CpuShares, delta, pids_of_role, pin, role_of, snapshot, split_cores, split_process, thread_kind,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

# A child process whose thread "busy-worker" spins for 3 s from when it says "ready" (so a
# child slow to start on busy cores still spins through the measured window).
_BUSY = """
import threading, time
from lora_runtime.native_thread import name_native_thread
ready = threading.Event()
def spin():
    name_native_thread("busy-worker")
    ready.set()
    until = time.monotonic() + 3.0
    while time.monotonic() < until:
        pass
t = threading.Thread(target=spin); t.start(); ready.wait(); print("ready", flush=True); t.join()
"""


def test_processes_are_named_by_role():
    assert role_of("ray::ServeReplica:bench:LoRAModelServer", 10, 1) == "model server"
    assert role_of("ray::ServeReplica:default:OpenAIIngress", 10, 1) == "ingress"
    assert role_of("ray::ProxyActor", 10, 1) == "HTTP proxy"
    assert role_of("/usr/bin/raylet --node_id=x", 10, 1) == "Ray (other)"
    assert role_of("python -m benchmarks.peft_server --port 1", 10, 1) == "PEFT server"
    assert role_of("python -m pytest", 1, 1) == "client"
    assert role_of("sshd: root", 10, 1) == "other"
    assert role_of("", 10, 1) == "kernel"


def test_a_pool_threads_count_as_one_kind():
    assert thread_kind("adapter-fetch_3") == "adapter-fetch"
    assert thread_kind("engine-compile_12") == "engine-compile"
    assert thread_kind("engine-loop") == "engine-loop"
    assert thread_kind("42") == "42"


def test_a_busy_thread_in_another_process_is_charged_its_cpu_time():
    child = subprocess.Popen([sys.executable, "-c", _BUSY], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        before, started = snapshot(), time.monotonic()
        time.sleep(0.8)
        shares = delta(before, snapshot(), time.monotonic() - started)
    finally:
        assert child.wait(timeout=30) == 0
    busy = shares.seconds.get(("other", "busy-worker"), 0.0)
    # One thread spinning for 0.8 s of wall time: some of a core (the cores may be shared with
    # other tests), never more than one.
    assert 0.1 < busy <= 0.8 * 1.1, shares.seconds
    rows = shares.rows()
    assert ("", "busy-worker") in {(r[0], r[1]) for r in rows}
    assert rows[-1][0] == "idle"


def test_shares_by_role_and_of_the_machine():
    s = CpuShares({("model server", "engine-loop"): 3.0, ("model server", "XLA"): 1.0, ("ingress", "main"): 2.0},
                  wall_s=5.0, cores=2)
    assert s.by_role() == {"model server": 4.0, "ingress": 2.0}
    assert s.share(4.0) == pytest.approx(0.4)
    rows = s.rows()
    assert rows[0] == ("model server", "(all)", 4.0, "40.0%")
    assert rows[1] == ("", "engine-loop", 3.0, "30.0%")
    assert rows[-1] == ("idle", "", 4.0, "40.0%")


# A child whose command line names it a model-server replica, with a thread already running;
# on a line from stdin it starts another and prints the cores each of them may use.
_PINNED = """
import os, sys, threading
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
print("ready", flush=True)
sys.stdin.readline()
late = []
t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()
print(sorted(os.sched_getaffinity(early.native_id)), late[0], flush=True)
stop.set()
"""


def test_split_cores_halves_this_process_cores():
    cores = os.sched_getaffinity(0)
    if len(cores) < 2:
        with pytest.raises(ValueError, match="at least 2"):
            split_cores()
        return
    compute, serving = split_cores()
    assert compute and serving and not compute & serving and compute | serving == cores
    assert max(compute) < min(serving)


def test_pin_moves_every_thread_of_a_process_and_the_threads_it_starts_later():
    child = subprocess.Popen([sys.executable, "-c", _PINNED, "ray::ServeReplica:bench:LoRAModelServer"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.pid in pids_of_role("model server")
        core = min(os.sched_getaffinity(0))
        assert pin(child.pid, {core}) >= 2  # the main thread and the early one
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == [f"[{core}]", f"[{core}]"]
    finally:
        child.kill()
        child.wait(timeout=30)


_XLA_CHILD = """
import sys
import jax.numpy as jnp
x = jnp.ones((256, 256)); (x @ x).block_until_ready()
print("ready", flush=True)
sys.stdin.readline()
"""


def _allowed(pid: int, tid: str) -> set[int]:
    status = open(f"/proc/{pid}/task/{tid}/status").read()
    listed = next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))
    out = set()
    for part in listed.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def test_split_process_puts_xla_compute_threads_on_one_half_and_the_rest_on_the_other():
    # With one core, both halves are that core: the split still has to cover every thread.
    cores = os.sched_getaffinity(0)
    compute, host = split_cores() if len(cores) >= 2 else (cores, cores)
    child = subprocess.Popen([sys.executable, "-c", _XLA_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert split_process(child.pid, compute, host) >= 1
        kinds = {tid: thread_kind(open(f"/proc/{child.pid}/task/{tid}/comm").read())
                 for tid in os.listdir(f"/proc/{child.pid}/task")}
        assert "tf_XLAEigen" in kinds.values()
        for tid, kind in kinds.items():
            assert _allowed(child.pid, tid) == (compute if kind == "tf_XLAEigen" else host), kind
    finally:
        child.kill()
        child.wait(timeout=30)
