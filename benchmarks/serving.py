"""End-to-end serving over HTTP: one Zipf-popularity, Poisson-arrival workload of streamed
completions sent to our deployment and, in the same run, to its peers.

    python -m benchmarks.serving [--quick] [--adapters 64] [--alpha 1.0] [--rates 2 4 8 16]
        [--requests N] [--duration S] [--input-len LO HI] [--output-len LO HI] [--replicas R] [--rounds K]
        [--pin-replicas] [--url URL]

As S-LoRA, Punica and dLoRA measure it: `--adapters` random rank-8 PEFT adapters of the demo
model (written by PEFT, registered through the admin API), adapter i drawn with probability
proportional to 1 / i**alpha, Poisson arrivals at each rate of `--rates`, prompt and output
lengths uniform in their ranges (tokens), each run bounded by `--requests` and `--duration`.
The same requests (same seed) go to:

- `base`: every request on the base model, on our deployment (the ceiling);
- `serve-default`: our deployment with Serve's own multiplexed routing (`adapter_affinity_routing: false`);
- `peft`: transformers + PEFT with the same adapters loaded, mixed-adapter batches through
  `generate(adapter_names=...)`, behind the same client (benchmarks/peft_server.py), at its
  fastest batch size;
- `ours`: our deployment, adapter-affinity routing (the default).

Our app and the same app with Serve's routing run side by side on one local Ray cluster on
loopback (benchmarks/serve_harness.py), with the same app args; `--url` targets a running
deployment on this host instead (then `ours` and `base` run there and `serve-default` is
skipped). Each workload runs `--rounds` times on each deployed system, the systems taking turns
(base, ours, serve-default, then again), so the host's drift falls on all alike; each system
counts its round of most requests/s, and the table shows every round's. Per run: requests/s and
output tokens/s (from the first send to the last token), TTFT and TPOT p50/p99, errors, SLO
attainment (TTFT <= `--slo-ttft-s` and TPOT <= `--slo-tpot-s`), and from the deployment's
`GET /metrics` the adapter loads into device slots (slot misses), host-cache misses and storage
fetches of the run, and the share of adapter requests the router sent away from a replica
holding the adapter (`off holder`: the load bound or a hot adapter's extra home moved it;
`multilora_routing_decisions_total`), and the busiest replica's generated tokens over the
replicas' mean (`max/mean tokens`, what the load bound bounds).

After the table, where this host's CPU time went during each system's run at the last line's
setting and rate, by process and thread (benchmarks/cpu_shares.py): without an accelerator, the
client, the HTTP proxy, the ingress and the replicas' serving threads share the cores that
compute the model. `--pin-replicas` gives each replica's XLA compute threads a core of their
own, as replicas on devices of their own. `--serve-throughput-optimized` starts the local
deployments with Ray Serve's `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`. The local deployments run their layers unrolled on a
CPU host (`scan_layers: false`, as a CPU deployment should: see `--scan-layers`).

Last line, for n=64, alpha=1.0 (else the last setting swept), at the highest rate whose `ours`
p99 TTFT is under `--slo-ttft-s` (else the lowest rate): `lora_over_base_throughput=<f>
ttft_p99_ms=<f> tpot_p99_ms=<f> routing_gain_vs_serve_default=<f> speedup_vs_peft=<f>`
(our requests/s over base's and over serve-default's; our output tokens/s over PEFT's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence

import httpx

from benchmarks.common import print_table
from benchmarks.cpu_shares import XLA_COMPUTE_THREADS, CpuShares, command_line, delta, pids_of_role, pin, snapshot
from benchmarks.serve_harness import ServedApp, free_port, served_apps
from benchmarks.serving_client import run_workload
from benchmarks.serving_workload import (
    RunSummary,
    WorkloadSpec,
    adapter_counters,
    counter_delta,
    headline_rate,
    load_imbalance,
    make_workload,
    off_holder_share,
    summarize,
)
from cluster.routing import ROUTING_OUTCOMES

ADAPTER_COUNTS = (1, 8, 64, 512)
ALPHAS = (0.6, 1.0)
HEADLINE = (64, 1.0)  # (adapters, alpha) of the last line
ADAPTER_RANK = 8
# /metrics shows what replicas published, every second (deployments/app.py); wait past two periods.
_METRICS_SETTLE_S = 2.5
_PEFT_START_TIMEOUT_S = 600.0
_SYSTEM_ORDER = {"base": 0, "serve-default": 1, "peft": 2, "ours": 3}  # in tables


@dataclasses.dataclass(frozen=True)
class Result:
    """One system's run of one workload."""

    system: str
    spec: WorkloadSpec
    summary: RunSummary
    counters: dict[str, float] | None  # adapter counters the run added (None: not our deployment)
    cpu: CpuShares | None = None  # where this host's CPU time went during the run
    rounds_rps: tuple[float, ...] = ()  # requests/s of every round of this system and workload (run_systems)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def app_args(a: argparse.Namespace, registry_url: str, *, affinity: bool, admin: str = "lora_admin") -> dict:
    """The app args of every local deployment, differing only in routing (and registry file and
    admin actor, for apps sharing a cluster)."""
    return dict(model=a.model, num_replicas=a.replicas, max_batch=16, max_seq_len=a.max_seq_len,
                admin_actor_name=admin,
                max_loras_per_batch=a.slots, max_lora_rank=16, max_cpu_loras=a.host_cache, registry_url=registry_url,
                adapter_affinity_routing=affinity, stream_interval=a.stream_interval,
                stream_interval_ms=a.stream_interval_ms, ingress_replicas=a.ingress_replicas,
                scan_layers=a.scan_layers)


