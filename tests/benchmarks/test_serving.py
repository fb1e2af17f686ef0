"""The serving benchmark's pieces at tiny settings, so it keeps working: the workload generator,
the metrics-text parsing, percentiles and summaries, the choice of the last line, and the PEFT
peer's per-row streaming."""

import collections
import math
import statistics
from pathlib import Path

import pytest

from benchmarks import serving
from benchmarks.peft_server import _Pending, _RowStreamer
from benchmarks.serving_workload import (
    RequestRecord,
    RunSummary,
    WorkloadSpec,
    adapter_counters,
    load_imbalance,
    counter_delta,
    off_holder_share,
    make_workload,
    parse_prometheus,
    percentile,
    summarize,
    zipf_weights,
)
from cluster.metrics import ReplicaMetrics, render
from lora_runtime.demo import demo_model_dir
from lora_runtime.lora.manager import LoRAStats
from lora_runtime.model.tokenizer import Tokenizer


def spec(**kw) -> WorkloadSpec:
    base = dict(num_adapters=8, alpha=1.0, rate=50.0, max_requests=100, max_duration_s=1000.0,
                input_len=(8, 16), output_len=(4, 12), seed=0)
    return WorkloadSpec(**(base | kw))


def test_zipf_weights_by_hand():
    assert zipf_weights(3, 1.0) == pytest.approx([6 / 11, 3 / 11, 2 / 11])
    assert zipf_weights(4, 0.0) == pytest.approx([0.25] * 4)
    w = zipf_weights(64, 0.6)
    assert sum(w) == pytest.approx(1.0) and w[0] / w[1] == pytest.approx(2**0.6)


def test_adapters_are_drawn_with_zipf_counts():
    items = make_workload(spec(max_requests=20000, rate=1e4))
    counts = collections.Counter(i.adapter for i in items)
    assert set(counts) <= set(range(8))
    for rank, p in enumerate(zipf_weights(8, 1.0)):
        assert counts[rank] / len(items) == pytest.approx(p, rel=0.1)


def test_one_adapter_takes_every_request():
    assert {i.adapter for i in make_workload(spec(num_adapters=1))} == {0}


