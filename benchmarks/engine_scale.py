"""The replica's hot path at Llama-3-8B layer widths: submit latency, a cold adapter's
load under running streams, LoRA cost against an engine without LoRA, compilations after
warm-up, and start time with and without the persistent compilation cache.

    python -m benchmarks.engine_scale [--quick] [--layers N]
    python -m benchmarks.engine_scale --start-only [--layers N] [--dtype bfloat16] [--widths W] [--depth-widths W]

Hidden 4096, 32 heads (8 kv), intermediate 14336, vocab 128256, few layers, float32 on
CPU; adapters of rank 64 on all seven projections, 64 device slots. Measured:

- `submit_p99_ms`: Engine.submit wall time while 8 streams decode (it never waits for a step).
- `cold_load_gap_ratio`: the longest token gap of 8 running streams when a request for an
  adapter in no cache (fetched, parsed and padded before its slot write) arrives, over the
  longest gap when a request for a resident adapter arrives. Both arrivals add the new
  request's prefill step; the ratio is what the load adds on top.
- `base_traffic_over_no_lora`: a decode step of base traffic on the LoRA engine over the
  same step on an engine with LoRA off (same weights), the two engines taking turns, twice
  each (the best of each's runs), as the host's speed wanders by several percent a minute.
- `lora_over_base_step`: 8 distinct adapters' decode step over the LoRA-off step;
  `roofline_ratio` the byte floor of that ratio.
- `real_compiles_after_warmup`: XLA compilations on both engines' loop threads after
  warm-up (JAX's compile events).
- `http_over_engine`: output tokens/s of 8 concurrent streamed completions (8 rank-16
  adapters, 48 prompt + 32 new tokens) through a real Serve deployment on loopback, over
  the tokens/s of the same engine's own steps (prefill and decode step time) for the same
  batch run in-process. Measured on a smaller model (hidden 768, 6 layers: where a
  step is short, the serving path's cost per token shows; at 8B widths on CPU a step
  takes most of a second and hides it). The table also shows the served replica's own
  steps during the HTTP run (its /health counters): on a CPU host the proxy, ingress and
  client share the cores that compute the steps, so the steps slow down too; HTTP over
  those steps (`http_over_served_steps`) is the serving path's own
  share. `--http-only --pin-cores` splits the cores as an accelerator host splits the work:
  XLA's compute threads (the engine's in process, then the replica's) on one half, standing
  for the device, and every other thread (engine loop, Serve, proxy, ingress, Ray, client) on
  the other; 9 runs alternate in process and over HTTP, and `http_over_engine` is the median
  pair's ratio.
- `warm_start_s`, `cached_start_s`: a replica's start in a fresh process, loading a
  checkpoint from disk (random, written first) and warming up, over an empty persistent
  compilation cache, then again over what that start left in it: compiled executables, and
  the step programs as exports (engine/program_store.py), so the restart neither traces nor
  compiles them. The table splits each start into imports, the checkpoint's load and
  warm-up, and the warm-up by JAX's events.
- `warmup_32_over_4`: the warm-up (every step shape compiled, then run once) of a 32-layer
  engine over a 4-layer one, layers as a loop (scan_layers), each in a fresh process with
  no compilation cache; the table also shows them unrolled, and the seconds XLA spent
  compiling (JAX's backend-compile events, summed over the warm-up's threads). At hidden 1024 (16 heads, 4 kv,
  intermediate 4096, vocab 128256): 32 layers of 8B widths do not fit a CPU host in f32.

`--start-only` measures only the starts: the cold and cached pair (at `--widths`, `--layers`,
`--dtype`) after the 4- and 32-layer warm-ups (layers as a loop, at `--depth-widths`). It needs
no Ray, so it runs on an accelerator host as it is; there `--layers 32 --dtype bfloat16
--depth-widths 8b` starts a whole Llama-3-8B-shaped model (16 GB in bfloat16). Its last line:
`warm_start_s=<f> cached_start_s=<f> cached_speedup=<f> cached_warmup_speedup=<f> warmup_32_over_4=<f>`.

On CPU the step-time engines run their layers unrolled (scan_layers=False): inside a loop
XLA's CPU backend copies each layer's weights out of the stack before its matmuls, which
doubles what a decode step reads (TPU and GPU read the slice in place), so a loop there
would hide LoRA's cost behind copies the accelerators do not make.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import jax
import numpy as np

from benchmarks.common import (
    demo_tokenizer, print_table, synthetic_config, synthetic_engine, write_random_adapter, write_random_checkpoint,
)
from benchmarks.common import decode_step_s
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.lora.adapter import module_shapes

RANK, SLOTS, STREAMS = 64, 64, 8
SHAPE = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
# The HTTP comparison: a model whose step is short enough for the serving path to show.
HTTP_SHAPE = dict(hidden=768, layers=6, heads=12, kv_heads=4, intermediate=2048)
# The depth comparison: 32 layers that fit a CPU host in f32.
DEPTH_SHAPE = dict(hidden=1024, heads=16, kv_heads=4, intermediate=4096, vocab=128256)
DEPTH_LAYERS = (4, 32)
# --widths / --depth-widths: "small" is for a smoke run of --start-only on any machine.
WIDTHS = {"8b": SHAPE, "1024": DEPTH_SHAPE,
          "small": dict(hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=1024)}
HTTP_PROMPT = ("the quick brown fox jumps over the lazy dog " * 2)[:47]  # 48 tokens with BOS
HTTP_NEW_TOKENS = 32


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _streams_gap_s(engine, adapters, arrival: str, prompt, new_tokens: int) -> float:
    """Longest token gap of STREAMS running streams over the steps around one request for
    `arrival` (submitted once every stream has a few tokens)."""
    times: dict[int, list[float]] = {i: [] for i in range(STREAMS)}
    finished = threading.Semaphore(0)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def emit_for(i):
        def emit(out):
            times[i].append(time.perf_counter())
            if out.finished:
                finished.release()
        return emit

    for i in range(STREAMS):
        engine.submit(prompt, params, emit_for(i), adapter=adapters[i % len(adapters)])
    while min(len(t) for t in times.values()) < 4:
        time.sleep(0.001)
    arrived = time.perf_counter()
    done = threading.Event()
    engine.submit(prompt[:16], SamplingParams(max_tokens=2, ignore_eos=True),
                  lambda out: done.set() if out.finished else None, adapter=arrival)
    assert done.wait(600), "the arriving request did not finish"
    ready = time.perf_counter()
    for _ in range(STREAMS):
        assert finished.acquire(timeout=600)
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:]) if b >= arrived and a <= ready]
    return max(gaps)


def _submit_p99_ms(engine, adapters, prompt, n: int) -> float:
    """Submit wall time while the streams decode (each request aborted right after)."""
    done = threading.Semaphore(0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(STREAMS):
        engine.submit(prompt, params, lambda out: done.release() if out.finished else None,
                      adapter=adapters[i % len(adapters)])
    waits = []
    for i in range(n):
        start = time.perf_counter()
        rid = engine.submit(prompt, params, lambda out: None, adapter=adapters[i % len(adapters)])
        waits.append(time.perf_counter() - start)
        engine.abort(rid)
        time.sleep(0.002)
    for _ in range(STREAMS):
        assert done.acquire(timeout=600)
    return 1e3 * float(np.percentile(waits, 99))


_START = textwrap.dedent("""
    import collections, json, sys, time
    start = time.perf_counter()
    import jax
    from jax import monitoring
    from benchmarks.common import demo_tokenizer, synthetic_config, synthetic_engine
    from benchmarks.engine_scale import RANK
    from lora_runtime.engine import compile_events
    from lora_runtime.engine.config import EngineConfig
    jax.devices()
    backend = time.perf_counter()
    spent = collections.Counter()  # where the warm-up's seconds go, by JAX's own events
    monitoring.register_event_duration_secs_listener(lambda event, secs, **_: spent.update({event: secs}))
    shape, scan, checkpoint = json.loads(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
    config = EngineConfig(max_batch=8, max_seq_len=128, max_loras_per_batch=8, max_lora_rank=RANK,
                          compilation_cache_dir=sys.argv[2] or None, scan_layers=scan,
                          dtype=shape.get("dtype", "float32"))
    if checkpoint:  # as a replica starts: the checkpoint read from disk
        from lora_runtime.demo import BASE_MODEL_DIR
        from lora_runtime.engine.engine import Engine
        engine = Engine.from_pretrained(checkpoint, config, tokenizer_path=str(BASE_MODEL_DIR))
    else:
        engine = synthetic_engine(synthetic_config(layers=int(sys.argv[1]), **shape), config, demo_tokenizer())
    built = time.perf_counter()
    spent.clear()
    engine.start()
    c = compile_events.process_counts()
    event = lambda name: spent["/jax/core/compile/" + name]
    print(json.dumps({"ready_s": time.perf_counter() - start, "warmup_s": time.perf_counter() - built,
                      "import_s": backend - start, "build_s": built - backend,
                      "trace_s": event("jaxpr_trace_duration"), "lower_s": event("jaxpr_to_mlir_module_duration"),
                      "backend_compile_s": event("backend_compile_duration"),
                      "cache_read_s": spent["/jax/compilation_cache/cache_retrieval_time_sec"],
                      "compiled": c.compiled, "hits": c.cache_hits, "compile_s": c.seconds,
                      "programs_loaded": engine.runner.programs.loaded,
                      "programs_stored": engine.runner.programs.saved}))
    engine.shutdown()
""")


def _start_s(layers: int, cache_dir: str, shape: dict = SHAPE, scan_layers: bool = True,
             checkpoint: str = "") -> dict:
    """Build and warm-up times of an engine started in a fresh process (cache_dir "": no
    persistent compilation cache), loading `checkpoint` (a directory) or, without one,
    building random weights of `layers` layers of `shape` on the device."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", _START, str(layers), cache_dir, json.dumps(shape),
                           "1" if scan_layers else "0", checkpoint], env=env, capture_output=True, text=True,
                          timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"engine start failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _start_pair(layers: int, shape: dict) -> tuple[dict, dict]:
    """A replica's start from a checkpoint on disk (written here first, random) over an empty
    compilation cache, then its restart over the cache that start left."""
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = str(write_random_checkpoint(f"{tmp}/base", tiled=True, layers=layers, **shape))
        cold = _start_s(layers, f"{tmp}/cache", shape, checkpoint=checkpoint)
        _progress(f"start, empty cache: {cold}")
        cached = _start_s(layers, f"{tmp}/cache", shape, checkpoint=checkpoint)
        _progress(f"start, cached: {cached}")
    return cold, cached