def adapter_names(n: int) -> list[str]:
    """Adapter i's name; i is its popularity rank."""
    return [f"zipf-{i:04d}" for i in range(n)]


def _scrape(url: str) -> dict[str, float]:
    r = httpx.get(f"{url}/metrics", timeout=60)
    r.raise_for_status()
    return adapter_counters(r.text)


def _warm_up(url: str, spec: WorkloadSpec, model_of: Callable) -> None:
    """A burst of requests at once, unrecorded, so first-use costs fall outside the runs."""
    burst = dataclasses.replace(spec, rate=1000.0, max_requests=16, max_duration_s=1.0, seed=spec.seed + 1)
    records = run_workload(url, make_workload(burst), model_of, drain_s=300.0)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"warm-up requests failed at {url}: {failed[:3]}")


def run_once(system: str, url: str, spec: WorkloadSpec, model_of: Callable, a: argparse.Namespace,
             before: dict[str, float] | None) -> tuple[Result, dict[str, float] | None]:
    """One workload sent to `url` as `system`; with `before` (the deployment's adapter counters
    when the run starts) its counters are read after it too. Returns the result and the
    counters after it (None without `before`)."""
    started = time.monotonic()
    threads = snapshot()
    records = run_workload(url, make_workload(spec), model_of, a.drain)
    cpu = delta(threads, snapshot(), time.monotonic() - started)
    counters = after = None
    if before is not None:
        time.sleep(_METRICS_SETTLE_S)
        after = _scrape(url)
        counters = counter_delta(before, after)
    summary = summarize(records, slo_ttft_s=a.slo_ttft_s, slo_tpot_s=a.slo_tpot_s)
    if counters is not None:
        _progress("  routed: " + ", ".join(f"{o} {int(counters[f'routed_{o}'])}" for o in ROUTING_OUTCOMES))
    _progress(f"  {system} n={spec.num_adapters} alpha={spec.alpha} rate={spec.rate}: "
              f"{summary.requests} requests, {summary.errors} errors, {summary.requests_per_s:.2f} req/s, "
              f"TTFT p99 {summary.ttft_p99_ms:.0f} ms ({time.monotonic() - started:.0f} s)")
    return Result(system, spec, summary, counters, cpu), after


