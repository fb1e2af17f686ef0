"""What the load bound reads after a burst: Serve's cached queue lengths against the router's
own count of its calls in flight (cluster.routing.InFlight).

    python -m benchmarks.load_signal [--bursts 20] [--calls 16] [--max-ongoing 16]

Starts Ray and a Serve app: a deployment of two replicas whose calls take 10 ms, routed by
AdapterAffinityRouter, called from another deployment in bursts of `--calls` at once. Half a
second after each burst has finished (nothing is in flight), it reads, in the caller's router,
Serve's cached queue length of each replica and the router's own in-flight count. A burst is
"stale" where a replica still counts a call. During each burst it also samples the router's
count (its peak shows Serve calls the router's send hook). Prints a row per burst and, last,
`stale_bursts_serve_cache=<n> stale_bursts_in_flight=<n> bursts=<n> least_peak_in_flight=<n>`.
"""

from __future__ import annotations

import argparse
import asyncio

from benchmarks.common import print_table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--bursts", type=int, default=20)
    parser.add_argument("--calls", type=int, default=16, help="calls at once in a burst")
    parser.add_argument("--max-ongoing", type=int, default=16, help="the replicas' max_ongoing_requests")
    args = parser.parse_args(argv)

    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from cluster.serve_router import AdapterAffinityRouter

    @serve.deployment(num_replicas=2, max_ongoing_requests=args.max_ongoing, ray_actor_options={"num_cpus": 0},
                      request_router_config=RequestRouterConfig(request_router_class=AdapterAffinityRouter))
    class Quick:
        async def generate(self, request: dict) -> int:
            await asyncio.sleep(0.01)
            return len(request["prompt"])

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    class Caller:
        def __init__(self, quick):
            self._quick = quick

        async def burst(self, n: int) -> dict:
            calls = asyncio.ensure_future(asyncio.gather(
                *[self._quick.generate.remote({"prompt": str(i)}) for i in range(n)]))
            peak = 0  # the most calls the router counted in flight during the burst
            while not calls.done():
                router = self._quick._router._asyncio_router._request_router  # made on the first send
                if router is not None:
                    peak = max(peak, sum(router._in_flight.mine().values()))
                await asyncio.sleep(0.002)
            await calls
            router = self._quick._router._asyncio_router._request_router
            await asyncio.sleep(0.5)
            replicas = list(router._replicas.values())
            return {"serve_cache": [router._replica_queue_len_cache.get(r.replica_id) or 0 for r in replicas],
                    "in_flight": [router._in_flight.load(r.replica_id.unique_id, None) for r in replicas],
                    "peak": peak}

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        handle = serve.run(Caller.bind(Quick.bind()), name="load-signal", route_prefix=None)
        rows = []
        for i in range(args.bursts):
            got = handle.burst.remote(args.calls).result()
            rows.append((i, got["serve_cache"], got["in_flight"], got["peak"]))
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"{args.bursts} bursts of {args.calls} calls of 10 ms over 2 replicas (max_ongoing_requests "
          f"{args.max_ongoing}); counts 0.5 s after each burst finished")
    print_table(["burst", "router_in_flight_peak", "serve_cached_queue_lengths", "router_in_flight"],
                [(i, peak, " ".join(map(str, s)), " ".join(map(str, f))) for i, s, f, peak in rows])
    stale_serve = sum(any(s) for _, s, _, _ in rows)
    stale_own = sum(any(f) for _, _, f, _ in rows)
    least_peak = min(peak for *_, peak in rows)
    print(f"stale_bursts_serve_cache={stale_serve} stale_bursts_in_flight={stale_own} bursts={args.bursts} "
          f"least_peak_in_flight={least_peak}")


if __name__ == "__main__":
    main()
