"""Serving metrics: per-replica recording, and Prometheus exposition across replicas.

Each LoRAModelServer replica records its requests in a plain ``ReplicaMetrics`` (no
global registry: Ray rebuilds deployment modules by value, and several replicas may share
a process in tests) and publishes ``snapshot()`` with its routing stats. The ingress
renders every replica's latest snapshot, labelled by replica, as Prometheus text on
``GET /metrics`` through its own ``CollectorRegistry``.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

from cluster.routing import ROUTING_OUTCOMES

PREFIX = "multilora"
BASE_LABEL = "base"  # requests for the base model, no adapter
OTHER_LABEL = "other"  # adapters past the label budget
UNKNOWN_LABEL = "unknown"  # names that are not registered adapters
STATUSES = ("ok", "error", "aborted")  # how a request ended

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

LORA_COUNTERS = ("loads", "evictions", "host_hits", "host_misses", "host_evictions", "fetches", "fetch_errors")
# Engine.stats() counters exported as they are, each with its help text.
ENGINE_COUNTERS = {
    "prefix_cache_query_tokens": "Prompt tokens of requests that looked up the prefix cache",
    "prefix_cache_hit_tokens": "Prompt tokens found in the prefix cache (not recomputed)",
    "extend_steps": "Engine steps that computed a prompt chunk over a cached prefix or earlier chunks",
    "preemptions": "Running sequences whose KV blocks were taken back (recomputed later) when blocks ran out",
    "failed_steps": "Engine steps that raised (the requests that caused it failed, or were run alone to tell)",
    "isolated_steps": "Engine steps run with one suspect request of a failed step alone",
    "adapter_slot_waits": "Requests admitted once their adapter was loaded into a device slot for them",
    "adapter_slot_wait_seconds": "Seconds those requests waited in the queue (too few slots for the adapters in "
    "demand show here)",
}
# Engine.stats() gauges exported as they are: the KV cache's blocks and the memory plan (bytes per device).
ENGINE_GAUGES = {
    "kv_blocks": "KV cache blocks (the null block excluded)",
    "kv_blocks_free": "KV cache blocks no sequence holds (cached prefixes among them)",
    "kv_blocks_cached": "KV cache blocks holding a shareable prefix block",
    "kv_block_size": "Tokens per KV cache block",
    "kv_capacity_tokens": "Tokens the KV cache holds",
    "memory_weights_bytes": "Memory plan: model weights per device",
    "memory_adapter_pool_bytes": "Memory plan: adapter pool per device",
    "memory_adapter_staging_bytes": "Memory plan: adapters staged for their slot writes, per device",
    "memory_workspace_bytes": "Memory plan: largest step's workspace per device",
    "memory_kv_cache_bytes": "Memory plan: KV cache per device",
}


class AdapterLabels:
    """Bounded label values for adapters: the first ``max_adapters`` keep their name.

    Labels are sticky: once an adapter has its own series it keeps it, so every counter
    stays monotonic (re-ranking a top-K would move counts between series and read as
    counter resets). Adapters past the budget share ``"other"``; None is ``"base"``.
    """

    def __init__(self, max_adapters: int):
        if max_adapters < 0:
            raise ValueError(f"{max_adapters=} must be >= 0")
        self.max_adapters = max_adapters
        self._named: set[str] = set()

    def label(self, adapter: str | None) -> str:
        if not adapter:
            return BASE_LABEL
        if adapter in self._named:
            return adapter
        if len(self._named) < self.max_adapters and adapter not in (BASE_LABEL, OTHER_LABEL, UNKNOWN_LABEL):
            self._named.add(adapter)
            return adapter
        return OTHER_LABEL


class Histogram:
    """Cumulative-bucket histogram as plain numbers, so it travels in a snapshot."""

    def __init__(self, buckets: Iterable[float]):
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}


class RequestTrace:
    """Timing of one request on a replica; ``finish`` records it once."""

    def __init__(self, metrics: ReplicaMetrics, adapter: str | None, clock: Callable[[], float]):
        self._metrics = metrics
        self._adapter = adapter  # labelled when it finishes: by then the replica knows if it is registered
        self._clock = clock
        self._start = clock()
        self._last: float | None = None
        self._done = False

    def tokens(self, n: int) -> None:
        """``n`` new tokens arrived now (the first arrival is the time to first token)."""
        if n <= 0:
            return
        now = self._clock()
        m = self._metrics
        if self._last is None:
            m.ttft.observe(now - self._start)
            n -= 1
        elif n > 0:
            # Tokens that arrive together share the gap since the last arrival.
            gap = (now - self._last) / n
            for _ in range(n):
                m.inter_token.observe(gap)
        self._last = now

    def finish(self, status: str, prompt_tokens: int, completion_tokens: int) -> None:
        if status not in STATUSES:
            raise ValueError(f"request {status=} is not one of {STATUSES}")
        if self._done:
            return
        self._done = True
        m = self._metrics
        m.e2e.observe(self._clock() - self._start)
        label = m.label(self._adapter)
        key = (label, status)
        m.requests[key] = m.requests.get(key, 0) + 1
        m.prompt_tokens[label] = m.prompt_tokens.get(label, 0) + prompt_tokens
        m.generation_tokens[label] = m.generation_tokens.get(label, 0) + completion_tokens


class ReplicaMetrics:
    """One replica's request counters and latency histograms.

    Every series a replica exports exists from its start: the base model's request and
    token counters start at 0, like the engine and adapter counters, so a replica that has
    served nothing yet reads as zeros rather than as missing series. Adapter series appear
    when the adapter is first served (their labels are not known before).
    """

    def __init__(self, max_adapter_labels: int = 20, clock: Callable[[], float] = time.monotonic,
                 is_registered: Callable[[str], bool] | None = None):
        """`is_registered`: whether an adapter name is registered; names that are not share
        the label "unknown" (None: every name is)."""
        self.labels = AdapterLabels(max_adapter_labels)
        self._clock = clock
        self._is_registered = is_registered
        # (adapter label, status) -> count
        self.requests: dict[tuple[str, str], int] = {(BASE_LABEL, s): 0 for s in STATUSES}
        self.prompt_tokens: dict[str, int] = {BASE_LABEL: 0}
        self.generation_tokens: dict[str, int] = {BASE_LABEL: 0}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.inter_token = Histogram(INTER_TOKEN_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def start(self, adapter: str | None) -> RequestTrace:
        return RequestTrace(self, adapter, self._clock)

    def label(self, adapter: str | None) -> str:
        """The label value of a request for `adapter`: a client's name for an adapter that is
        not registered never becomes one."""
        if adapter and self._is_registered is not None and not self._is_registered(adapter):
            return UNKNOWN_LABEL
        return self.labels.label(adapter)

    def snapshot(self, engine_stats: Mapping[str, float], lora_stats=None, slots_used: int = 0,
                 slots_total: int = 0, class_slots: Mapping[int, tuple[int, int]] | None = None) -> dict:
        """Everything /metrics shows for this replica, as plain data."""
        return {
            "requests": [[a, s, n] for (a, s), n in sorted(self.requests.items())],
            "prompt_tokens": dict(self.prompt_tokens),
            "generation_tokens": dict(self.generation_tokens),
            "ttft": self.ttft.snapshot(),
            "inter_token": self.inter_token.snapshot(),
            "e2e": self.e2e.snapshot(),
            "running": engine_stats.get("running", 0),
            "waiting": engine_stats.get("waiting", 0),
            "engine": {k: engine_stats.get(k, 0) for k in ENGINE_COUNTERS},
            "engine_gauges": {k: engine_stats.get(k, 0) for k in ENGINE_GAUGES},
            "lora": {} if lora_stats is None else {k: dataclasses.asdict(lora_stats)[k] for k in LORA_COUNTERS},
            "slots_used": slots_used,
            "slots_total": slots_total,
            # slot rank -> [used, total] per rank class of the pool (LoRAManager.slot_classes)
            "class_slots": {str(r): list(v) for r, v in sorted((class_slots or {}).items())},
        }


def _histogram(name: str, doc: str, snaps: Mapping[str, dict], key: str) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(f"{PREFIX}_{name}", doc, labels=["replica"])
    for replica, snap in snaps.items():
        h = snap[key]
        cumulative, running = [], 0
        for bound, count in zip([*h["buckets"], float("inf")], h["counts"]):
            running += count
            cumulative.append((_bound(bound), running))
        fam.add_metric([replica], cumulative, sum_value=h["sum"])
    return fam


def _bound(b: float) -> str:
    return "+Inf" if b == float("inf") else repr(float(b))


class ClusterCollector:
    """A prometheus_client collector over the latest snapshot of every replica, the routing
    outcomes of the ingress's routers (``routing``: outcome -> requests), the requests each
    ingress replica admitted (``admitted``: ingress replica id -> requests) and each API
    key's usage (``keys``: key name -> {"admitted", "rate_limited", "tokens"})."""

    def __init__(self, source: Callable[[], Mapping[str, dict]],
                 routing: Callable[[], Mapping[str, int]] | None = None,
                 admitted: Callable[[], Mapping[str, int]] | None = None,
                 keys: Callable[[], Mapping[str, Mapping[str, int]]] | None = None):
        self._source = source  # replica id -> ReplicaMetrics.snapshot() dict
        self._routing = routing
        self._admitted = admitted
        self._keys = keys

    def collect(self):
        snaps = dict(self._source())
        req = CounterMetricFamily(f"{PREFIX}_requests", "Finished requests", labels=["replica", "adapter", "status"])
        p_tok = CounterMetricFamily(f"{PREFIX}_prompt_tokens", "Prompt tokens", labels=["replica", "adapter"])
        g_tok = CounterMetricFamily(f"{PREFIX}_generation_tokens", "Generated tokens", labels=["replica", "adapter"])
        running = GaugeMetricFamily(f"{PREFIX}_running_requests", "Sequences decoding", labels=["replica"])
        waiting = GaugeMetricFamily(f"{PREFIX}_waiting_requests", "Sequences queued", labels=["replica"])
        used = GaugeMetricFamily(f"{PREFIX}_adapter_slots_used", "Device adapter slots holding an adapter",
                                 labels=["replica"])
        total = GaugeMetricFamily(f"{PREFIX}_adapter_slots", "Device adapter slots", labels=["replica"])
        class_used = GaugeMetricFamily(f"{PREFIX}_adapter_class_slots_used",
                                       "Device adapter slots holding an adapter, per slot rank class",
                                       labels=["replica", "rank"])
        class_total = GaugeMetricFamily(f"{PREFIX}_adapter_class_slots", "Device adapter slots per slot rank class",
                                        labels=["replica", "rank"])
        lora = {
            k: CounterMetricFamily(f"{PREFIX}_adapter_{k}", f"Adapter {k.replace('_', ' ')}", labels=["replica"])
            for k in LORA_COUNTERS
        }
        engine = {
            k: CounterMetricFamily(f"{PREFIX}_{k}", doc, labels=["replica"]) for k, doc in ENGINE_COUNTERS.items()
        }
        gauges = {k: GaugeMetricFamily(f"{PREFIX}_{k}", doc, labels=["replica"]) for k, doc in ENGINE_GAUGES.items()}
        for replica, s in snaps.items():
            for adapter, status, n in s["requests"]:
                req.add_metric([replica, adapter, status], n)
            for adapter, n in s["prompt_tokens"].items():
                p_tok.add_metric([replica, adapter], n)
            for adapter, n in s["generation_tokens"].items():
                g_tok.add_metric([replica, adapter], n)
            running.add_metric([replica], s["running"])
            waiting.add_metric([replica], s["waiting"])
            used.add_metric([replica], s["slots_used"])
            total.add_metric([replica], s["slots_total"])
            for rank, (n_used, n_total) in s.get("class_slots", {}).items():
                class_used.add_metric([replica, rank], n_used)
                class_total.add_metric([replica, rank], n_total)
            for k, v in s["lora"].items():
                lora[k].add_metric([replica], v)
            for k, v in s["engine"].items():
                engine[k].add_metric([replica], v)
            for k, v in s["engine_gauges"].items():
                gauges[k].add_metric([replica], v)
        yield from (req, p_tok, g_tok, running, waiting, used, total, class_used, class_total, *lora.values(),
                    *engine.values(),
                    *gauges.values())
        yield _histogram("time_to_first_token_seconds", "Time to first token", snaps, "ttft")
        yield _histogram("inter_token_seconds", "Time between output tokens", snaps, "inter_token")
        yield _histogram("request_seconds", "End-to-end request time", snaps, "e2e")
        if self._routing is not None:
            counts = self._routing()
            routed = CounterMetricFamily(
                f"{PREFIX}_routing_decisions",
                "Requests routed to a model-server replica, by what the router knew it held: resident (device "
                "slots), host (host cache only), off_holder (another replica held the adapter), placed (none "
                "did), base (no adapter)", labels=["outcome"])
            for outcome in ROUTING_OUTCOMES:
                routed.add_metric([outcome], counts.get(outcome, 0))
            yield routed
        if self._admitted is not None:
            admitted = CounterMetricFamily(
                f"{PREFIX}_ingress_requests",
                "Inference requests an ingress replica admitted (past its API key and rate checks)",
                labels=["ingress"])
            for ingress, n in sorted(self._admitted().items()):
                admitted.add_metric([ingress], n)
            yield admitted
        if self._keys is not None:
            requests = CounterMetricFamily(
                f"{PREFIX}_api_key_requests", "Inference requests per API key: admitted, or refused for a rate "
                "(429)", labels=["key", "outcome"])
            tokens = CounterMetricFamily(f"{PREFIX}_api_key_tokens",
                                         "Prompt and completion tokens charged per API key", labels=["key"])
            for key, usage in sorted(self._keys().items()):
                for outcome in ("admitted", "rate_limited"):
                    requests.add_metric([key, outcome], usage.get(outcome, 0))
                tokens.add_metric([key], usage.get("tokens", 0))
            yield requests
            yield tokens


def render(source: Callable[[], Mapping[str, dict]], routing: Callable[[], Mapping[str, int]] | None = None,
           admitted: Callable[[], Mapping[str, int]] | None = None,
           keys: Callable[[], Mapping[str, Mapping[str, int]]] | None = None) -> bytes:
    """Prometheus text exposition of every replica's snapshot (and of routing outcomes, the
    ingress replicas' admitted requests and API key usage: ClusterCollector)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ClusterCollector(source, routing, admitted, keys))
    return generate_latest(registry)


__all__ = [
    "AdapterLabels",
    "ClusterCollector",
    "Histogram",
    "ReplicaMetrics",
    "RequestTrace",
    "STATUSES",
    "render",
]