def run_systems(systems: Mapping[str, str], specs: Sequence[WorkloadSpec], models: Mapping[str, Callable],
                a: argparse.Namespace, *, metrics: bool, rounds: int = 1) -> list[Result]:
    """Every workload of `specs` sent to each system ({system: url}) `rounds` times, the systems
    taking turns within each round (so the host's drift falls on all alike); each system's
    result for a workload is its round of most requests/s (Result.rounds_rps: every round's).
    With `metrics`, the adapter counters of each deployment's /metrics are read around its runs."""
    last: dict[str, dict[str, float]] = {}
    for system, url in systems.items():
        _warm_up(url, specs[0], models[system])
    if metrics:
        time.sleep(_METRICS_SETTLE_S)  # so the warm-ups' loads count before the first run
        last = {url: _scrape(url) for url in set(systems.values())}
    results = []
    for spec in specs:
        runs: dict[str, list[Result]] = {system: [] for system in systems}
        for _ in range(rounds):
            for system, url in systems.items():
                result, after = run_once(system, url, spec, models[system], a, last.get(url))
                if after is not None:
                    last[url] = after
                runs[system].append(result)
        for system, tried in runs.items():
            best = max(tried, key=lambda r: r.summary.requests_per_s)
            results.append(dataclasses.replace(best, rounds_rps=tuple(r.summary.requests_per_s for r in tried)))
    return results


def _models(base_name: str, names: Sequence[str]) -> dict[str, Callable]:
    """Each system's model name for a work item: the base model's, or the item's adapter."""
    def adapter(item) -> str:
        return names[item.adapter]

    return {"base": lambda item: base_name, "ours": adapter, "serve-default": adapter, "peft": adapter}


def run_deployments(a, specs, sources: dict[str, str], base_name: str, tmp: str,
                    systems: Sequence[str]) -> list[Result]:
    """Deploys our app (and, for serve-default, the same app with Serve's routing) on one local
    cluster, or uses `--url`; registers the adapters; runs `systems` on them, taking turns."""
    models = _models(base_name, list(sources))
    if a.url:
        app = ServedApp(a.url.rstrip("/"), os.environ.get(a.admin_token_env, ""))
        return _on_apps(a, {s: app for s in systems if s != "serve-default"}, specs, sources, models)
    labels = {"ours": "affinity", "base": "affinity", "serve-default": "multiplex"}
    args = {label: app_args(a, f"{tmp}/registry-{label}.json", affinity=label == "affinity",
                            admin=f"lora_admin_{label}")
            for label in dict.fromkeys(labels[s] for s in systems)}
    _progress(f"deploying {' and '.join(args)} routing, {a.replicas} model-server replicas each")
    started = time.monotonic()
    # Ray's CPU count is bookkeeping: room for every replica (one CPU each), the ingresses and the admins.
    env = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1"} if a.serve_throughput_optimized else None
    with served_apps(args, num_cpus=max(4, len(args) * (a.replicas + 2)), env=env) as apps:
        _progress(f"  up in {time.monotonic() - started:.0f} s")
        if a.pin_replicas:
            _progress("  " + pin_replicas(list(apps), a.replicas))
        return _on_apps(a, {s: apps[labels[s]] for s in systems}, specs, sources, models)


def pin_replicas(apps: Sequence[str], replicas: int) -> str:
    """Each app's model-server replica i has its XLA compute threads on core i (modulo the
    cores), as replicas on devices of their own: a replica sent more than its share cannot
    borrow another's core. Every other thread keeps every core. Returns what it did."""
    cores = sorted(os.sched_getaffinity(0))
    placed = []
    for app in apps:
        deadline = time.monotonic() + 30.0  # a stopped cluster's replicas may still be exiting
        while len(pids := replica_pids(app)) != replicas and time.monotonic() < deadline:
            time.sleep(0.5)
        if len(pids) != replicas:
            raise RuntimeError(f"--pin-replicas found {len(pids)} model-server processes of {app}, not {replicas}")
        for i, pid in enumerate(pids):
            core = cores[i % len(cores)]
            threads = pin(pid, {core}, XLA_COMPUTE_THREADS)
            if threads == 0:
                raise RuntimeError(f"model-server process {pid} has no {XLA_COMPUTE_THREADS} threads to pin")
            placed.append(f"{app} {threads} on core {core}")
    return "XLA compute threads of the replicas: " + ", ".join(placed)


def replica_pids(app: str) -> list[int]:
    """The model-server replica processes of Serve application `app` on this host."""
    return [pid for pid in pids_of_role("model server") if f"ServeReplica:{app}:" in command_line(pid)]


def _on_apps(a, apps: Mapping[str, ServedApp], specs, sources, models) -> list[Result]:
    started = time.monotonic()
    for app in {id(app): app for app in apps.values()}.values():
        for name, source in sources.items():
            app.register(name, source)
    _progress(f"  {len(sources)} adapters registered in {time.monotonic() - started:.0f} s")
    return run_systems({s: app.url for s, app in apps.items()}, specs, models, a, metrics=True, rounds=a.rounds)