def _http_over_engine(tmp: str, repeats: int, stream_interval: int = 1, pin_cores: bool = False,
                      stream_interval_ms: float = 0.0, stream: bool = True) -> tuple[float, float, float, float, dict]:
    """(tokens/s over HTTP, tokens/s of the engine's own steps, tokens/s of the engine in
    process by the wall clock, tokens/s of the served replica's own steps during the HTTP
    run, CPU milliseconds per token of each process role over the HTTP runs) for STREAMS
    streams on STREAMS adapters, over `repeats` runs (_http_runs says how they combine); the
    replica streams `stream_interval` tokens an item after the first, and its items after
    the first at least `stream_interval_ms` apart. `stream` False: the requests are not
    streamed (each answered whole).

    `pin_cores`: the host's cores split in two (cpu_shares.split_cores), as an accelerator
    host splits the work: XLA's compute threads (the engine's in process, then the
    model-server replica's) run on the first half, which stands for the device; every other
    thread (the engine loop, Serve's event loops, the HTTP proxy, the ingress, Ray's
    processes, the client) on the second, the host's cores."""
    from benchmarks.cpu_shares import pin, split_cores
    from lora_runtime.demo import MODEL_VOCAB_SIZE, demo_model_dir

    shape = dict(HTTP_SHAPE, vocab=MODEL_VOCAB_SIZE)  # the demo tokenizer's ids fit
    checkpoint = write_random_checkpoint(f"{tmp}/http-base", **shape)
    model_config = synthetic_config(**shape)
    names = [f"h{i}" for i in range(STREAMS)]
    sources = {n: str(write_random_adapter(f"{tmp}/{n}", model_config, r=16, alpha=32, seed=100 + i))
               for i, n in enumerate(names)}
    args = dict(model=str(checkpoint), tokenizer=str(demo_model_dir()), model_name="http-base", max_batch=STREAMS,
                max_seq_len=128, max_loras_per_batch=STREAMS, max_lora_rank=16, stream_interval=stream_interval,
                stream_interval_ms=stream_interval_ms,
                registry_url=f"{tmp}/registry.json", compilation_cache_dir=f"{tmp}/jit-cache")
    params = SamplingParams(max_tokens=HTTP_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    every_core = os.sched_getaffinity(0)
    split = split_cores() if pin_cores else None
    if split is not None:
        # XLA sizes its compute pool by the cores a process may use when its backend starts:
        # one thread per core of the compute half, here and in the replica.
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise RuntimeError("--pin-cores must split the cores before JAX's backend starts")
        pin(os.getpid(), split[0])
    try:
        return _http_runs(checkpoint, args, sources, params, repeats, split, stream)
    finally:
        pin(os.getpid(), every_core)


def _http_runs(checkpoint, args: dict, sources: dict, params, repeats: int,
               split: tuple[set[int], set[int]] | None, stream: bool = True) -> tuple[float, float, float, float, dict]:
    """The in-process runs, then the HTTP runs: each figure the best of `repeats`. With the
    cores split, the in-process engine stays up (idle) beside the cluster and the runs
    alternate, in-process then HTTP, so that a slow spell of the host slows both; then the
    HTTP figures are the median run's, as a fraction of the in-process run beside it, times
    the best in-process figure (a host whose speed wanders by a fifth between runs of a
    second, as this one's does, makes the ratio of two bests noise)."""
    from benchmarks import cpu_shares
    from benchmarks.cpu_shares import pids_of_role, pin, split_process
    from benchmarks.serve_harness import served_app
    from deployments.config import AppArgs
    from lora_runtime.demo import demo_model_dir
    from lora_runtime.engine.engine import Engine

    names = list(sources)
    bodies = [{"model": n, "prompt": HTTP_PROMPT, "max_tokens": HTTP_NEW_TOKENS, "temperature": 0.0,
               "ignore_eos": True} for n in names]
    runs: dict[str, list[float]] = {"engine": [], "wall": [], "http": [], "served": []}
    cpu_s: dict[str, float] = {}  # CPU seconds by process role over the HTTP runs
    http_tokens = [0]

    def engine_run() -> None:
        before = dict(engine.counters)
        start = time.perf_counter()
        engine.generate_batch([HTTP_PROMPT] * STREAMS, params, names)
        wall_s = time.perf_counter() - start
        step_s = sum(engine.counters[k] - before[k] for k in ("prefill_seconds", "decode_seconds"))
        tokens = engine.counters["generated_tokens"] - before["generated_tokens"]
        runs["engine"].append(tokens / step_s)
        runs["wall"].append(tokens / wall_s)

    def http_run() -> None:
        before = app.engine_stats()
        threads, start = cpu_shares.snapshot(os.getpid()), time.perf_counter()
        seconds, tokens = app.send_completions(bodies, stream=stream)
        spent = cpu_shares.delta(threads, cpu_shares.snapshot(os.getpid()), time.perf_counter() - start)
        after = app.engine_stats()
        for role, s in spent.by_role().items():
            cpu_s[role] = cpu_s.get(role, 0.0) + s
        http_tokens[0] += tokens
        assert tokens == STREAMS * HTTP_NEW_TOKENS, f"{tokens} tokens came back"
        runs["http"].append(tokens / seconds)
        runs["served"].append(tokens / sum(after[k] - before[k] for k in ("prefill_seconds", "decode_seconds")))

    with contextlib.ExitStack() as stack:
        engine = Engine.from_pretrained(str(checkpoint), AppArgs(**args).engine_config(),
                                        tokenizer_path=str(demo_model_dir()))
        for n, source in sources.items():
            engine.lora_manager.register(n, source)
        engine.start()
        stack.callback(engine.shutdown)
        if split is not None:
            _progress(f"in process: {split_process(os.getpid(), *split)} XLA compute threads on cores {split[0]}")
        engine.generate_batch([HTTP_PROMPT] * STREAMS, params, names)  # every adapter resident
        if split is None:
            for _ in range(repeats):
                engine_run()
            stack.close()  # the engine goes before the cluster comes
        else:  # the cluster's processes start on the compute half, as this one did
            pin(os.getpid(), split[0])
        app = stack.enter_context(served_app(args))
        if split is not None:
            servers = pids_of_role("model server")
            assert len(servers) == 1, f"model-server processes: {servers}"
            threads = split_process(servers[0], *split)
            for role in ("ingress", "HTTP proxy", "Serve controller", "Ray (other)"):
                for pid in pids_of_role(role):
                    with contextlib.suppress(OSError):  # a process that ended meanwhile
                        pin(pid, split[1])
            split_process(os.getpid(), *split)  # the client, and the engine in process
            _progress(f"model server: {threads} XLA compute threads on cores {split[0]}")
        for n, source in sources.items():
            app.register(n, source)
        app.send_completions(bodies, stream=stream)  # every adapter resident
        for _ in range(repeats):
            if split is not None:
                engine_run()
            http_run()
    engine_tps, wall_tps = max(runs["engine"]), max(runs["wall"])
    if split is None:
        best = max(range(repeats), key=lambda i: runs["http"][i])
        http_tps, served_tps = runs["http"][best], runs["served"][best]
    else:
        _progress("tokens/s by pair (in process, over HTTP, the replica's steps): " + ", ".join(
            f"({e:.0f}, {h:.0f}, {r:.0f})" for e, h, r in zip(runs["engine"], runs["http"], runs["served"])))
        http_tps = engine_tps * float(np.median([h / e for h, e in zip(runs["http"], runs["engine"])]))
        served_tps = http_tps / float(np.median([h / r for h, r in zip(runs["http"], runs["served"])]))
    _progress(f"engine steps: {engine_tps:.1f} tokens/s, in process by the wall clock {wall_tps:.1f}")
    _progress(f"over HTTP: {http_tps:.1f} tokens/s; the served replica's steps meanwhile {served_tps:.1f}")
    cpu_ms_per_token = {role: 1e3 * s / http_tokens[0] for role, s in sorted(cpu_s.items(), key=lambda kv: -kv[1])}
    return http_tps, engine_tps, wall_tps, served_tps, cpu_ms_per_token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 layers, fewer tokens and submits")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 2 quick, 4)")
    parser.add_argument("--slots", type=int, default=SLOTS, help="device adapter slots")
    parser.add_argument("--http-only", action="store_true", help="only the HTTP comparison")
    parser.add_argument("--depth-only", action="store_true", help="only the 4- and 32-layer warm-ups")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the served replica's stream_interval in the HTTP comparison (default 1)")
    parser.add_argument("--stream-interval-ms", type=float, default=0.0,
                        help="the served replica's stream_interval_ms in the HTTP comparison (default 0)")
    parser.add_argument("--unstreamed", action="store_true",
                        help="with --http-only: the HTTP requests are not streamed (each answered whole)")
    parser.add_argument("--pin-cores", action="store_true",
                        help="with --http-only: the cores split as on an accelerator host, XLA's compute "
                             "threads on one half, every other thread on the other")
    parser.add_argument("--start-only", action="store_true",
                        help="only the starts: cold and cached, then 4 and 32 layers (no Ray)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="--start-only: the weights' dtype")
    parser.add_argument("--widths", choices=sorted(WIDTHS), default="8b",
                        help="--start-only: the cold and cached pair's layer widths")
    parser.add_argument("--no-depth", dest="depth", action="store_false",
                        help="--start-only: leave out the 4- and 32-layer warm-ups")
    parser.add_argument("--depth-widths", choices=sorted(WIDTHS), default="1024",
                        help="--start-only: the 4- and 32-layer pair's layer widths")
    args = parser.parse_args(argv)
    if args.unstreamed and not args.http_only:
        parser.error("--unstreamed needs --http-only")
    if args.pin_cores and not args.http_only:
        parser.error("--pin-cores needs --http-only (the cores are split before JAX's backend starts)")
    if args.start_only:
        _starts_only(args)
        return
    if args.depth_only:
        depth = _depth_warmups(unrolled=True)
        _print_depth(depth)
        print(f"warmup_32_over_4={depth[(True, 32)]['warmup_s'] / depth[(True, 4)]['warmup_s']:.3f}")
        return
    if args.http_only:
        with tempfile.TemporaryDirectory() as tmp:
            http = _http_over_engine(tmp, repeats=9 if args.pin_cores else 2, stream_interval=args.stream_interval,
                                    pin_cores=args.pin_cores, stream_interval_ms=args.stream_interval_ms,
                                    stream=not args.unstreamed)
        _print_http(http, args.stream_interval, args.pin_cores, args.stream_interval_ms, not args.unstreamed)
        print(f"http_over_engine={http[0] / http[1]:.3f} http_over_served_steps={http[0] / http[3]:.3f}")
        return
    layers = args.layers or (2 if args.quick else 4)
    new_tokens, repeats, submits = (16, 1, 100) if args.quick else (32, 2, 400)
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(layers=layers, **SHAPE)
    on_cpu = jax.devices()[0].platform == "cpu"
    config = EngineConfig(max_batch=STREAMS + 1, max_seq_len=128, max_loras_per_batch=args.slots, max_lora_rank=RANK,
                          max_cpu_loras=STREAMS, compilation_cache_dir=None, scan_layers=not on_cpu)
    prompt = [3 + (i % 50) for i in range(32)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    off = synthetic_engine(model_config, config.model_copy(update={"max_loras_per_batch": 0}), tokenizer).start()
    try:
        off_s = decode_step_s(off, [None] * STREAMS, prompt, params, repeats)
        engine = synthetic_engine(model_config, config, tokenizer)
        with tempfile.TemporaryDirectory() as tmp:
            # "cold" first: the host cache keeps the last STREAMS registered, so it is in no cache.
            names = ["cold", *(f"a{i}" for i in range(STREAMS)), "warm"]
            for i, name in enumerate(names):
                path = write_random_adapter(f"{tmp}/{name}", model_config, r=RANK, alpha=2 * RANK, seed=i)
                engine.lora_manager.register(name, str(path))
            engine.start()
            try:
                distinct = names[1:1 + STREAMS]
                engine.generate_batch([prompt] * (STREAMS + 1), SamplingParams(max_tokens=2, ignore_eos=True),
                                      distinct + ["warm"])  # all resident but "cold"
                # The host's speed wanders by several percent over a minute: the two engines
                # take turns, twice each, and each counts its best.
                base_s = decode_step_s(engine, [None] * STREAMS, prompt, params, repeats)
                off_s = min(off_s, decode_step_s(off, [None] * STREAMS, prompt, params, repeats))
                base_s = min(base_s, decode_step_s(engine, [None] * STREAMS, prompt, params, repeats))
                compiles = off.compiles_after_warmup
                off.shutdown()
                _progress(f"LoRA off: {1e3 * off_s:.1f} ms a decode step")
                many_s = decode_step_s(engine, distinct, prompt, params, repeats)
                _progress(f"LoRA on: base traffic {1e3 * base_s:.1f} ms, {STREAMS} adapters {1e3 * many_s:.1f} ms")
                submit_p99 = _submit_p99_ms(engine, distinct, prompt, submits)
                warm_gap = _streams_gap_s(engine, distinct, "warm", prompt, new_tokens)
                assert not engine.lora_manager.is_resident("cold") and not engine.lora_manager.is_host_cached("cold")
                cold_gap = _streams_gap_s(engine, distinct, "cold", prompt, new_tokens)
                compiles += engine.compiles_after_warmup
            finally:
                engine.shutdown()
    finally:
        off.shutdown()  # a no-op once shut down
    itemsize = np.dtype(model_config.dtype).itemsize
    base_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.state))
    adapter_bytes = layers * sum(RANK * (i + o) for i, o in module_shapes(model_config).values()) * itemsize
    roofline = 1 + STREAMS * adapter_bytes / base_bytes
    del engine, off
    gc.collect()
    _progress(f"gaps: resident {1e3 * warm_gap:.1f} ms, cold {1e3 * cold_gap:.1f} ms; submit p99 {submit_p99:.3f} ms")

    cold_start, cached_start = _start_pair(layers, SHAPE)
    depth = _depth_warmups(unrolled=not args.quick)
    with tempfile.TemporaryDirectory() as tmp:
        http = _http_over_engine(tmp, repeats=2, stream_interval=args.stream_interval,
                                 stream_interval_ms=args.stream_interval_ms)
    http_tps, engine_tps = http[0], http[1]

    print(f"device={jax.devices()[0].platform} layers={layers} scan_layers={config.scan_layers} {SHAPE} "
          f"rank={RANK} slots={args.slots} "
          f"base_bytes={base_bytes / 2**30:.2f}GiB adapter_bytes={adapter_bytes / 2**20:.1f}MiB")
    print_table(
        ["decode step, batch of 8", "step_ms", "over_lora_off", "roofline"],
        [
            ("LoRA off", 1e3 * off_s, 1.0, 1.0),
            ("LoRA on, base traffic", 1e3 * base_s, base_s / off_s, 1.0),
            (f"{STREAMS} adapters", 1e3 * many_s, many_s / off_s, roofline),
        ],
    )
    print_table(
        ["while 8 streams decode", "value"],
        [
            ("submit p99 ms", submit_p99),
            ("longest gap, resident adapter arrives (ms)", 1e3 * warm_gap),
            ("longest gap, cold adapter arrives (ms)", 1e3 * cold_gap),
        ],
    )
    _print_starts(cold_start, cached_start, f"{layers} layers")
    _print_http(http, args.stream_interval, stream_interval_ms=args.stream_interval_ms)
    _print_depth(depth)
    print(f"submit_p99_ms={submit_p99:.3f} cold_load_gap_ratio={cold_gap / warm_gap:.3f} "
          f"base_traffic_over_no_lora={base_s / off_s:.4f} lora_over_base_step={many_s / off_s:.4f} "
          f"roofline_ratio={roofline:.4f} real_compiles_after_warmup={compiles} "
          f"warm_start_s={cold_start['ready_s']:.1f} cached_start_s={cached_start['ready_s']:.1f} "
          f"http_over_engine={http_tps / engine_tps:.3f} http_over_served_steps={http_tps / http[3]:.3f} "
          f"warmup_32_over_4={depth[(True, 32)]['warmup_s'] / depth[(True, 4)]['warmup_s']:.3f}")


