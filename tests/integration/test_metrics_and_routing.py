"""Two replicas behind the adapter-affinity router, scraped by a real Prometheus server:
each adapter's requests land on one replica, and the counts reach Prometheus. The replicas
autoscale (two to three): under load a third starts, adapter homes follow the replica set
as it grows and shrinks, and without load it goes back to two."""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest
import yaml

from cluster.admin import ADMIN_NAMESPACE
from cluster.routing import rendezvous_order
from tests.integration.conftest import ADMIN_TOKEN, REPO, free_port, kill_actor

pytestmark = pytest.mark.integration

APP = "multilora"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
ADMIN_ACTOR = "lora_admin_metrics"  # its own registry, apart from the other integration tests
ADAPTERS = ("reverse", "upper")
REQUESTS_PER_ADAPTER = 4
# These replicas run the rank-class pool code with one class (more classes multiply the LoRA ops each
# step program compiles, and two replicas warming up on two cores is this file's setup time; the
# per-class series of several classes are checked in tests/cluster/test_metrics.py).
RANK_CLASSES = [64]
# Two replicas at rest (the tests before the last send one request at a time); quick to grow,
# so that the last test sees the set grow under load and shrink after it. The downscale delay
# covers what that test does between the end of its load and the check of the new replica
# (the load's last requests, registering an adapter, three requests): on two shared cores that
# took over 10 s, and the set shrank under the check.
AUTOSCALING = dict(min_replicas=2, max_replicas=3, target_ongoing_requests=1, upscale_delay_s=1.0,
                   downscale_delay_s=30.0, look_back_period_s=2.0, metrics_interval_s=0.5)


def _class_slots(args: dict) -> dict[int, int]:
    """Slots per rank class of one replica, as the memory plan sizes them for `args`."""
    from cluster.admin import resolve_model_path
    from deployments.config import AppArgs
    from lora_runtime.engine.memory_plan import pool_classes
    from lora_runtime.model.config import ModelConfig

    a = AppArgs(**args)
    return dict(pool_classes(ModelConfig.from_pretrained(resolve_model_path(a.model)), a.engine_config(), 1))


@pytest.fixture(scope="module")
def two_replicas(cluster, tmp_path_factory):
    """The shipped serve_config.yaml with two model-server replicas."""
    root = tmp_path_factory.mktemp("metrics_routing")
    config = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    config["http_options"] = {"host": "127.0.0.1", "port": cluster.http_port}
    args = config["applications"][0]["args"]
    args.update(autoscaling=AUTOSCALING, registry_url=str(root / "registry.json"), admin_actor_name=ADMIN_ACTOR,
                drain_timeout_s=1.0, lora_rank_classes=RANK_CLASSES)
    cluster.class_slots = _class_slots(args)
    path = root / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    cluster.cli("serve", "deploy", str(path), "-a", cluster.dashboard_url)
    cluster.wait_running(APP)
    yield cluster
    cluster.cli("serve", "shutdown", "-y", "-a", cluster.dashboard_url)
    kill_actor(cluster, ADMIN_ACTOR, ADMIN_NAMESPACE, no_restart=True)


@pytest.fixture(scope="module")
def prometheus(two_replicas, tmp_path_factory):
    """A real Prometheus server scraping the ingress's /metrics every second."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise AssertionError("the prometheus binary is missing: apt-get install -y prometheus")
    root = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{
            "job_name": "multilora",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [f"127.0.0.1:{two_replicas.http_port}"]}],
        }],
    }
    (root / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(root / "prometheus.log", "w")
    proc = subprocess.Popen(
        [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError(f"prometheus did not start:\n{(root / 'prometheus.log').read_text()[-2000:]}")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _query(prom: str, expr: str) -> list[dict]:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": expr}, timeout=10)
    r.raise_for_status()
    return r.json()["data"]["result"]


def _wait_for(prom: str, expr: str, want: float, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    result: list[dict] = []
    while time.monotonic() < deadline:
        result = _query(prom, expr)
        if sum(float(s["value"][1]) for s in result) == want:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{expr} never summed to {want}; last {result}")


def _routed(base: str) -> dict[str, float]:
    """The ingress's routing outcomes (multilora_routing_decisions_total by outcome)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return {s.labels["outcome"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "multilora_routing_decisions_total"}