def run_peft(a, specs, sources: dict[str, str], base_name: str, model_dir: str, adapters_dir: str,
             notes: list[str]) -> list[Result]:
    """Starts the transformers + PEFT server (benchmarks/peft_server.py) and runs the workloads on
    it; notes the batch sizes it tried."""
    port = free_port()
    cmd = [sys.executable, "-m", "benchmarks.peft_server", "--model", model_dir, "--adapters-dir", adapters_dir,
           "--base-name", base_name, "--port", str(port), "--batch-sizes", *map(str, a.peft_batch_sizes),
           "--tune-prompt-len", str(sum(a.input_len) // 2), "--tune-new-tokens", str(sum(a.output_len) // 2)]
    _progress("starting the transformers + PEFT server")
    started = time.monotonic()
    with subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr) as proc:
        try:
            url = f"http://127.0.0.1:{port}"
            health = _wait_healthy(url, proc)
            tried = ", ".join(f"{b}: {s:.0f}" for b, s in health["tuning_tokens_per_s"].items())
            notes.append(f"peft: batch size {health['max_batch']} (closed-batch tokens/s by batch size: {tried})")
            _progress(f"  up in {time.monotonic() - started:.0f} s; {notes[-1]}")
            return run_systems({"peft": url}, specs, _models(base_name, list(sources)), a, metrics=False)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_healthy(url: str, proc: subprocess.Popen) -> dict:
    deadline = time.monotonic() + _PEFT_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the PEFT server exited with {proc.returncode} before serving")
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"the PEFT server was not up after {_PEFT_START_TIMEOUT_S:.0f} s")


def headline_run(results: Sequence[Result], slo_ttft_s: float) -> tuple[int, float, float, list[str]] | None:
    """(adapters, alpha, rate, notes) of the last line's runs (see the module docstring), or
    None when no run of ours finished."""
    settings = sorted({(r.spec.num_adapters, r.spec.alpha) for r in results if r.system == "ours"})
    if not settings:
        return None
    n, alpha = HEADLINE if HEADLINE in settings else settings[-1]
    ttft = {r.spec.rate: r.summary.ttft_p99_ms for r in results
            if r.system == "ours" and (r.spec.num_adapters, r.spec.alpha) == (n, alpha)}
    rate, within = headline_rate(ttft, slo_ttft_s)
    notes = [f"last line: n={n}, alpha={alpha}, rate={rate} req/s"]
    if not within:
        notes.append(f"no swept rate kept our p99 TTFT under {slo_ttft_s} s; the last line is at the lowest rate")
    return n, alpha, rate, notes


def headline(results: Sequence[Result], slo_ttft_s: float) -> tuple[str, list[str]]:
    """The last line (see the module docstring) and notes on how its rate was chosen."""
    chosen = headline_run(results, slo_ttft_s)
    if chosen is None:
        return ("lora_over_base_throughput=nan ttft_p99_ms=nan tpot_p99_ms=nan "
                "routing_gain_vs_serve_default=nan speedup_vs_peft=nan"), ["no run of ours finished"]
    n, alpha, rate, notes = chosen
    at = {(r.system, r.spec.rate): r.summary for r in results if (r.spec.num_adapters, r.spec.alpha) == (n, alpha)}
    ours = at[("ours", rate)]

    def ratio(value: float, system: str, field: str) -> float:
        other = at.get((system, rate))
        if other is None:
            notes.append(f"{system} has no run at rate {rate}")
            return math.nan
        denominator = getattr(other, field)
        return value / denominator if denominator > 0 else math.nan

    line = (f"lora_over_base_throughput={ratio(ours.requests_per_s, 'base', 'requests_per_s'):.4f} "
            f"ttft_p99_ms={ours.ttft_p99_ms:.2f} tpot_p99_ms={ours.tpot_p99_ms:.2f} "
            f"routing_gain_vs_serve_default={ratio(ours.requests_per_s, 'serve-default', 'requests_per_s'):.4f} "
            f"speedup_vs_peft={ratio(ours.output_tokens_per_s, 'peft', 'output_tokens_per_s'):.4f}")
    return line, notes


