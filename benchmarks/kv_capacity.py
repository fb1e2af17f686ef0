"""What the paged KV cache holds at one fixed KV memory, against one max_seq_len row per sequence.

    python -m benchmarks.kv_capacity [--quick]

1. Capacity: more requests than fit, with prompt + output lengths spread over 64..max_seq_len
   (64 plus an exponential tail, mean max_seq_len / 8), arrive at once; the engine's KV cache
   is the bytes that `dense_rows` rows of max_seq_len tokens take. Reports the sequences
   running while requests still queue (mean; the cache is then what bounds them, where the
   dense layout holds exactly `dense_rows`), the peak, and the preemptions.
2. Decode tokens/s at equal batch against the dense-row engine of the commit before paging
   (DENSE_COMMIT, extracted with `git archive` and run in a subprocess; the same script
   times both, each in its own process).
3. A multi-turn chat trace: each turn's prompt is the conversation so far; prefix hit rate.
4. Admission cost: one `admit()` with 1000 waiting and 256 running sequences (scheduler only).

Last line: `concurrent_seqs_vs_dense=<f> decode_vs_dense=<f> prefix_hit_rate=<f> admit_ms_1000_waiting=<f>`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks.common import demo_tokenizer, print_table, synthetic_config, synthetic_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams

# The last commit whose engine keeps one dense max_seq_len row per sequence.
DENSE_COMMIT = "163acaf"
REPO = pathlib.Path(__file__).resolve().parents[1]

# Times decode at one batch size on whatever engine the import path gives: this repository's
# or the dense commit's (the API it uses is common to both).
DECODE_SCRIPT = r"""
import json, sys
from benchmarks.common import demo_tokenizer, synthetic_config, synthetic_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
a = json.loads(sys.argv[1])
tokenizer = demo_tokenizer()
model_config = synthetic_config(vocab=tokenizer.vocab_size, **a["shape"])
config = EngineConfig(max_batch=a["batch"], max_seq_len=a["max_seq_len"], max_loras_per_batch=0,
                      enable_prefix_caching=False, max_prefill_tokens=a["prompt"] * a["batch"])
engine = synthetic_engine(model_config, config, tokenizer).start()
params = SamplingParams(max_tokens=a["new_tokens"], temperature=0.0, ignore_eos=True)
prompts = [[3 + (i * 7 + j) % 50 for j in range(a["prompt"])] for i in range(a["batch"])]
best = 0.0
for _ in range(a["repeats"]):
    before = dict(engine.counters)
    engine.generate_batch(prompts, params)
    rows = engine.counters["decode_row_steps"] - before["decode_row_steps"]
    best = max(best, rows / (engine.counters["decode_seconds"] - before["decode_seconds"]))