def test_affinity_routing_and_prometheus_scrape(two_replicas, prometheus):
    base = two_replicas.base_url
    routed_before = _routed(base)
    for adapter in ADAPTERS:
        for i in range(REQUESTS_PER_ADAPTER):
            r = httpx.post(f"{base}/v1/completions", timeout=120,
                           json={"model": adapter, "prompt": f"word{i}=", "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text

    text = httpx.get(f"{base}/metrics", timeout=10)
    assert text.status_code == 200
    assert text.headers["content-type"].startswith("text/plain")

    slots = two_replicas.class_slots
    assert sorted(slots) == RANK_CLASSES and sum(slots.values()) == 4  # the bytes of 4 padded slots
    replicas = [s["metric"]["replica"] for s in _wait_for(prometheus, "multilora_adapter_slots",
                                                          2 * sum(slots.values()))]
    assert len(replicas) == 2, replicas
    for rank, n in slots.items():
        _wait_for(prometheus, f'multilora_adapter_class_slots{{rank="{rank}"}}', 2 * n)
    for adapter in ADAPTERS:
        expr = f'multilora_requests_total{{adapter="{adapter}",status="ok"}}'
        try:
            series = _wait_for(prometheus, expr, REQUESTS_PER_ADAPTER)
        except AssertionError as e:
            raise AssertionError(f"{e}\n/metrics now:\n{httpx.get(f'{base}/metrics', timeout=10).text}") from None
        # Every request for one adapter went to one replica: its rendezvous home (then,
        # once the adapter was resident there, its holder).
        assert len(series) == 1, series
        assert float(series[0]["value"][1]) == REQUESTS_PER_ADAPTER
        assert series[0]["metric"]["replica"] == rendezvous_order(adapter, replicas)[0]
    # Scraped after the requests: the adapters they used hold slots of the classes they fit.
    used = _query(prometheus, "sum(multilora_adapter_class_slots_used)")
    assert float(used[0]["value"][1]) >= len(ADAPTERS), used
    # Requests that waited for their adapter's load were counted, never more than the loads.
    [waits] = _query(prometheus, "sum(multilora_adapter_slot_waits_total)")
    [loads] = _query(prometheus, "sum(multilora_adapter_loads_total)")
    assert 1 <= float(waits["value"][1]) <= float(loads["value"][1]), (waits, loads)
    n = REQUESTS_PER_ADAPTER * len(ADAPTERS)
    _wait_for(prometheus, "sum(multilora_time_to_first_token_seconds_count)", n)
    [tokens] = _query(prometheus, "sum(multilora_generation_tokens_total)")
    assert n <= float(tokens["value"][1]) <= 4 * n  # max_tokens=4; a request may stop early
    # The router counted each: to its holder once it held it, never away from one.
    routed = {k: v - routed_before.get(k, 0.0) for k, v in _routed(base).items()}
    assert routed["off_holder"] == 0 and routed["base"] == 0, routed
    assert routed["resident"] >= n - len(ADAPTERS) and sum(routed.values()) == n, routed
    _wait_for(prometheus, 'sum(multilora_routing_decisions_total{outcome!="base"})',
              sum(v for k, v in _routed(base).items() if k != "base"))


def test_prefix_cache_counters_reach_prometheus(two_replicas, prometheus):
    """Two requests sharing a 32-token prefix: the second's cached tokens (as usage reports
    them) are the hit tokens Prometheus sees, every finished prompt token was looked up,
    and the dashboard's hit-rate query gives a rate in (0, 1]."""
    import json

    base = two_replicas.base_url
    adapter = "caesar"  # no other test here sends it: its two requests are the only hits
    shared = "the quick brown fox jumps over "  # 32 tokens with BOS (the demo tokenizer reads characters)
    # Every replica's series are scraped before the requests (each replica exports them from
    # its start, whatever it serves), so Prometheus sees the counters rise.
    _wait_for(prometheus, "multilora_adapter_slots", 2 * sum(two_replicas.class_slots.values()))
    cached = []
    for word in ("hello=", "serving="):
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": adapter, "prompt": shared + word, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and 16 <= cached[1] <= 32, cached

    [series] = _wait_for(prometheus, f'multilora_requests_total{{adapter="{adapter}",status="ok"}}', 2)
    replica = series["metric"]["replica"]
    # The first test's prompts ("word0=", ...) share under 16 tokens: no hits of their own.
    _wait_for(prometheus, "sum(multilora_prefix_cache_hit_tokens_total)", sum(cached))

    def by_replica(expr: str) -> dict[str, float]:
        return {s["metric"]["replica"]: float(s["value"][1]) for s in _query(prometheus, expr)}

    # Every request here could use the cache (none asked for prompt log-probabilities) and
    # all finished: on every replica, whatever it served (maybe nothing), the tokens looked
    # up are the prompt tokens served. Both series exist on a replica from its start.
    query = by_replica("sum by (replica) (multilora_prefix_cache_query_tokens_total)")
    prompt = by_replica("sum by (replica) (multilora_prompt_tokens_total)")
    assert len(query) == 2 and query == prompt, (query, prompt)
    hits = by_replica("multilora_prefix_cache_hit_tokens_total")
    assert hits[replica] == sum(cached) and all(hits[r] <= query[r] for r in hits)
    # The second request computed the rest of its prompt over the cached prefix.
    assert by_replica("multilora_extend_steps_total")[replica] >= 1

    dash = json.loads((REPO / "cluster" / "grafana" / "multilora.json").read_text())
    panel = next(p for p in dash["panels"] if p["title"].startswith("Prefix cache hit rate"))
    deadline = time.monotonic() + 30
    while True:
        rate = [float(s["value"][1]) for s in _query(prometheus, panel["targets"][0]["expr"])]
        if rate and rate[0] > 0:
            break
        assert time.monotonic() < deadline, f"{panel['targets'][0]['expr']} gave {rate}"
        time.sleep(0.5)
    assert 0 < rate[0] <= 1


def test_made_up_model_names_become_no_series(two_replicas, prometheus):
    """Requests naming models that do not exist (misspelt, fuzzed, unicode) are 404s at the edge,
    naming the model, and leave no label value behind: the adapter label of every series is the
    base model, a registered adapter, "other" or "unknown"."""
    base = two_replicas.base_url
    names = [f"fuzz-{i}" for i in range(25)] + ["ünïcödé-名前", "../../etc", "a" * 200, "reverse "]
    for name in names:
        for path, body in (("/v1/completions", {"prompt": "x=", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                           ("/tokenize", {"prompt": "x"})):
            r = httpx.post(f"{base}{path}", json={"model": name, **body}, timeout=60)
            assert r.status_code == 404, (path, name, r.text)
            error = r.json()["error"]
            assert error["param"] == "model" and error["type"] == "not_found_error" and repr(name) in error["message"]
    expr = 'multilora_requests_total{adapter="reverse",status="ok"}'
    served = sum(float(s["value"][1]) for s in _query(prometheus, expr))
    r = httpx.post(f"{base}/v1/completions", json={"model": "reverse", "prompt": "abc=", "max_tokens": 4,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    _wait_for(prometheus, expr, served + 1, timeout=60)  # scraped after the 404s: they left nothing
    registered = {m["id"] for m in httpx.get(f"{base}/v1/models", timeout=30).json()["data"]}
    labels = {s["metric"]["adapter"] for s in _query(prometheus, "multilora_requests_total")}
    assert labels <= registered | {"base", "other", "unknown"}, labels - registered
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert not any(f'adapter="{name}"' in text for name in names)


def _live_replicas(base: str) -> set[str]:
    """The replicas running now, as the ingress's /metrics lists them (it keeps no others)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return set(re.findall(r'^multilora_adapter_slots\{[^}]*replica="([^"]+)"', text, re.M))


def _served_by(base: str, adapter: str) -> dict[str, float]:
    """Per running replica, the requests for `adapter` it finished."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    pattern = r'^multilora_requests_total\{(?=[^}]*adapter="%s")(?=[^}]*status="ok")[^}]*replica="([^"]+)"[^}]*\} (\S+)'
    return {r: float(v) for r, v in re.findall(pattern % re.escape(adapter), text, re.M)}


def _wait_replicas(base: str, want: int, timeout: float) -> set[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        live = _live_replicas(base)
        if len(live) == want:
            return live
        time.sleep(1.0)
    raise AssertionError(f"{want} replicas not running after {timeout:g} s: {sorted(_live_replicas(base))}")


def _home_of(base: str, name: str, replicas: set[str], requests: int = 3) -> str:
    """Sends `requests` requests for `name` one at a time; the one replica that served them."""
    before = _served_by(base, name)
    for i in range(requests):
        r = httpx.post(f"{base}/v1/completions", timeout=120,
                       json={"model": name, "prompt": f"home{i}=", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30  # replicas publish their counters once a second
    while True:
        after = _served_by(base, name)
        served = {rid: n - before.get(rid, 0.0) for rid, n in after.items() if n - before.get(rid, 0.0) > 0}
        if sum(served.values()) >= requests or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(served) == 1 and set(served) <= replicas, served
    return next(iter(served))


def _other_weights(source: str, out_dir) -> object:
    """A copy of the adapter at `source` with its B matrices scaled: other content, same shapes."""
    import json
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(Path(source) / "adapter_model.safetensors"))
    save_file({k: v * 1.5 if "lora_B" in k else v for k, v in tensors.items()},
              str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(json.loads((Path(source) / "adapter_config.json")
                                                                      .read_text())))
    return out_dir


def test_replicas_scale_with_load_and_adapter_homes_follow_them(two_replicas, tmp_path):
    """Load grows the set to three replicas; a new adapter name whose rendezvous home among
    them is the new replica is served there; without load the set goes back to two, and the
    name's requests go to its home among those two (or the replica holding it)."""
    from cluster.admin import demo_adapter_sources

    base = two_replicas.base_url
    before = _wait_replicas(base, 2, timeout=60)
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                httpx.post(f"{base}/v1/completions", timeout=120,
                           json={"model": "reverse", "prompt": "scaling=", "max_tokens": 40, "temperature": 1.0})
            except httpx.HTTPError:  # e.g. while a replica starts on the same cores: the load goes on
                pass

    workers = [threading.Thread(target=load) for _ in range(10)]
    for w in workers:
        w.start()
    try:
        grown = _wait_replicas(base, 3, timeout=240)
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=180)
    load_end = time.monotonic()
    [new] = grown - before
    # A name homed on the new replica, registered now with weights of its own (a name for
    # weights some replica holds is held there already), so routing sends it home.
    name = next(f"home-{i}" for i in range(200) if rendezvous_order(f"home-{i}", sorted(grown))[0] == new)
    r = httpx.post(f"{base}/v1/adapters", headers=ADMIN, timeout=120,
                   json={"name": name, "source": str(_other_weights(demo_adapter_sources()["upper"], tmp_path))})
    assert r.status_code == 201, r.text
    home = _home_of(base, name, grown)
    still = _live_replicas(base)
    assert still == grown, (f"the replica set changed under the check ({sorted(grown)} -> {sorted(still)}), "
                            f"{time.monotonic() - load_end:.1f} s after the load: raise downscale_delay_s")
    assert home == new
    shrunk = _wait_replicas(base, 2, timeout=180)
    assert shrunk < grown
    assert _home_of(base, name, shrunk) == rendezvous_order(name, sorted(shrunk))[0]