def print_cpu_shares(results: Sequence[Result], slo_ttft_s: float) -> None:
    """Where the host's CPU time went in each system's run at the last line's setting and rate."""
    chosen = headline_run(results, slo_ttft_s)
    if chosen is None:
        return
    n, alpha, rate, _ = chosen
    for r in sorted(results, key=lambda r: _SYSTEM_ORDER[r.system]):
        if (r.spec.num_adapters, r.spec.alpha, r.spec.rate) == (n, alpha, rate) and r.cpu is not None:
            print(f"CPU time of the {r.system} run (n={n}, alpha={alpha}, rate={rate} req/s): "
                  f"{r.cpu.wall_s:.1f} s on {r.cpu.cores} cores")
            print_table(["process", "thread", "CPU s", "of the machine"], r.cpu.rows())


def print_results(results: Sequence[Result]) -> None:
    """The table of every run, grouped by setting and rate."""
    rows = []
    for r in sorted(results, key=lambda r: (r.spec.num_adapters, r.spec.alpha, r.spec.rate, _SYSTEM_ORDER[r.system])):
        s, c = r.summary, r.counters
        rows.append([r.system, r.spec.num_adapters, r.spec.alpha, r.spec.rate, s.requests, s.errors,
                     s.requests_per_s, "/".join(f"{x:.1f}" for x in r.rounds_rps) or "-", s.output_tokens_per_s,
                     s.ttft_p50_ms, s.ttft_p99_ms, s.tpot_p50_ms,
                     s.tpot_p99_ms, f"{100 * s.slo_attainment:.0f}%",
                     *(("-", "-", "-", "-", "-") if c is None else (
                         int(c["loads"]), int(c["host_misses"]), int(c["fetches"]), _percent(off_holder_share(c)),
                         f"{load_imbalance(c):.2f}"))])
    print_table(["system", "n", "alpha", "rate", "requests", "errors", "req/s", "rounds", "out tok/s", "TTFT p50 ms",
                 "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms", "SLO", "slot loads", "host misses", "fetches",
                 "off holder", "max/mean tokens"], rows)


def _percent(share: float) -> str:
    return "-" if math.isnan(share) else f"{100 * share:.0f}%"


def wider_demo(out_dir: str, hidden: int, layers: int) -> str:
    """The demo model's tokenizer and config at `hidden` and `layers` (heads of 64, a quarter as
    many kv heads, MLP 8/3 as wide), random weights; returns its directory."""
    import json
    import pathlib
    import shutil

    from benchmarks.common import write_random_checkpoint
    from lora_runtime.demo import demo_model_dir
    from lora_runtime.model.tokenizer import Tokenizer

    demo = pathlib.Path(demo_model_dir())
    config = json.loads((demo / "config.json").read_text())
    heads = hidden // 64
    # The tokenizer's ids only: the trained demo never samples its padded rows, random weights would.
    vocab = Tokenizer.from_pretrained(str(demo)).vocab_size
    shape = dict(hidden=hidden, layers=layers, heads=heads, kv_heads=max(1, heads // 4),
                 intermediate=64 * math.ceil(8 * hidden / 3 / 64), vocab=vocab)
    out = write_random_checkpoint(out_dir, **shape)
    config.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, vocab_size=vocab,
                  num_key_value_heads=shape["kv_heads"], head_dim=64, intermediate_size=shape["intermediate"])
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(demo / name, out / name)
    return str(out)