def _depth_warmups(unrolled: bool, shape: dict = DEPTH_SHAPE) -> dict:
    """{(scan_layers, layers): fresh-process start} at `shape`, no compilation cache."""
    out = {}
    for scan in (True, False) if unrolled else (True,):
        for layers in DEPTH_LAYERS:
            out[(scan, layers)] = _start_s(layers, "", shape, scan)
            _progress(f"depth: scan_layers={scan} {layers} layers: {out[(scan, layers)]}")
    return out


def _print_http(http: tuple[float, float, float, float, dict], stream_interval: int, pin_cores: bool = False,
                stream_interval_ms: float = 0.0, stream: bool = True) -> None:
    http_tps, engine_tps, wall_tps, served_tps, cpu_ms_per_token = http
    print_table(
        ["8 streams, hidden 768, 6 layers" + (" (cores split: XLA compute | the rest)" if pin_cores else ""), "tokens/s"],
        [("engine's own steps", engine_tps), ("engine in process, wall clock", wall_tps),
         (f"over HTTP (Serve, streamed, stream_interval={stream_interval}, stream_interval_ms={stream_interval_ms:g})"
          if stream else "over HTTP (Serve, not streamed)", http_tps),
         ("the served replica's steps meanwhile", served_tps)],
    )
    # The model server's row includes its XLA compute threads: the steps themselves.
    print_table(["over HTTP: CPU by process", "ms per token"], list(cpu_ms_per_token.items()))


