"""Replica metrics: bounded adapter labels, histograms, traces, Prometheus exposition."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.metrics import AdapterLabels, Histogram, ReplicaMetrics, render
from lora_runtime.lora.manager import LoRAStats


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def samples(text: bytes) -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_adapter_labels_are_bounded_and_sticky():
    labels = AdapterLabels(max_adapters=2)
    assert labels.label(None) == "base"
    assert labels.label("") == "base"
    assert labels.label("a") == "a"
    assert labels.label("b") == "b"
    assert labels.label("c") == "other"
    assert labels.label("a") == "a"  # keeps its series
    got = {labels.label(f"x{i}") for i in range(1000)}
    assert got == {"other"}
    with pytest.raises(ValueError, match="max_adapters=-1"):
        AdapterLabels(-1)


def test_adapter_named_like_a_reserved_label_is_not_confused_with_it():
    labels = AdapterLabels(max_adapters=5)
    assert labels.label("other") == "other"
    assert labels.label("base") == "other"  # never merged into base-model traffic


def test_names_that_are_not_registered_share_the_unknown_label():
    """A client's made-up model names never become label values, however many there are; an
    adapter registered while its request ran is labelled by its name when the request ends."""
    registered = {"a"}
    m = ReplicaMetrics(max_adapter_labels=50, is_registered=registered.__contains__)
    for i in range(30):
        m.start(f"fuzz-{i}\u00e9").finish("error", 0, 0)
    late = m.start("b")
    registered.add("b")
    late.finish("ok", 2, 1)
    m.start("a").finish("ok", 3, 2)
    m.start(None).finish("ok", 1, 1)
    assert {label for label, _ in m.requests} == {"base", "a", "b", "unknown"}
    assert m.requests[("unknown", "error")] == 30 and m.requests[("b", "ok")] == 1
    assert AdapterLabels(5).label("unknown") == "other"  # an adapter so named is not merged with them


def test_histogram_buckets_are_upper_inclusive():
    h = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.counts == [2, 1, 1]
    assert h.sum == pytest.approx(2.65)


def test_trace_records_ttft_inter_token_e2e_and_tokens():
    clock = FakeClock()
    m = ReplicaMetrics(max_adapter_labels=1, clock=clock)
    t = m.start("a1")
    clock.t += 0.3
    t.tokens(1)  # first token: TTFT 0.3
    clock.t += 0.04
    t.tokens(2)  # two tokens in 0.04 s: two gaps of 0.02
    t.finish("ok", prompt_tokens=5, completion_tokens=3)
    t.finish("ok", prompt_tokens=5, completion_tokens=3)  # counted once
    m.start("a2").finish("error", prompt_tokens=0, completion_tokens=0)
    assert m.ttft.sum == pytest.approx(0.3) and sum(m.ttft.counts) == 1
    assert sum(m.inter_token.counts) == 2 and m.inter_token.sum == pytest.approx(0.04)
    assert m.e2e.sum == pytest.approx(0.34 + 0.0)
    base = {("base", "ok"): 0, ("base", "error"): 0, ("base", "aborted"): 0}
    assert m.requests == {**base, ("a1", "ok"): 1, ("other", "error"): 1}
    assert m.prompt_tokens == {"base": 0, "a1": 5, "other": 0}
    assert m.generation_tokens == {"base": 0, "a1": 3, "other": 0}
    with pytest.raises(ValueError, match="status='done'"):
        m.start(None).finish("done", 1, 1)


def test_a_replica_that_served_nothing_exports_every_series_at_zero():
    """The series a replica exports do not depend on what it has served: an idle replica
    shows the same request, token, engine and adapter series as a busy one, at 0."""
    idle, busy = ReplicaMetrics(), ReplicaMetrics()
    busy.start(None).finish("ok", prompt_tokens=7, completion_tokens=2)
    engine = {"running": 0, "waiting": 0, "prefix_cache_query_tokens": 0}

    def series(m: ReplicaMetrics) -> dict[tuple, float]:
        return samples(render(lambda: {"r": m.snapshot(engine, LoRAStats(), 0, 4)}))

    idle_series, busy_series = series(idle), series(busy)
    assert set(idle_series) == set(busy_series)
    prompt = ("multilora_prompt_tokens_total", (("adapter", "base"), ("replica", "r")))
    query = ("multilora_prefix_cache_query_tokens_total", (("replica", "r"),))
    assert idle_series[prompt] == 0 and idle_series[query] == 0 and busy_series[prompt] == 7
    for status in ("ok", "error", "aborted"):
        key = ("multilora_requests_total", (("adapter", "base"), ("replica", "r"), ("status", status)))
        assert idle_series[key] == 0


def test_render_aggregates_replicas_in_prometheus_text():
    clock = FakeClock()
    snaps = {}
    for i, rid in enumerate(["r0", "r1"]):
        m = ReplicaMetrics(max_adapter_labels=4, clock=clock)
        for _ in range(i + 1):
            t = m.start("a1")
            clock.t += 0.2
            t.tokens(1)
            t.finish("ok", prompt_tokens=4, completion_tokens=1)
        stats = LoRAStats(loads=3 + i, evictions=1, host_hits=2, host_misses=1)
        engine = {"running": i, "waiting": 2, "prefix_cache_query_tokens": 40 + i, "prefix_cache_hit_tokens": 16 * i,
                  "extend_steps": 3 * i, "decode_steps": 7, "preemptions": 5 * i, "kv_blocks": 100,
                  "adapter_slot_waits": 2 + i, "adapter_slot_wait_seconds": 0.25 * i,
                  "kv_blocks_free": 60 + i, "kv_capacity_tokens": 1600, "memory_kv_cache_bytes": 1 << 20}
        snaps[rid] = m.snapshot(engine, stats, slots_used=i + 1, slots_total=4, class_slots={8: (i, 3), 64: (1, 1)})
    got = samples(render(lambda: snaps))
    assert got[("multilora_requests_total", (("adapter", "a1"), ("replica", "r1"), ("status", "ok")))] == 2
    assert got[("multilora_prompt_tokens_total", (("adapter", "a1"), ("replica", "r0")))] == 4
    assert got[("multilora_adapter_loads_total", (("replica", "r1"),))] == 4
    assert got[("multilora_adapter_host_hits_total", (("replica", "r0"),))] == 2
    assert got[("multilora_adapter_slots_used", (("replica", "r1"),))] == 2
    assert got[("multilora_adapter_slots", (("replica", "r0"),))] == 4
    assert got[("multilora_adapter_class_slots_used", (("rank", "8"), ("replica", "r1")))] == 1
    assert got[("multilora_adapter_class_slots", (("rank", "8"), ("replica", "r0")))] == 3
    assert got[("multilora_adapter_class_slots_used", (("rank", "64"), ("replica", "r0")))] == 1
    assert got[("multilora_running_requests", (("replica", "r1"),))] == 1
    assert got[("multilora_prefix_cache_query_tokens_total", (("replica", "r1"),))] == 41
    assert got[("multilora_prefix_cache_hit_tokens_total", (("replica", "r0"),))] == 0
    assert got[("multilora_prefix_cache_hit_tokens_total", (("replica", "r1"),))] == 16
    assert got[("multilora_extend_steps_total", (("replica", "r1"),))] == 3
    assert not any(name.startswith("multilora_decode_steps") for name, _ in got)  # only the listed counters
    assert got[("multilora_preemptions_total", (("replica", "r1"),))] == 5
    assert got[("multilora_adapter_slot_waits_total", (("replica", "r1"),))] == 3
    assert got[("multilora_adapter_slot_wait_seconds_total", (("replica", "r1"),))] == 0.25
    assert got[("multilora_kv_blocks", (("replica", "r0"),))] == 100
    assert got[("multilora_kv_blocks_free", (("replica", "r1"),))] == 61
    assert got[("multilora_kv_capacity_tokens", (("replica", "r0"),))] == 1600
    assert got[("multilora_memory_kv_cache_bytes", (("replica", "r1"),))] == 1 << 20
    assert got[("multilora_time_to_first_token_seconds_count", (("replica", "r1"),))] == 2
    # 0.2 s falls in le=0.25, not in le=0.1.
    assert got[("multilora_time_to_first_token_seconds_bucket", (("le", "0.25"), ("replica", "r1")))] == 2
    assert got[("multilora_time_to_first_token_seconds_bucket", (("le", "0.1"), ("replica", "r1")))] == 0
    assert got[("multilora_time_to_first_token_seconds_bucket", (("le", "+Inf"), ("replica", "r0")))] == 1


def test_routing_outcomes_render_as_one_counter_with_every_outcome():
    got = samples(render(dict, lambda: {"resident": 7, "off_holder": 2}))
    assert got[("multilora_routing_decisions_total", (("outcome", "resident"),))] == 7
    assert got[("multilora_routing_decisions_total", (("outcome", "off_holder"),))] == 2
    for outcome in ("host", "placed", "base"):  # at zero until the first such request
        assert got[("multilora_routing_decisions_total", (("outcome", outcome),))] == 0
    assert not any(name.startswith("multilora_routing") for name, _ in samples(render(dict)))


def test_each_ingress_replicas_admitted_requests_are_one_series():
    got = samples(render(dict, dict, lambda: {"ingress-b": 3, "ingress-a": 5}))
    assert got[("multilora_ingress_requests_total", (("ingress", "ingress-a"),))] == 5
    assert got[("multilora_ingress_requests_total", (("ingress", "ingress-b"),))] == 3
    assert not any(name.startswith("multilora_ingress") for name, _ in samples(render(dict, dict)))


def test_each_api_keys_usage_is_a_request_and_a_token_series():
    got = samples(render(dict, dict, dict, lambda: {"acme": {"admitted": 3, "rate_limited": 2, "tokens": 40}}))
    assert got[("multilora_api_key_requests_total", (("key", "acme"), ("outcome", "admitted")))] == 3
    assert got[("multilora_api_key_requests_total", (("key", "acme"), ("outcome", "rate_limited")))] == 2
    assert got[("multilora_api_key_tokens_total", (("key", "acme"),))] == 40
    assert not any(name.startswith("multilora_api_key") for name, _ in samples(render(dict, dict, dict, dict)))


def test_render_with_no_replicas_is_valid_text():
    text = render(dict)
    assert samples(text) == {}
    assert b"# TYPE multilora_requests_total counter" in text
    assert b"# TYPE multilora_prefix_cache_hit_tokens_total counter" in text


def test_dashboard_queries_only_metrics_that_are_exported():
    import json
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "cluster"
    dash = json.loads((root / "grafana" / "multilora.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = set(re.findall(r"multilora_[a-z_]+", " ".join(exprs)))
    m = ReplicaMetrics()
    m.start("a").finish("ok", 1, 1)
    snap = {"r": m.snapshot({}, LoRAStats(), 0, 1, {8: (0, 1)})}
    exported = {name for name, _ in samples(render(lambda: snap, dict, lambda: {"ingress-a": 1},
                                                   lambda: {"k": {"admitted": 1}}))}
    assert used and used <= exported, used - exported
    hit_rate = next(p for p in dash["panels"] if p["title"].startswith("Prefix cache hit rate"))
    assert all("multilora_prefix_cache_hit_tokens_total" in t["expr"] and
               "multilora_prefix_cache_query_tokens_total" in t["expr"] for t in hit_rate["targets"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