def _accelerated() -> bool:
    """Whether this host's JAX runs on an accelerator (the local deployments' replicas do too)."""
    import jax

    return jax.default_backend() != "cpu"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="n=64, alpha=1.0, rates 8, 32 and 128 req/s (the last past a 2-core machine's "
                        "capacity), 192 requests or 8 s a run, lengths 8-16 "
                        "tokens, 2 replicas, PEFT batch sizes 1, 4 and 16")
    parser.add_argument("--adapters", type=int, nargs="+", choices=ADAPTER_COUNTS, default=None)
    parser.add_argument("--alpha", type=float, nargs="+", choices=ALPHAS, default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="requests/s, Poisson")
    parser.add_argument("--requests", type=int, default=None, help="most requests a run sends")
    parser.add_argument("--duration", type=float, default=None, help="seconds a run sends for, at most")
    parser.add_argument("--drain", type=float, default=None, help="seconds after the last send to finish")
    parser.add_argument("--input-len", type=int, nargs=2, default=None, metavar=("LO", "HI"), help="prompt tokens")
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("LO", "HI"), help="output tokens")
    parser.add_argument("--replicas", type=int, default=None, help="model-server replicas per deployment")
    parser.add_argument("--slots", type=int, default=8, help="device adapter slots per replica (max_loras_per_batch)")
    parser.add_argument("--host-cache", type=int, default=64,
                        help="adapters each replica's host cache holds (max_cpu_loras); below --adapters, "
                        "storage fetches show what routing saves")
    parser.add_argument("--model", default="demo", help="base model (app arg `model`), for us and for PEFT")
    parser.add_argument("--hidden", type=int, default=None,
                        help="serve the demo model's tokenizer and config at this width (random weights; "
                        "heads of 64, a quarter as many kv heads, MLP 8/3 as wide), for us and for PEFT")
    parser.add_argument("--layers", type=int, default=None, help="with --hidden: decoder layers (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=64, help="app arg max_seq_len of every deployment")
    parser.add_argument("--peft-batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--slo-ttft-s", type=float, default=2.0)
    parser.add_argument("--slo-tpot-s", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--serve-throughput-optimized", action="store_true",
                        help="run the local deployments with Ray Serve's RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (gRPC "
                        "between deployments, user code on the replica's own event loop, buffered request logs)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="app arg stream_interval of the local deployments: tokens a streamed chunk waits for "
                        "after the first (default 1, every token)")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="app arg stream_interval_ms of the local deployments: least milliseconds between a "
                        "stream's chunks after the first (default 0)")
    parser.add_argument("--ingress-replicas", type=int, default=1,
                        help="app arg ingress_replicas of the local deployments (default 1)")
    parser.add_argument("--pin-replicas", action="store_true",
                        help="each local model-server replica's XLA compute threads on a core of their own (replica "
                        "i on core i modulo the cores), as replicas on devices of their own; the rest float")
    parser.add_argument("--scan-layers", choices=("auto", "true", "false"), default="auto",
                        help="app arg scan_layers of every local deployment; auto: false on a CPU host (XLA on CPU "
                        "copies each layer's weights out of the stack inside the loop: the demo model's decode step "
                        "took 1.30-1.35 ms unrolled against 1.51-1.70 as a loop), true elsewhere")
    parser.add_argument("--rounds", type=int, default=2,
                        help="runs of each workload on each deployed system, the systems taking turns; each "
                        "counts its round of most requests/s (default 2; PEFT runs once)")
    parser.add_argument("--url", default=None, help="a running deployment on this host to measure as ours")
    parser.add_argument("--admin-token-env", default="LORA_ADMIN_TOKEN",
                        help="with --url: the env var holding its admin token")
    parser.add_argument("--skip", nargs="+", default=(), choices=("base", "serve-default", "peft"),
                        help="peers not to run")
    a = parser.parse_args(argv)
    a.scan_layers = {"true": True, "false": False}.get(a.scan_layers, _accelerated())
    # 192 requests: at 128 req/s a run of 64 lasted about a second, and its throughput moved by a tenth
    # from run to run; 192 take no longer in all (deploying dominates).
    quick = dict(adapters=[64], alpha=[1.0], rates=[8.0, 32.0, 128.0], requests=192, duration=8.0, drain=45.0,
                 input_len=(8, 16), output_len=(8, 16), replicas=2, peft_batch_sizes=[1, 4, 16])
    full = dict(adapters=[64], alpha=[1.0], rates=[2.0, 4.0, 8.0, 16.0, 32.0], requests=400, duration=60.0,
                drain=120.0,
                input_len=(8, 24), output_len=(8, 24), replicas=2, peft_batch_sizes=[1, 4, 8, 16, 32])
    for key, value in (quick if a.quick else full).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.input_len, a.output_len = tuple(a.input_len), tuple(a.output_len)
    if a.layers is not None and a.hidden is None:
        parser.error("--layers goes with --hidden")
    if a.hidden is not None and (a.hidden < 64 or a.hidden % 64 or a.model != "demo" or a.url):
        parser.error(f"--hidden={a.hidden} must be a multiple of 64, with the demo model and no --url")
    if a.serve_throughput_optimized and a.url:
        parser.error("--serve-throughput-optimized starts local deployments; a --url deployment has its own settings")
    if a.stream_interval != 1 and a.url:
        parser.error("--stream-interval sets local deployments; a --url deployment has its own stream_interval")
    if a.stream_interval_ms != 0 and a.url:
        parser.error("--stream-interval-ms sets local deployments; a --url deployment has its own stream_interval_ms")
    if a.stream_interval_ms < 0:
        parser.error(f"--stream-interval-ms={a.stream_interval_ms} must be at least 0")
    if a.stream_interval < 1:
        parser.error(f"--stream-interval={a.stream_interval} must be at least 1")
    if a.pin_replicas and a.url:
        parser.error("--pin-replicas pins local deployments' replicas; a --url deployment is not ours to pin")
    if a.ingress_replicas != 1 and a.url:
        parser.error("--ingress-replicas sets local deployments; a --url deployment has its own ingress_replicas")
    if a.rounds < 1:
        parser.error(f"--rounds={a.rounds} must be at least 1")
    if a.ingress_replicas < 1:
        parser.error(f"--ingress-replicas={a.ingress_replicas} must be at least 1")
    if a.input_len[1] + a.output_len[1] > a.max_seq_len:
        parser.error(f"input_len={a.input_len} and output_len={a.output_len} may exceed max_seq_len={a.max_seq_len}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    from benchmarks.peft_adapters import write_random_peft_adapters
    from cluster.admin import resolve_model_path
    from deployments.config import AppArgs

    started = time.monotonic()
    workdir = tempfile.TemporaryDirectory()
    if a.hidden is not None:
        a.model = wider_demo(f"{workdir.name}/demo-{a.hidden}x{a.layers or 8}", a.hidden, a.layers or 8)
    base_name = AppArgs(model=a.model).served_model_name
    model_dir = resolve_model_path(a.model)
    specs = [WorkloadSpec(n, alpha, rate, a.requests, a.duration, a.input_len, a.output_len, a.seed)
             for n in a.adapters for alpha in a.alpha for rate in a.rates]
    results: list[Result] = []
    failures: list[str] = []
    notes: list[str] = []
    with workdir as tmp:
        adapters_dir = f"{tmp}/adapters"
        sources = write_random_peft_adapters(model_dir, adapters_dir, adapter_names(max(a.adapters)),
                                             r=ADAPTER_RANK, alpha=2 * ADAPTER_RANK, seed=a.seed)
        _progress(f"{len(sources)} random rank-{ADAPTER_RANK} PEFT adapters written")
        deployed = [s for s in ("base", "ours", "serve-default")
                    if s not in a.skip and not (s == "serve-default" and a.url)]
        steps = [("ours", lambda: run_deployments(a, specs, sources, base_name, tmp, deployed))]
        if "peft" not in a.skip:
            steps.append(("peft", lambda: run_peft(a, specs, sources, base_name, model_dir, adapters_dir,
                                                       notes)))
        for label, step in steps:
            try:
                results += step()
            except Exception as e:  # one system failing still reports the others, and says why
                failures.append(f"{label} failed: {type(e).__name__}: {e}")
                _progress(failures[-1])
    line, headline_notes = headline(results, a.slo_ttft_s)
    print(f"serving over HTTP: {a.replicas} model-server replicas ({a.slots} device slots and {a.host_cache} "
          f"host-cached adapters each), rank-{ADAPTER_RANK} adapters, input "
          f"{a.input_len[0]}-{a.input_len[1]} and output {a.output_len[0]}-{a.output_len[1]} tokens, "
          f"{a.requests} requests or {a.duration:.0f} s a run, SLO TTFT <= {a.slo_ttft_s} s and "
          f"TPOT <= {1e3 * a.slo_tpot_s:.0f} ms; "
          f"{'RAY_SERVE_THROUGHPUT_OPTIMIZED=1; ' if a.serve_throughput_optimized else ''}"
          f"{'replicas compute on a core each; ' if a.pin_replicas else ''}"
          f"{time.monotonic() - started:.0f} s in all")
    print_results(results)
    print_cpu_shares(results, a.slo_ttft_s)
    for note in [*failures, *notes, *headline_notes]:
        print(note)
    print(line)


if __name__ == "__main__":
    main()
