"""Routing simulation (no Ray): slot-miss rate and load imbalance of eight routing policies.

N replicas, each with a pool of S device slots (evicting as the engine does, the least used
lately: lora_runtime/lora/eviction.py; or LRU) and an LRU host cache of H adapters,
serve a Zipf-distributed adapter workload. As in the engine (lora_runtime/lora/manager.py),
the host cache is consulted only on a slot miss, so its order is that of slot loads, not of
requests. A slot miss that also misses the host cache is a fetch from storage, the expensive
case that rendezvous homes exist to avoid: with each adapter homed on one replica, the host
caches hold disjoint sets and add up. Requests arrive one per tick and each lasts
``service_ticks`` ticks, so load is the number of requests in flight on a replica. Policies:

- random: any replica.
- least_loaded: the replica with the fewest requests in flight.
- multiplex: Serve's multiplexed routing as the app configures it (Ray 2.60's
  power-of-two-choices router): each replica's model ids are the last ``host_slots``
  adapters it served (``max_num_models_per_replica`` is ``max_cpu_loras``; Serve's own LRU
  of them, kept apart from the host cache); the less loaded of two random replicas holding
  the adapter under their max ongoing requests, else of two random replicas under it. It sees live state. Nothing
  bounds a replica's load below ``max_ongoing`` (64 a replica in the app).
- multiplex_bounded: the same within affinity's load bound (cluster/routing.py load_cap)
  in place of max ongoing requests.
- partition: an oracle, not a router: each adapter has one home, chosen knowing every
  adapter's true request count (greedy bin-packing, most requested first, onto the replica
  with the fewest requests so far), so the homes carry equal load on average. Every request
  goes home, whatever the load. It sees live state.
- partition_bounded: the same homes within affinity's load bound: home while under the cap,
  else a replica under it holding the adapter in device slots, then in its host cache, then
  the least loaded. What the load bound costs a router that knows popularity exactly.
- affinity: cluster/routing.py, device holders then rendezvous order within a load bound.
  It sees what the Serve router sees: each replica's report of the adapters it holds
  (device slots in eviction order with their use counts, host cache least recently used
  first, and how many of each it has room for), taken every ``report_ticks`` and delivered
  ``report_delay`` ticks later, replayed forward through its own routes since
  (ResidencyEstimate). The other policies see the replicas' state as it is. Its load bound
  is soft (cluster/routing.py LoadBudget): a device holder may take a request one over the
  cap while the recent mean of max/mean load is under 1 + eps.
- affinity_hard: the same with the cap held at every moment (no LoadBudget).

Last comes a fair comparison, not a policy: multiplex at the largest max ongoing requests
whose max/mean load is at most affinity's (``multiplex@N``), since a looser bound buys
either router fewer misses.

A tick is about 50 ms of a real cluster (the rate half-life of 200 ticks stands for the
router's 10 s), so the default report period of 20 ticks is Serve's 1 s stats period.
Prints a table and, last, one ``key=value`` line.
"""

from __future__ import annotations

import argparse
import random
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

from cluster.routing import (
    HeldReport, HotAdapterTracker, LoadBudget, ReplicaView, ResidencyEstimate, load_cap, route,
)
from lora_runtime.lora.eviction import HALF_LIFE_PER_SLOT, UseScores


class LRUPool:
    """A replica's device slots: least recently used adapter leaves first."""

    def __init__(self, slots: int):
        self.slots = slots
        self._held: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._held

    def use(self, adapter: str) -> bool:
        """Makes ``adapter`` resident; returns True on a miss (a slot write)."""
        if adapter in self._held:
            self._held.move_to_end(adapter)
            return False
        if len(self._held) >= self.slots:
            self._held.popitem(last=False)
        self._held[adapter] = None
        return True

    def report(self, as_of: float) -> HeldReport:
        """What the replica reports of these slots: least recently used first."""
        return HeldReport(tuple(self._held), self.slots, as_of)


