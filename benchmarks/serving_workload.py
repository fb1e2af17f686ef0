"""The serving benchmark's workload and its accounting, pure Python: Zipf adapter popularity,
Poisson arrivals, uniform lengths; per-request records, percentiles, run summaries, and the
adapter counters read from a deployment's Prometheus text."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import random
import string
from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import LORA_COUNTERS, PREFIX
from cluster.routing import ROUTING_OUTCOMES

# The demo tokenizer reads characters and adds BOS: a prompt of k letters and "=" is k + 2 tokens.
_PROMPT_OVERHEAD_TOKENS = 2
_LETTERS = string.ascii_lowercase


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """What one run sends: `num_adapters` adapters of Zipf(`alpha`) popularity, Poisson arrivals at
    `rate` requests/s until `max_requests` are sent or `max_duration_s` has passed, prompt and
    output lengths (tokens, both ends included) uniform in their ranges."""

    num_adapters: int
    alpha: float
    rate: float
    max_requests: int
    max_duration_s: float
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    seed: int = 0

    def __post_init__(self):
        if self.num_adapters < 1:
            raise ValueError(f"num_adapters={self.num_adapters} must be >= 1")
        if self.alpha < 0:
            raise ValueError(f"alpha={self.alpha} must be >= 0")
        if not self.rate > 0:
            raise ValueError(f"rate={self.rate} must be > 0 requests/s")
        if self.max_requests < 1 or not self.max_duration_s > 0:
            raise ValueError(f"max_requests={self.max_requests} and max_duration_s={self.max_duration_s} "
                             "must bound the run (>= 1 request, > 0 s)")
        lo, hi = self.input_len
        if not _PROMPT_OVERHEAD_TOKENS < lo <= hi:
            raise ValueError(f"input_len={self.input_len} must be a range (lo <= hi) with lo > "
                             f"{_PROMPT_OVERHEAD_TOKENS} (BOS and the '=' separator are prompt tokens)")
        lo, hi = self.output_len
        if not 1 <= lo <= hi:
            raise ValueError(f"output_len={self.output_len} must be a range (1 <= lo <= hi)")


@dataclasses.dataclass(frozen=True)
class WorkItem:
    """One request of a workload: when it is sent (seconds after the start), for which adapter
    (index into the adapter list, by popularity rank), its prompt and its max_tokens."""

    send_at_s: float
    adapter: int
    prompt: str
    prompt_tokens: int
    max_tokens: int


def zipf_weights(n: int, alpha: float) -> list[float]:
    """Popularity of ranks 1..n under Zipf(alpha): p_i proportional to 1 / i**alpha, summing to 1."""
    raw = [1.0 / (i + 1) ** alpha for i in range(n)]
    total = sum(raw)
    return [w / total for w in raw]


def make_workload(spec: WorkloadSpec) -> list[WorkItem]:
    """The requests of one run, the same for every system given the same spec (seeded)."""
    rng = random.Random(spec.seed)
    cum = list(itertools.accumulate(zipf_weights(spec.num_adapters, spec.alpha)))
    items: list[WorkItem] = []
    t = 0.0
    while len(items) < spec.max_requests:
        t += rng.expovariate(spec.rate)
        if t >= spec.max_duration_s:
            break
        # min() guards the last bucket against the cumulative sum's rounding just under 1.
        adapter = min(bisect.bisect_right(cum, rng.random() * cum[-1]), spec.num_adapters - 1)
        prompt_tokens = rng.randint(*spec.input_len)
        word = "".join(rng.choice(_LETTERS) for _ in range(prompt_tokens - _PROMPT_OVERHEAD_TOKENS))
        items.append(WorkItem(t, adapter, word + "=", prompt_tokens, rng.randint(*spec.output_len)))
    return items


@dataclasses.dataclass
class RequestRecord:
    """What the client saw of one request: perf_counter times of its send, first token and last
    token, the completion tokens the server reported, and an error (None when whole)."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    completion_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft_s(self) -> float:
        return self.first_token - self.sent

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first; None for a one-token answer."""
        if self.completion_tokens < 2:
            return None
        return (self.last_token - self.first_token) / (self.completion_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); nan for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q={q} must be in [0, 100]")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """One run's figures: throughput over the span from the first send to the last finish,
    latency percentiles (ms) of the whole requests, errors, and the SLO attainment (share of all
    requests whole with TTFT and TPOT within their bounds)."""

    requests: int
    errors: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    slo_attainment: float


def summarize(records: Sequence[RequestRecord], *, slo_ttft_s: float, slo_tpot_s: float) -> RunSummary:
    """The RunSummary of one run's records."""
    ok = [r for r in records if r.ok]
    if ok:
        span = max(r.last_token for r in ok) - min(r.sent for r in records)
    else:
        span = math.nan
    ttft = [r.ttft_s for r in ok]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    within = sum(1 for r in ok if r.ttft_s <= slo_ttft_s and (r.tpot_s or 0.0) <= slo_tpot_s)
    return RunSummary(
        requests=len(records),
        errors=len(records) - len(ok),
        requests_per_s=len(ok) / span if ok and span > 0 else 0.0,
        output_tokens_per_s=sum(r.completion_tokens for r in ok) / span if ok and span > 0 else 0.0,
        ttft_p50_ms=1e3 * percentile(ttft, 50),
        ttft_p99_ms=1e3 * percentile(ttft, 99),
        tpot_p50_ms=1e3 * percentile(tpot, 50),
        tpot_p99_ms=1e3 * percentile(tpot, 99),
        slo_attainment=within / len(records) if records else math.nan,
    )


