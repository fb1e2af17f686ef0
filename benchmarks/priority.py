"""Priority scheduling against first come, first served, on the real engine.

    python -m benchmarks.priority [--quick] [--adapters]

A replica kept saturated by background requests (a closed loop of `--background` of them,
more than the batch has rows, each 64 tokens out) takes interactive requests (8 tokens out)
one every `--interval-ms`. Under `fcfs` every request has priority 0, so an interactive one
queues behind the background ones; under `priority` the interactive ones have priority 0 and
the background ones 1, so an interactive one is admitted at once, preempting the newest
background request when no row is free. Prints, for each policy, the interactive requests'
time to first token and to their last token (median and 95th percentile), and the
background and total output tokens per second over the interactive requests' window (the
background's share shrinks by the rows the interactive requests hold and by the tokens
preempted requests compute again; the total shows the second).

With `--adapters`, the replica has 2 adapter slots, the background requests alternate
between adapters a and b (so both slots stay held) and the interactive requests use adapter
c: under `fcfs` an interactive request also waits for a slot to empty; under `priority` it
preempts the background requests holding one (scheduler.py).

Random-weight Llama (see benchmarks/common.py), CPU or accelerator. Last line:
`ttft_p50_ms_fcfs=<f> ttft_p50_ms_priority=<f> ttft_speedup=<f> total_tokens_ratio=<f>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time

from benchmarks.common import demo_tokenizer, print_table, synthetic_config, synthetic_engine, write_random_adapter
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams

BACKGROUND = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
INTERACTIVE = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _run(engine, *, background: int, interactive: int, interval_s: float, prioritized: bool,
         adapters: bool = False) -> dict:
    """Interactive requests' latencies and the output tokens per second over their window."""
    lock = threading.Lock()
    stop = threading.Event()
    background_tokens = [0]

    def submit_background(i: int) -> None:
        def emit(out):
            with lock:
                background_tokens[0] += len(out.token_ids)
            if out.finished and not stop.is_set():
                submit_background(i + background)
        prompt = [3 + (i * 7 + j) % 60 for j in range(24)]
        engine.submit(prompt, BACKGROUND, emit, priority=1 if prioritized else 0,
                      adapter=("a", "b")[i % 2] if adapters else None)

    for i in range(background):
        submit_background(i)
    time.sleep(1.0)  # the loop reaches its steady state: every row busy, a queue behind them
    results: list[tuple[float, float]] = []
    interactive_tokens = [0]
    done = threading.Semaphore(0)
    start_tokens, start = background_tokens[0], time.perf_counter()
    for k in range(interactive):
        sent = time.perf_counter()
        first: list[float] = []

        def emit(out, sent=sent, first=first):
            if not first and out.token_ids:
                first.append(time.perf_counter() - sent)
            with lock:
                interactive_tokens[0] += len(out.token_ids)
            if out.finished:
                results.append((first[0], time.perf_counter() - sent))
                done.release()

        engine.submit([90 + k % 10] * 12, INTERACTIVE, emit, priority=0, adapter="c" if adapters else None)
        time.sleep(interval_s)
    for _ in range(interactive):
        if not done.acquire(timeout=600):
            raise RuntimeError("an interactive request did not finish")
    elapsed = time.perf_counter() - start
    tokens = background_tokens[0] - start_tokens
    stop.set()
    while engine.scheduler.has_work():  # the background loop winds down
        time.sleep(0.05)
    ttfts, totals = [r[0] for r in results], [r[1] for r in results]
    return {"ttft_p50": statistics.median(ttfts), "ttft_p95": _percentile(ttfts, 0.95),
            "total_p50": statistics.median(totals), "total_p95": _percentile(totals, 0.95),
            "background_tps": tokens / elapsed, "total_tps": (tokens + interactive_tokens[0]) / elapsed,
            "preemptions": engine.stats()["preemptions"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, fewer requests")
    parser.add_argument("--background", type=int, default=None, help="background requests in the closed loop")
    parser.add_argument("--interval-ms", type=float, default=None, help="between interactive requests")
    parser.add_argument("--adapters", action="store_true",
                        help="background requests on adapters a and b (2 slots), interactive ones on c")
    args = parser.parse_args(argv)
    if args.quick:
        shape = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704)
        rows_, background, interactive, interval = 4, 12, 10, 0.15
    else:
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816)
        rows_, background, interactive, interval = 8, 24, 20, 0.3
    background = args.background or background
    interval = args.interval_ms / 1e3 if args.interval_ms else interval
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, **shape)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        sources = {name: write_random_adapter(f"{tmp}/{name}", model_config, r=8, alpha=16, seed=i)
                   for i, name in enumerate("abc")} if args.adapters else {}
        for policy in ("fcfs", "priority"):
            config = EngineConfig(max_batch=rows_, max_seq_len=256, max_loras_per_batch=2 if sources else 0,
                                  max_lora_rank=8, scheduling_policy=policy)
            engine = synthetic_engine(model_config, config, tokenizer)
            for name, path in sources.items():
                engine.lora_manager.register(name, str(path))
            engine.start()
            try:
                # Every step program compiled, and with adapters each one's slot write.
                engine.generate_batch([[5] * 24] * rows_, BACKGROUND,
                                      [("a", "b")[i % 2] for i in range(rows_)] if sources else None)
                if sources:
                    engine.generate_batch([[5] * 24], BACKGROUND, ["c"])
                out[policy] = _run(engine, background=background, interactive=interactive, interval_s=interval,
                                   prioritized=policy == "priority", adapters=bool(sources))
            finally:
                engine.shutdown()
    print(f"model: {shape}; {rows_} rows; a closed loop of {background} background requests (64 tokens out); "
          f"{interactive} interactive requests (8 tokens out), one every {interval * 1e3:.0f} ms"
          + ("; 2 adapter slots, background on adapters a and b, interactive on c" if args.adapters else ""))
    print_table(["policy", "ttft_p50_ms", "ttft_p95_ms", "done_p50_ms", "done_p95_ms", "background_tokens_per_s",
                 "total_tokens_per_s", "preemptions"],
                [(p, round(r["ttft_p50"] * 1e3, 1), round(r["ttft_p95"] * 1e3, 1), round(r["total_p50"] * 1e3, 1),
                  round(r["total_p95"] * 1e3, 1), round(r["background_tps"], 1), round(r["total_tps"], 1),
                  r["preemptions"]) for p, r in out.items()])
    fcfs, prio = out["fcfs"], out["priority"]
    print(f"ttft_p50_ms_fcfs={fcfs['ttft_p50'] * 1e3:.1f} ttft_p50_ms_priority={prio['ttft_p50'] * 1e3:.1f} "
          f"ttft_speedup={fcfs['ttft_p50'] / prio['ttft_p50']:.2f} "
          f"total_tokens_ratio={prio['total_tps'] / fcfs['total_tps']:.2f}")


if __name__ == "__main__":
    main()