class LeastUsedPool(LRUPool):
    """A replica's device slots as the engine evicts them: the adapter least used lately
    leaves first (decayed use counts, UseScores), then the least recently used."""

    def __init__(self, slots: int):
        super().__init__(slots)
        self._uses = UseScores(HALF_LIFE_PER_SLOT * slots)

    def use(self, adapter: str) -> bool:
        self._uses.use(adapter)
        if adapter in self._held:
            self._held.move_to_end(adapter)
            return False
        if len(self._held) >= self.slots:
            order = {a: i for i, a in enumerate(self._held)}  # least recently used first
            del self._held[min(self._held, key=lambda a: (self._uses.score(a), order[a]))]
        self._held[adapter] = None
        return True

    def report(self, as_of: float) -> HeldReport:
        """What the replica reports of these slots: in eviction order, with their use counts."""
        order = {a: i for i, a in enumerate(self._held)}
        names = sorted(self._held, key=lambda a: (self._uses.score(a), order[a]))
        return HeldReport(tuple(names), self.slots, as_of, tuple(self._uses.score(a) for a in names),
                          self._uses.half_life)


POOLS = {"least-used": LeastUsedPool, "lru": LRUPool}
POLICIES = ("random", "least_loaded", "multiplex", "multiplex_bounded", "partition", "partition_bounded", "affinity_hard",
            "affinity")


@dataclass
class Result:
    policy: str
    miss_rate: float  # slot misses per request
    fetch_rate: float  # host-cache misses (storage fetches) per request
    max_load_ratio: float  # mean over ticks of max load / mean load (busy ticks)
    p99_load: int


def zipf_workload(num_adapters: int, alpha: float, n: int, rng: random.Random) -> list[str]:
    weights = [1.0 / (i + 1) ** alpha for i in range(num_adapters)]
    return rng.choices([f"adapter-{i}" for i in range(num_adapters)], weights=weights, k=n)


def balanced_homes(workload: list[str], ids: list[str]) -> dict[str, str]:
    """The partition oracle's homes: adapters by true request count, most first, each onto
    the replica with the fewest requests so far."""
    counts = Counter(workload)
    assigned = dict.fromkeys(ids, 0)
    homes = {}
    for adapter, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        home = min(ids, key=lambda r: (assigned[r], r))
        assigned[home] += count
        homes[adapter] = home
    return homes