engine.shutdown()
print(json.dumps({"decode_tokens_per_s": best}))
"""


def decode_rate(root: pathlib.Path, args: dict) -> float:
    """Decode tokens/s of the engine in `root` (a subprocess, so each tree imports its own code)."""
    env = dict(os.environ, PYTHONPATH=str(root), JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    out = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, json.dumps(args)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"decode timing in {root} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tokens_per_s"]


def dense_tree(tmp: str) -> pathlib.Path | None:
    """The dense commit's files, or None when this is not a git checkout that has it."""
    try:
        archive = subprocess.run(["git", "archive", DENSE_COMMIT], cwd=REPO, capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
    return pathlib.Path(tmp)


def lengths(n: int, max_seq_len: int, rng: random.Random) -> list[int]:
    """Prompt + output lengths: 64 plus an exponential tail, mean max_seq_len / 8, at most max_seq_len."""
    tail = max_seq_len / 8 - 64
    return [min(max_seq_len, 64 + int(rng.expovariate(1 / tail))) for _ in range(n)]


def capacity(model_config, tokenizer, *, max_seq_len: int, dense_rows: int, requests: int, seed: int = 0):
    """Runs the length-spread workload at the KV memory of `dense_rows` dense rows."""
    from lora_runtime.model.kv_cache import block_bytes

    per_token = block_bytes(model_config, 16) // 16
    config = EngineConfig(max_batch=256, max_seq_len=max_seq_len, max_loras_per_batch=0,
                          kv_cache_bytes=(dense_rows * max_seq_len + 16) * per_token, enable_prefix_caching=False)
    engine = synthetic_engine(model_config, config, tokenizer).start()
    rng = random.Random(seed)
    done = threading.Semaphore(0)
    peak, outs, loaded = 0, [], []
    try:
        for i, total in enumerate(lengths(requests, max_seq_len, rng)):
            prompt_len = max(16, total // 4)
            prompt = [3 + rng.randrange(50) for _ in range(prompt_len)]
            params = SamplingParams(max_tokens=total - prompt_len, temperature=0.0, ignore_eos=True)
            engine.submit(prompt, params, lambda out: (outs.append(out), done.release()) if out.finished else None)
        finished = 0
        while finished < requests:
            if done.acquire(timeout=0.002):
                finished += 1
            running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
            peak = max(peak, running)
            if waiting:  # requests queue: the cache, not the arrivals, bounds the running set
                loaded.append(running)
        stats = engine.stats()
    finally:
        engine.shutdown()
    return peak, statistics.mean(loaded), stats["preemptions"], engine.scheduler.pool.usable * 16


def chat_trace(model_config, tokenizer, *, conversations: int, turns: int, seed: int = 1) -> float:
    """Conversations taking turns: each prompt is the conversation so far plus a new message."""
    config = EngineConfig(max_batch=conversations, max_seq_len=1024, max_loras_per_batch=0)
    engine = synthetic_engine(model_config, config, tokenizer).start()
    rng = random.Random(seed)
    system = [3 + rng.randrange(50) for _ in range(64)]
    history = [list(system) for _ in range(conversations)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    try:
        for _ in range(turns):
            prompts = []
            for h in history:
                h += [3 + rng.randrange(50) for _ in range(rng.randrange(8, 40))]  # the user's message
                prompts.append(list(h))
            for h, out in zip(history, engine.generate_batch(prompts, params)):
                h += out.token_ids
        stats = engine.stats()
    finally:
        engine.shutdown()
    return stats["prefix_cache_hit_tokens"] / stats["prefix_cache_query_tokens"]


def admit_ms(*, waiting: int = 1000, running: int = 256, prompt_len: int = 512, repeats: int = 5) -> float:
    """Median time of one admit() with `waiting` queued (many sharing prefixes with cached
    blocks) and `running` running; every waiting one is looked at (free rows, a small packed
    budget that most cannot fit)."""
    from lora_runtime.engine.scheduler import Scheduler
    from lora_runtime.engine.sequence import Sequence

    rng = random.Random(2)
    stems = [[rng.randrange(1000) for _ in range(prompt_len)] for _ in range(8)]
    config = EngineConfig(max_batch=running + 64, max_seq_len=2048, max_prefill_tokens=512, max_loras_per_batch=0)

    def seq(prompt, rid) -> Sequence:
        return Sequence(request_id=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=8), seed=0,
                        adapter=None, emit=lambda out: None, detokenizer=None, eos_token_ids=frozenset())

    times = []
    for r in range(repeats):
        sched = Scheduler(config, None, num_blocks=(running + 64) * 2048 // 16 + 1, block_size=16)
        for i in range(running):
            s = seq(rng.choice(stems)[: rng.randrange(prompt_len // 5, prompt_len)] + [rng.randrange(1000)], f"run{i}")
            sched.add(s)
            for p in sched.admit(packed_budget=10**9).placed:
                sched.computed(p, p.prefill_len - p.computed)
        assert len(sched.running) == running
        for i in range(waiting):
            sched.add(seq(rng.choice(stems)[: rng.randrange(prompt_len // 5, prompt_len)] + [rng.randrange(1000)], f"w{i}"))
        sched.step += 1
        start = time.perf_counter()
        sched.admit(packed_budget=16)
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model and workload (a few minutes on 2 cores)")
    args = parser.parse_args(argv)
    if args.quick:
        shape = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408)
        max_seq_len, dense_rows, requests = 1024, 8, 160
        decode = dict(batch=8, prompt=96, new_tokens=48, repeats=3)
        conversations, turns = 4, 4
    else:
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816)
        max_seq_len, dense_rows, requests = 2048, 16, 400
        decode = dict(batch=16, prompt=256, new_tokens=64, repeats=3)
        conversations, turns = 8, 6
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, **shape)

    peak, loaded, preemptions, kv_tokens = capacity(
        model_config, tokenizer, max_seq_len=max_seq_len, dense_rows=dense_rows, requests=requests)
    decode_args = dict(shape=shape, max_seq_len=max_seq_len, **decode)
    paged, dense = [], []
    with tempfile.TemporaryDirectory() as tmp:
        tree = dense_tree(tmp)
        for _ in range(2):  # alternated, best of each: both see the machine's quiet and busy moments
            paged.append(decode_rate(REPO, decode_args))
            if tree is not None:
                dense.append(decode_rate(tree, decode_args))
    paged_rate, dense_rate = max(paged), max(dense, default=float("nan"))
    hit_rate = chat_trace(model_config, tokenizer, conversations=conversations, turns=turns)
    admit = admit_ms()

    print(f"model: {shape} max_seq_len={max_seq_len} KV cache: {kv_tokens} tokens "
          f"(= {dense_rows} dense rows); {requests} requests, lengths 64..{max_seq_len}, mean ~{max_seq_len // 8}")
    print_table(["measure", "paged", "dense rows", "ratio"], [
        ("running while requests queue (mean)", round(loaded, 1), dense_rows, round(loaded / dense_rows, 2)),
        ("running at once (peak)", peak, dense_rows, round(peak / dense_rows, 2)),
        ("preemptions", preemptions, "-", "-"),
        (f"decode tok/s at batch {decode['batch']}", round(paged_rate, 1), round(dense_rate, 1),
         round(paged_rate / dense_rate, 3)),
        (f"chat prefix hit rate ({conversations}x{turns} turns)", round(hit_rate, 3), "-", "-"),
        ("admit ms, 1000 waiting / 256 running", round(admit, 2), "-", "-"),
    ])
    print(f"concurrent_seqs_vs_dense={loaded / dense_rows:.2f} decode_vs_dense={paged_rate / dense_rate:.3f} "
          f"prefix_hit_rate={hit_rate:.3f} admit_ms_1000_waiting={admit:.2f}")


if __name__ == "__main__":
    main()
