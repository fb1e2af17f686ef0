"""Prefix caching and chunked prefill, each on and off, on the real engine.

    python -m benchmarks.prefix_cache [--quick]

1. Shared system prompt: requests that share a long system prompt and differ in a short
   question arrive one after another (a chat service's traffic). Prints, with prefix
   caching off and on: prompt tokens computed, mean time to first token (wall clock of a
   max_tokens=1 request through the engine), cache hit rate; and the time until all of a
   burst of 3 such requests arriving together have their first token.
2. A long prompt arrives while another request streams tokens: prints the longest gap
   between two of the streaming request's tokens with the whole prompt in one step and
   with it computed in chunks between decode steps.

Random-weight Llama (see benchmarks/common.py), CPU or accelerator. Last line:
`ttft_speedup=<f> hit_rate=<f> max_gap_ms_whole=<f> max_gap_ms_chunked=<f>`.
"""

from __future__ import annotations

import argparse
import threading
import time

from benchmarks.common import demo_tokenizer, print_table, synthetic_config, synthetic_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams


def _shared_prompt(engine, system: list[int], questions: list[list[int]]) -> tuple[float, int, float]:
    """(mean seconds to first token, prompt tokens computed, hit rate) over the questions."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate_batch([system + [5]], params)  # the first request fills the cache
    before = engine.stats()
    times = []
    for q in questions:
        start = time.perf_counter()
        engine.generate_batch([system + q], params)
        times.append(time.perf_counter() - start)
    after = engine.stats()
    queried = after["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
    hits = after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
    computed = after["prompt_tokens"] - before["prompt_tokens"]
    return sum(times) / len(times), computed, hits / queried if queried else 0.0


def _burst(engine, system: list[int], questions: list[list[int]]) -> float:
    """Seconds until every request of a burst (arriving together) has its first token."""
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine.generate_batch([system + [5]], params)
    start = time.perf_counter()
    engine.generate_batch([system + q for q in questions], params)
    return time.perf_counter() - start


def _longest_gap(engine, long_prompt: list[int]) -> tuple[float, float]:
    """Longest gap (s) between tokens of a streaming request while a long prompt is read,
    and the long prompt's time to first token (s)."""
    stamps: list[float] = []
    streaming = threading.Event()

    def emit(out):
        stamps.extend([time.perf_counter()] * len(out.token_ids))
        if len(stamps) >= 8:
            streaming.set()

    stream_id = engine.submit([7] * 8, SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True),
                              emit)
    streaming.wait(60)
    start = time.perf_counter()
    engine.generate_batch([long_prompt], SamplingParams(max_tokens=1, temperature=0.0))
    end = time.perf_counter()
    time.sleep(0.05)  # a few more tokens of the stream after the long prompt
    engine.abort(stream_id)
    during = [t for t in stamps if t >= start]
    if not during or during[-1] <= end:
        raise RuntimeError("the streaming request stopped before the long prompt was read")
    return max(b - a for a, b in zip([start] + during, during)), end - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and prompts")
    args = parser.parse_args(argv)
    if args.quick:
        shape = dict(hidden=256, layers=4, heads=4, kv_heads=2, intermediate=704)
        system_len, long_len, seq_len, chunk = 384, 768, 1024, 128
    else:
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816)
        system_len, long_len, seq_len, chunk = 1024, 3072, 4096, 256
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, **shape)
    system = [3 + (i * 7) % 60 for i in range(system_len)]
    questions = [[10 + i, 20 + i, 30 + i, 40 + i, 11, 12, 13, 14] for i in range(8)]

    rows = []
    for caching in (False, True):
        config = EngineConfig(max_batch=4, max_seq_len=seq_len, max_loras_per_batch=0,
                              enable_prefix_caching=caching)
        engine = synthetic_engine(model_config, config, tokenizer).start()
        try:
            ttft, computed, hit_rate = _shared_prompt(engine, system, questions)
            burst = _burst(engine, system, questions[:3])
        finally:
            engine.shutdown()
        rows.append(("on" if caching else "off", len(questions), computed, round(ttft * 1e3, 2), round(hit_rate, 3),
                     round(burst * 1e3, 2)))
    print(f"model: {shape}; system prompt {system_len} tokens + 8-token questions, one after another, "
          "and a burst of 3 arriving together")
    print_table(["prefix_caching", "requests", "prompt_tokens_computed", "mean_ttft_ms", "hit_rate",
                 "burst_of_3_ms"], rows)

    gaps = []
    long_prompt = [3 + (i * 11) % 60 for i in range(long_len)]
    for budget in (None, chunk):
        config = EngineConfig(max_batch=4, max_seq_len=seq_len, max_prefill_tokens=budget, max_loras_per_batch=0,
                              enable_prefix_caching=False)
        engine = synthetic_engine(model_config, config, tokenizer).start()
        try:
            gap, ttft = _longest_gap(engine, long_prompt)
        finally:
            engine.shutdown()
        gaps.append(("whole" if budget is None else f"chunks of {budget}", round(gap * 1e3, 2), round(ttft * 1e3, 1)))
    print(f"a {long_len}-token prompt arrives while a request streams")
    print_table(["prefill", "longest_token_gap_ms", "long_prompt_ttft_ms"], gaps)
    speedup = rows[0][3] / rows[1][3]
    print(f"ttft_speedup={speedup:.2f} hit_rate={rows[1][4]} max_gap_ms_whole={gaps[0][1]} "
          f"max_gap_ms_chunked={gaps[1][1]}")


if __name__ == "__main__":
    main()