def simulate(policy: str, workload: list[str], *, replicas: int, slots: int, host_slots: int, service_ticks: int,
             max_ongoing: int, eps: float, seed: int, report_ticks: int, report_delay: int,
             eviction: str = "least-used") -> Result:
    rng = random.Random(seed)
    ids = [f"replica-{i}" for i in range(replicas)]
    pools = {r: POOLS[eviction](slots) for r in ids}
    hosts = {r: LRUPool(host_slots) for r in ids}
    model_ids = {r: LRUPool(host_slots) for r in ids}  # Serve's multiplexed model ids: every request
    loads = dict.fromkeys(ids, 0)
    finishing: deque[tuple[int, str]] = deque()
    # Rates in requests per tick: a tick is one arrival, so the clock is the tick count.
    tick = [0]
    hot = HotAdapterTracker(hot_rate=0.3, max_homes=max(1, replicas // 2), half_life_s=200.0,
                            clock=lambda: float(tick[0]))
    # The affinity router's view: reports in flight (delivery tick, snapshot), the last one
    # delivered, and its own routes since (a report is taken before the tick's route).
    residency = ResidencyEstimate(horizon_s=2.0 * report_ticks, skew_s=0.0, clock=lambda: float(tick[0]))
    reports: deque[tuple[int, dict[str, tuple[HeldReport, HeldReport]]]] = deque()
    reported = {r: (HeldReport((), slots, 0.0), HeldReport((), host_slots, 0.0)) for r in ids}
    # The affinity router's soft load bound (over the routes of about 10 s, as the rates').
    budget = LoadBudget(bound=1.0 + eps, half_life=200.0) if policy == "affinity" else None
    homes = balanced_homes(workload, ids) if policy.startswith("partition") else {}
    misses = 0
    fetches = 0
    ratios: list[float] = []
    samples: list[int] = []
    for t, adapter in enumerate(workload):
        tick[0] = t
        while finishing and finishing[0][0] <= t:
            loads[finishing.popleft()[1]] -= 1
        if policy == "random":
            chosen = rng.choice(ids)
        elif policy == "least_loaded":
            chosen = min(ids, key=lambda r: (loads[r], rng.random()))
        elif policy in ("multiplex", "multiplex_bounded"):
            cap = max_ongoing if policy == "multiplex" else load_cap(list(loads.values()), eps)
            under = [r for r in ids if loads[r] < cap] or ids
            pick_from = [r for r in under if adapter in model_ids[r]] or under
            chosen = min(rng.sample(pick_from, min(2, len(pick_from))), key=lambda r: (loads[r], rng.random()))
        elif policy == "partition":
            chosen = homes[adapter]
        elif policy == "partition_bounded":
            cap = load_cap(list(loads.values()), eps)
            under = [r for r in ids if loads[r] < cap]
            if homes[adapter] in under:
                chosen = homes[adapter]
            else:
                holders = ([r for r in under if adapter in pools[r]] or [r for r in under if adapter in hosts[r]]
                           or under)
                chosen = min(holders, key=lambda r: (loads[r], r))
        elif policy in ("affinity", "affinity_hard"):
            if t % report_ticks == 0:
                reports.append((t + report_delay, {r: (pools[r].report(t), hosts[r].report(t)) for r in ids}))
            while reports and reports[0][0] <= t:
                reported = reports.popleft()[1]
            views = [ReplicaView(r, loads[r], residency.held(r, reported[r][0], "slots"),
                                 residency.held(r, reported[r][1], "host", slots=reported[r][0])) for r in ids]
            chosen = route(adapter, views, homes=hot.homes(adapter, replicas), eps=eps,
                           slack=budget.slack() if budget is not None else 0)[0]
            if budget is not None:
                budget.record([loads[r] + (r == chosen) for r in ids])
            hot.record(adapter)
            residency.record(chosen, adapter)
        else:
            raise ValueError(f"{policy=} is not one of {', '.join(POLICIES)}")
        if pools[chosen].use(adapter):
            misses += 1
            fetches += hosts[chosen].use(adapter)
        model_ids[chosen].use(adapter)
        loads[chosen] += 1
        finishing.append((t + service_ticks, chosen))
        mean = sum(loads.values()) / replicas
        ratios.append(max(loads.values()) / mean)
        samples.append(max(loads.values()))
    samples.sort()
    return Result(policy, misses / len(workload), fetches / len(workload), sum(ratios) / len(ratios), samples[int(0.99 * (len(samples) - 1))])


def multiplex_at_load(run, ratio: float, limit: int) -> tuple[int, Result]:
    """Serve's multiplexing at the largest max ongoing requests (up to ``limit``, past
    which nothing bounds it) whose max/mean load does not exceed ``ratio`` (the least uneven
    if none is under it): a comparison with affinity at the same load imbalance, since a
    looser bound buys either of them fewer misses. ``run(policy, max_ongoing)`` simulates one."""
    best: tuple[int, Result] | None = None
    for max_ongoing in range(1, limit + 1):
        got = run("multiplex", max_ongoing)
        if got.max_load_ratio <= ratio:
            best = (max_ongoing, got)
        elif best is not None:
            break  # looser bounds only load more unevenly
        elif max_ongoing == 1 or got.max_load_ratio < fallback[1].max_load_ratio:
            fallback = (max_ongoing, got)
    return best if best is not None else fallback


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="device adapter slots per replica")
    p.add_argument("--host-slots", type=int, default=16, help="adapters in each replica's host cache")
    p.add_argument("--adapters", type=int, default=64)
    p.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--service-ticks", type=int, default=16, help="ticks a request stays in flight")
    p.add_argument("--max-ongoing", type=int, default=16,
                   help="multiplex policy: a replica's max ongoing requests (16, every request in flight: no bound)")
    p.add_argument("--eps", type=float, default=0.25, help="affinity and multiplex_bounded: load bound slack")
    p.add_argument("--report-ticks", type=int, default=20, help="affinity policy: ticks between replica reports")
    p.add_argument("--report-delay", type=int, default=2, help="affinity policy: ticks a report takes to arrive")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eviction", choices=sorted(POOLS), default="least-used",
                   help="device slots evict the least used lately (as the engine does) or the least recently used")
    a = p.parse_args(argv)
    for name in ("replicas", "slots", "host_slots", "adapters", "requests", "service_ticks", "max_ongoing",
                 "report_ticks"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 1")
    if a.report_delay < 0:
        raise SystemExit(f"--report-delay={a.report_delay} must be >= 0")
    workload = zipf_workload(a.adapters, a.alpha, a.requests, random.Random(a.seed))
    def run(policy: str, max_ongoing: int = a.max_ongoing) -> Result:
        return simulate(policy, workload, replicas=a.replicas, slots=a.slots, host_slots=a.host_slots,
                        service_ticks=a.service_ticks, max_ongoing=max_ongoing, eps=a.eps, seed=a.seed,
                        report_ticks=a.report_ticks, report_delay=a.report_delay, eviction=a.eviction)

    results = {policy: run(policy) for policy in POLICIES}
    matched_ongoing, results["multiplex_matched"] = multiplex_at_load(run, results["affinity"].max_load_ratio,
                                                                    a.service_ticks)
    results["multiplex_matched"].policy = f"multiplex@{matched_ongoing}"
    print(f"{a.replicas} replicas x {a.slots} slots ({a.eviction}) + {a.host_slots} host, {a.adapters} adapters, "
          f"Zipf alpha={a.alpha}, "
          f"{a.requests} requests, {a.service_ticks} ticks each; affinity sees reports every {a.report_ticks} ticks, "
          f"{a.report_delay} late")
    print(f"{'policy':<19}{'slot miss':>11}{'fetch':>9}{'max/mean load':>15}{'p99 max load':>14}")
    for r in results.values():
        print(f"{r.policy:<19}{r.miss_rate:>11.4f}{r.fetch_rate:>9.4f}{r.max_load_ratio:>15.3f}{r.p99_load:>14d}")
    out = {
        "miss_rate_affinity": results["affinity"].miss_rate,
        "miss_rate_multiplex": results["multiplex"].miss_rate,
        "miss_rate_least_loaded": results["least_loaded"].miss_rate,
        "miss_rate_random": results["random"].miss_rate,
        "fetch_rate_affinity": results["affinity"].fetch_rate,
        "fetch_rate_multiplex": results["multiplex"].fetch_rate,
        "fetch_rate_random": results["random"].fetch_rate,
        "miss_rate_multiplex_bounded": results["multiplex_bounded"].miss_rate,
        "fetch_rate_multiplex_bounded": results["multiplex_bounded"].fetch_rate,
        "miss_rate_partition": results["partition"].miss_rate,
        "miss_rate_partition_bounded": results["partition_bounded"].miss_rate,
        "fetch_rate_partition_bounded": results["partition_bounded"].fetch_rate,
        "max_load_ratio": results["affinity"].max_load_ratio,
        "max_load_ratio_least_loaded": results["least_loaded"].max_load_ratio,
        "max_load_ratio_multiplex": results["multiplex"].max_load_ratio,
        "max_load_ratio_partition": results["partition"].max_load_ratio,
        "max_load_ratio_partition_bounded": results["partition_bounded"].max_load_ratio,
        "miss_rate_affinity_hard": results["affinity_hard"].miss_rate,
        "fetch_rate_affinity_hard": results["affinity_hard"].fetch_rate,
        "max_load_ratio_affinity_hard": results["affinity_hard"].max_load_ratio,
        "miss_rate_multiplex_matched": results["multiplex_matched"].miss_rate,
        "fetch_rate_multiplex_matched": results["multiplex_matched"].fetch_rate,
        "max_load_ratio_multiplex_matched": results["multiplex_matched"].max_load_ratio,
        "max_ongoing_multiplex_matched": matched_ongoing,
    }
    print(" ".join(f"{k}={v:.4f}" for k, v in out.items()))
    return out


if __name__ == "__main__":
    main()