def headline_rate(ttft_p99_ms: Mapping[float, float], slo_ttft_s: float) -> tuple[float, bool]:
    """The rate a benchmark's last line is at: the highest whose p99 TTFT (ms, by rate) is under
    `slo_ttft_s`, else the lowest; and whether any was under it."""
    within = [rate for rate, ms in ttft_p99_ms.items() if ms < 1e3 * slo_ttft_s]
    return (max(within), True) if within else (min(ttft_p99_ms), False)


def parse_prometheus(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of Prometheus exposition text: (name, sorted label pairs) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


REPLICA_TOKENS = "tokens@"  # adapter_counters' key of one replica's generated tokens: "tokens@<replica>"


def adapter_counters(text: str) -> dict[str, float]:
    """The adapter counters (cluster.metrics.LORA_COUNTERS: loads into device slots, host-cache
    misses, storage fetches, ...) of /metrics text, summed over replicas, the routing outcomes
    (``routed_<outcome>``, cluster.routing.ROUTING_OUTCOMES) and each replica's generated
    tokens (``tokens@<replica>``, every adapter's and the base model's)."""
    samples = parse_prometheus(text)
    out = {}
    for counter in LORA_COUNTERS:
        name = f"{PREFIX}_adapter_{counter}_total"
        out[counter] = sum(v for (n, _), v in samples.items() if n == name)
    for outcome in ROUTING_OUTCOMES:
        key = (f"{PREFIX}_routing_decisions_total", (("outcome", outcome),))
        out[f"routed_{outcome}"] = samples.get(key, 0.0)
    for (name, labels), value in samples.items():
        if name == f"{PREFIX}_generation_tokens_total":
            key = REPLICA_TOKENS + dict(labels)["replica"]
            out[key] = out.get(key, 0.0) + value
    return out


def load_imbalance(counters: Mapping[str, float]) -> float:
    """The busiest replica's generated tokens over the replicas' mean (1: even; the load
    bound's measure), from adapter_counters (or their delta over a run); nan where no replica
    generated any."""
    loads = [v for k, v in counters.items() if k.startswith(REPLICA_TOKENS)]
    total = sum(loads)
    return max(loads) * len(loads) / total if total > 0 else math.nan


def off_holder_share(counters: Mapping[str, float]) -> float:
    """Of the adapter requests routed, the share sent to a replica that held the adapter nowhere
    while another held it (cluster.routing.routing_outcome); nan where none were counted."""
    adapter = sum(counters.get(f"routed_{o}", 0.0) for o in ROUTING_OUTCOMES if o != "base")
    return counters.get("routed_off_holder", 0.0) / adapter if adapter else math.nan


def counter_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What the counters grew by between two scrapes (a counter that went down, a replica
    replaced meanwhile, counts from zero)."""
    return {k: (after[k] - before.get(k, 0.0)) if after[k] >= before.get(k, 0.0) else after[k] for k in after}