def _print_depth(depth: dict, shape: dict = DEPTH_SHAPE) -> None:
    rows = [(f"{'loop' if scan else 'unrolled'}, {layers} layers", r["warmup_s"], r["compile_s"], r["compiled"])
            for (scan, layers), r in depth.items()]
    print_table([f"warm-up, hidden {shape['hidden']}, no cache", "seconds", "compiling (s, all threads)",
                 "compiled"], rows)


def _print_starts(cold: dict, cached: dict, label: str) -> None:
    starts = (("empty compilation cache", cold), ("cache from the run before", cached))
    print_table(
        [f"engine start, fresh process ({label})", "seconds", "of which warm-up", "compiled", "cache hits",
         "programs read", "compiling (s, all threads)"],
        [(name, r["ready_s"], r["warmup_s"], r["compiled"], r["hits"], r["programs_loaded"], r["compile_s"])
         for name, r in starts],
    )
    # Where each start's seconds went: imports and the device's start, loading the checkpoint,
    # then the warm-up's tracing, lowering and backend compiles (a cache hit's read included),
    # the rest of it running the warm-up steps (all by JAX's events, summed over threads).
    print_table(["start", "imports+device", "load", "warm-up", "trace", "lower", "backend compile",
                 "of which cache reads"],
                [(name, r["import_s"], r["build_s"], r["warmup_s"], r["trace_s"], r["lower_s"], r["backend_compile_s"],
                  r["cache_read_s"]) for name, r in starts])


def _starts_only(args) -> None:
    """The cold and cached start pair, then the depth pair; no Ray."""
    layers = args.layers or (2 if args.quick else 4)
    shape = dict(WIDTHS[args.widths], dtype=args.dtype)
    depth_shape = dict(WIDTHS[args.depth_widths], dtype=args.dtype)
    depth = _depth_warmups(unrolled=False, shape=depth_shape) if args.depth else None
    cold, cached = _start_pair(layers, shape)
    print(f"device={jax.devices()[0].platform} dtype={args.dtype} start: {layers} layers of {shape}; "
          f"depth: {depth_shape}")
    _print_starts(cold, cached, f"{layers} layers, hidden {shape['hidden']}")
    if depth:
        _print_depth(depth, depth_shape)
    print(f"warm_start_s={cold['ready_s']:.1f} cached_start_s={cached['ready_s']:.1f} "
          f"cached_speedup={cold['ready_s'] / cached['ready_s']:.3f} "
          f"cached_warmup_speedup={cold['warmup_s'] / cached['warmup_s']:.3f}"
          + (f" warmup_32_over_4={depth[(True, 32)]['warmup_s'] / depth[(True, 4)]['warmup_s']:.3f}" if depth else ""))


if __name__ == "__main__":
    main()