def test_arrivals_are_poisson_at_the_rate():
    items = make_workload(spec(max_requests=5000, rate=20.0))
    gaps = [b.send_at_s - a.send_at_s for a, b in zip(items, items[1:])]
    assert min(gaps) >= 0
    assert statistics.mean(gaps) == pytest.approx(1 / 20.0, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1


def test_lengths_are_uniform_in_their_ranges_and_prompts_have_that_many_tokens():
    items = make_workload(spec(max_requests=2000, input_len=(5, 9), output_len=(3, 6)))
    assert {i.prompt_tokens for i in items} == set(range(5, 10))
    assert {i.max_tokens for i in items} == set(range(3, 7))
    tokenizer = Tokenizer.from_pretrained(demo_model_dir())
    for item in items[:50]:
        assert len(tokenizer.encode(item.prompt)) == item.prompt_tokens


def test_a_run_is_bounded_in_requests_and_time_and_the_same_for_the_same_seed():
    assert len(make_workload(spec(max_requests=30, rate=1000.0))) == 30
    timed = make_workload(spec(max_requests=10**6, rate=100.0, max_duration_s=2.0))
    assert 150 < len(timed) < 250 and timed[-1].send_at_s < 2.0
    assert make_workload(spec()) == make_workload(spec())
    assert make_workload(spec()) != make_workload(spec(seed=1))


@pytest.mark.parametrize("bad", [dict(num_adapters=0), dict(rate=0.0), dict(max_requests=0),
                                 dict(input_len=(2, 8)), dict(input_len=(9, 8)), dict(output_len=(0, 4))])
def test_specs_out_of_range_are_refused(bad):
    with pytest.raises(ValueError):
        spec(**bad)


def test_percentiles_by_hand():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0 and percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_of_records():
    records = [
        RequestRecord(sent=0.0, first_token=0.5, last_token=1.5, completion_tokens=11),  # TPOT 0.1 s
        RequestRecord(sent=1.0, first_token=4.0, last_token=4.0, completion_tokens=1),  # TTFT 3 s: SLO miss
        RequestRecord(sent=2.0, error="http 503"),
    ]
    s = summarize(records, slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert (s.requests, s.errors) == (3, 1)
    assert s.requests_per_s == pytest.approx(2 / 4.0) and s.output_tokens_per_s == pytest.approx(12 / 4.0)
    assert s.ttft_p50_ms == pytest.approx(1750.0) and s.tpot_p99_ms == pytest.approx(100.0)
    assert s.slo_attainment == pytest.approx(1 / 3)
    none_ok = summarize([RequestRecord(sent=0.0, error="x")], slo_ttft_s=2.0, slo_tpot_s=0.2)
    assert none_ok.requests_per_s == 0.0 and math.isnan(none_ok.ttft_p99_ms) and none_ok.slo_attainment == 0.0


def _metrics_text(loads: list[int]) -> str:
    snaps = {f"replica-{i}": ReplicaMetrics().snapshot({}, LoRAStats(loads=n, host_misses=1, fetches=1), 1, 8)
             for i, n in enumerate(loads)}
    return render(lambda: snaps).decode()


def test_adapter_counters_are_read_from_metrics_text_over_replicas():
    text = _metrics_text([3, 4])
    samples = parse_prometheus(text)
    assert samples[("multilora_adapter_loads_total", (("replica", "replica-1"),))] == 4
    got = adapter_counters(text)
    assert (got["loads"], got["host_misses"], got["fetches"], got["evictions"]) == (7, 2, 2, 0)
    assert adapter_counters("") == {k: 0.0 for k in got if not k.startswith("tokens@")}


def test_each_replicas_generated_tokens_give_the_load_imbalance():
    snaps = {}
    for replica, tokens in (("replica-0", {"a": 30, "b": 10}), ("replica-1", {"a": 20}), ("replica-2", {})):
        m = ReplicaMetrics()
        for adapter, n in tokens.items():
            m.start(adapter).finish("ok", prompt_tokens=4, completion_tokens=n)
        snaps[replica] = m.snapshot({}, LoRAStats(), 0, 8)
    got = adapter_counters(render(lambda: snaps).decode())
    assert {k: v for k, v in got.items() if k.startswith("tokens@")} == {
        "tokens@replica-0": 40, "tokens@replica-1": 20, "tokens@replica-2": 0}
    assert load_imbalance(got) == pytest.approx(40 / 20)  # the busiest over the mean of 60 / 3
    assert load_imbalance({"tokens@r0": 5.0, "tokens@r1": 5.0}) == 1.0
    assert math.isnan(load_imbalance({"tokens@r0": 0.0})) and math.isnan(load_imbalance({"loads": 3.0}))


def test_routing_outcomes_are_read_and_the_off_holder_share_counts_adapter_requests_only():
    text = render(dict, lambda: {"resident": 5, "host": 1, "off_holder": 2, "base": 9}).decode()
    got = adapter_counters(text)
    assert (got["routed_resident"], got["routed_off_holder"], got["routed_placed"], got["routed_base"]) == (5, 2, 0, 9)
    assert off_holder_share(got) == pytest.approx(2 / 8)
    assert math.isnan(off_holder_share(adapter_counters(_metrics_text([1]))))  # no router counts (a peer)


def test_counter_delta_counts_a_reset_counter_from_zero():
    assert counter_delta({"loads": 5.0, "fetches": 2.0}, {"loads": 9.0, "fetches": 1.0}) == {"loads": 4.0,
                                                                                             "fetches": 1.0}


def _result(system: str, rate: float, rps: float, tok_s: float, ttft_p99_ms: float) -> serving.Result:
    s = RunSummary(requests=10, errors=0, requests_per_s=rps, output_tokens_per_s=tok_s, ttft_p50_ms=1.0,
                   ttft_p99_ms=ttft_p99_ms, tpot_p50_ms=5.0, tpot_p99_ms=9.0, slo_attainment=1.0)
    return serving.Result(system, spec(num_adapters=64, rate=rate), s, None)


def test_last_line_is_at_the_highest_rate_within_the_ttft_bound():
    results = [_result("ours", 4.0, 4.0, 40.0, 300.0), _result("ours", 8.0, 7.0, 70.0, 1500.0),
               _result("ours", 16.0, 8.0, 80.0, 5000.0), _result("base", 8.0, 7.0, 71.0, 900.0),
               _result("serve-default", 8.0, 3.5, 35.0, 4000.0), _result("peft", 8.0, 1.4, 14.0, 9000.0)]
    line, notes = serving.headline(results, slo_ttft_s=2.0)
    assert line == ("lora_over_base_throughput=1.0000 ttft_p99_ms=1500.00 tpot_p99_ms=9.00 "
                    "routing_gain_vs_serve_default=2.0000 speedup_vs_peft=5.0000")
    assert notes == ["last line: n=64, alpha=1.0, rate=8.0 req/s"]


def test_last_line_falls_back_to_the_lowest_rate_and_names_missing_peers():
    line, notes = serving.headline([_result("ours", 4.0, 2.0, 20.0, 3000.0), _result("ours", 8.0, 2.0, 20.0, 6000.0)],
                                   slo_ttft_s=2.0)
    assert "routing_gain_vs_serve_default=nan" in line and "speedup_vs_peft=nan" in line
    assert any("lowest rate" in n for n in notes) and any("peft has no run at rate 4.0" in n for n in notes)
    assert serving.headline([], slo_ttft_s=2.0)[0].startswith("lora_over_base_throughput=nan")


class _Tokens(list):
    def tolist(self):
        return list(self)


def test_peft_rows_stream_exactly_their_own_max_tokens():
    events = {0: [], 1: []}
    batch = [_Pending(name, "ab=", n, True, lambda kind, payload, i=i: events[i].append((kind, payload)))
             for i, (name, n) in enumerate([("a", 2), ("b", 3)])]
    streamer = _RowStreamer(batch, lambda token, skip: f"<{token}>", prompt_tokens=[4, 4])
    streamer.put([[1, 2, 3], [1, 2, 3]])  # the prompt ids: not streamed
    for step in range(3):
        streamer.put(_Tokens([10 + step, 20 + step]))
    streamer.end()
    assert events[0] == [("token", "<10>"), ("token", "<11>"), ("done", (4, 2))]
    assert events[1] == [("token", "<20>"), ("token", "<21>"), ("token", "<22>"), ("done", (4, 3))]


@pytest.mark.slow
def test_peft_peer_serves_mixed_adapter_batches_as_each_adapter_alone(tmp_path):
    """The PEFT peer (random PEFT adapters of the demo model) streams over HTTP, and a mixed batch
    gives each row what its adapter gives alone."""
    import json

    from fastapi.testclient import TestClient

    from benchmarks.peft_adapters import write_random_peft_adapters
    from benchmarks.peft_server import BASE_ADAPTER, PeftBatcher, make_app

    sources = write_random_peft_adapters(demo_model_dir(), str(tmp_path), ["a0", "a1"], r=8, alpha=16, seed=0)
    batcher = PeftBatcher(demo_model_dir(), sources)
    rows = [("a0", "hello=", 6), ("a1", "serving=", 4), (BASE_ADAPTER, "abc=", 5)]

    def tokens_of(batch_rows):
        got = [[] for _ in batch_rows]
        batch = [_Pending(a, p, n, True, lambda kind, payload, i=i: kind == "token" and got[i].append(payload))
                 for i, (a, p, n) in enumerate(batch_rows)]
        batcher.run_batch(batch)
        return got

    mixed = tokens_of(rows)
    assert [len(t) for t in mixed] == [6, 4, 5]
    assert mixed == [tokens_of([row])[0] for row in rows]
    words = [("hello=", 6), ("serving=", 6), ("abc=", 6)]  # B is not zero: the adapter changes answers
    assert tokens_of([("a0", *w) for w in words]) != tokens_of([(BASE_ADAPTER, *w) for w in words])

    batcher.start()
    with TestClient(make_app(batcher, base_name="demo")) as client:
        body = {"model": "a1", "prompt": "serving=", "max_tokens": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "".join(mixed[1])
        assert chunks[-1]["usage"] == {"prompt_tokens": 9, "completion_tokens": 4, "total_tokens": 13}
        assert client.post("/v1/completions", json=dict(body, model="nope")).status_code == 404
        assert client.post("/v1/completions", json=dict(body, temperature=0.7)).status_code == 422


def test_the_wider_demo_is_the_demo_vocabulary_at_another_shape(tmp_path):
    """--hidden serves the demo tokenizer on a random Llama of that width, loadable by
    transformers (the PEFT peer) and by our loader alike."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.serving import parse_args, wider_demo
    from lora_runtime.model.config import ModelConfig

    out = wider_demo(str(tmp_path / "wide"), 256, 3)
    hf = AutoConfig.from_pretrained(out)
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads) == (256, 3, 4, 1)
    demo = json.loads((Path(demo_model_dir()) / "config.json").read_text())
    # Only the ids the tokenizer has (the demo's padded rows would be sampled by random weights).
    assert hf.vocab_size == Tokenizer.from_pretrained(demo_model_dir()).vocab_size < demo["vocab_size"]
    assert hf.eos_token_id == demo["eos_token_id"]
    assert AutoTokenizer.from_pretrained(out)("hello").input_ids == AutoTokenizer.from_pretrained(
        demo_model_dir())("hello").input_ids
    ours = ModelConfig.from_pretrained(out)
    assert (ours.hidden_size, ours.num_layers, ours.intermediate_size) == (256, 3, 704)
    with pytest.raises(SystemExit):
        parse_args(["--hidden", "100"])  # not a multiple of 64
    with pytest.raises(SystemExit):
        parse_args(["--layers", "4"])  # without --hidden


def test_throughput_optimized_serve_is_for_local_deployments_only():
    assert serving.parse_args(["--quick", "--serve-throughput-optimized"]).serve_throughput_optimized
    assert not serving.parse_args(["--quick"]).serve_throughput_optimized
    with pytest.raises(SystemExit):
        serving.parse_args(["--quick", "--serve-throughput-optimized", "--url", "http://127.0.0.1:8000"])


@pytest.mark.parametrize("flag, arg", [("--stream-interval", "stream_interval"),
                                       ("--ingress-replicas", "ingress_replicas")])
def test_app_arg_flags_reach_the_local_deployments_only(flag, arg):
    """Flags that set an app arg of the local deployments (default 1, at least 1), refused
    with --url (that deployment has its own)."""
    a = serving.parse_args(["--quick", flag, "3"])
    for affinity in (True, False):
        assert serving.app_args(a, "registry.json", affinity=affinity)[arg] == 3
    assert serving.app_args(serving.parse_args(["--quick"]), "r.json", affinity=False)[arg] == 1
    for bad in ([flag, "0"], [flag, "2", "--url", "http://127.0.0.1:8000"]):
        with pytest.raises(SystemExit):
            serving.parse_args(["--quick", *bad])


def test_systems_take_turns_each_round_and_count_their_best(monkeypatch):
    """run_systems: each round sends the workload to every system in turn; each system's result is
    its round of most requests/s, with every round's requests/s kept; a deployment's counters
    are read once before its first run and carried from run to run."""
    order, scrapes = [], []
    rps = {("base", 0): 9.0, ("ours", 0): 5.0, ("serve-default", 0): 6.0,
           ("base", 1): 8.0, ("ours", 1): 7.0, ("serve-default", 1): 4.0}

    def run_once(system, url, spec_, model_of, a, before):
        round_ = sum(1 for s, r in order if (s, r) == (system, spec_.rate))
        order.append((system, spec_.rate))
        s = RunSummary(requests=10, errors=0, requests_per_s=rps[(system, round_)], output_tokens_per_s=1.0,
                       ttft_p50_ms=1.0, ttft_p99_ms=round_, tpot_p50_ms=1.0, tpot_p99_ms=1.0, slo_attainment=1.0)
        assert before == {"runs": sum(1 for s, _ in order[:-1] if urls[s] == url)}
        return serving.Result(system, spec_, s, {}), {"runs": before["runs"] + 1}

    urls = {"base": "http://a", "ours": "http://a", "serve-default": "http://b"}
    monkeypatch.setattr(serving, "run_once", run_once)
    monkeypatch.setattr(serving, "_warm_up", lambda *args: None)
    monkeypatch.setattr(serving, "_scrape", lambda url: scrapes.append(url) or {"runs": 0})
    monkeypatch.setattr(serving, "_METRICS_SETTLE_S", 0.0)
    specs = [spec(num_adapters=8, rate=4.0), spec(num_adapters=8, rate=8.0)]
    results = serving.run_systems(urls, specs, dict.fromkeys(urls), None, metrics=True, rounds=2)
    assert sorted(scrapes) == ["http://a", "http://b"]  # once each, before the first runs
    assert order[:6] == [(s, 4.0) for s in ("base", "ours", "serve-default")] * 2
    assert order[6:9] == [(s, 8.0) for s in ("base", "ours", "serve-default")]
    first = {r.system: r for r in results if r.spec.rate == 4.0}
    assert {s: r.summary.requests_per_s for s, r in first.items()} == {"base": 9.0, "ours": 7.0, "serve-default": 6.0}
    assert {s: r.summary.ttft_p99_ms for s, r in first.items()} == {"base": 0, "ours": 1, "serve-default": 0}
    assert first["ours"].rounds_rps == (5.0, 7.0)


def test_apps_sharing_a_cluster_need_their_own_admins():
    from benchmarks.serve_harness import served_apps

    with pytest.raises(ValueError, match="distinct admin_actor_name"):
        with served_apps({"a": {"admin_actor_name": "x"}, "b": {"admin_actor_name": "x"}}):
            pass


def test_pinned_replicas_are_for_local_deployments_only():
    assert serving.parse_args(["--quick", "--pin-replicas"]).pin_replicas
    assert not serving.parse_args(["--quick"]).pin_replicas
    with pytest.raises(SystemExit):
        serving.parse_args(["--quick", "--pin-replicas", "--url", "http://127.0.0.1:8000"])


def test_stream_interval_ms_reaches_the_local_deployments_only():
    a = serving.parse_args(["--quick", "--stream-interval-ms", "50"])
    assert serving.app_args(a, "r.json", affinity=True)["stream_interval_ms"] == 50
    assert serving.app_args(serving.parse_args(["--quick"]), "r.json", affinity=True)["stream_interval_ms"] == 0
    for bad in (["--stream-interval-ms", "-1"], ["--stream-interval-ms", "50", "--url", "http://127.0.0.1:8000"]):
        with pytest.raises(SystemExit):
            serving.parse_args(["--quick", *bad])


@pytest.mark.slow
def test_benchmark_runs_end_to_end_at_a_tiny_setting():
    """`python -m benchmarks.serving` at a tiny setting (1 replica, 8 adapters, one rate, Serve's
    routing skipped, the demo vocabulary on a random 2-layer model, the replica's XLA compute
    threads pinned to a core): a deployment and the PEFT peer, the table and the last line."""
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "benchmarks.serving", "--adapters", "8", "--rates", "4", "--requests", "6",
           "--duration", "3", "--drain", "60", "--input-len", "6", "8", "--output-len", "4", "6", "--replicas", "1",
           "--peft-batch-sizes", "1", "4", "--skip", "serve-default", "--hidden", "128", "--layers", "2",
           "--pin-replicas"]
    done = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert re.search(r"XLA compute threads of the replicas: affinity [1-9]\d* on core \d+\n", done.stderr), \
        done.stderr[-3000:]
    assert "replicas compute on a core each" in done.stdout.split("serving over HTTP: ")[1].splitlines()[0], done.stdout
    assert re.fullmatch(r"lora_over_base_throughput=[\d.]+ ttft_p99_ms=[\d.]+ tpot_p99_ms=[\d.]+ "
                        r"routing_gain_vs_serve_default=nan speedup_vs_peft=[\d.]+", lines[-1]), lines[-1]
    rows = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["base"], ["ours"], ["peft"])}
    assert set(rows) == {"base", "ours", "peft"}
    assert all(row[5] == "0" for row in rows.values()), rows  # no errors
    assert not [line for line in lines if re.match(r"(ours|serve-default|peft) failed: ", line)], done.stdout
    # Where the CPU went in each system's run: the replicas and the client for ours, the PEFT
    # server and the client for PEFT (threads under 1 % of the machine are left out).
    tables = done.stdout.split("CPU time of the ")[1:]
    assert [t.split()[0] for t in tables] == ["base", "peft", "ours"], done.stdout
    ours, peft = tables[2], tables[1]
    assert "model server" in ours and "ingress" in ours and "client" in ours, ours
    assert "PEFT server" in peft and "model server" not in peft, peft


def test_local_deployments_unroll_their_layers_on_a_cpu_host():
    from deployments.config import AppArgs

    auto = serving.app_args(serving.parse_args(["--quick"]), "r.json", affinity=True)
    assert auto["scan_layers"] is False  # this host computes on its CPU
    assert AppArgs(**{k: v for k, v in auto.items() if k != "model"}, model="demo").scan_layers is False
    on = serving.app_args(serving.parse_args(["--quick", "--scan-layers", "true"]), "r.json", affinity=False)
    assert on["scan_layers"] is True
    with pytest.raises(SystemExit):
        serving.parse_args(["--quick", "--scan-layers", "maybe"])
