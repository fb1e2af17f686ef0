"""The whole engine on the accelerator: the shipped demo model and its four trained adapters,
every word task in mixed batches, through the machine's kernels and through XLA.

    python -m benchmarks.engine_device_check            # on the accelerator machine
    python -m benchmarks.engine_device_check --words 4  # fewer words (any machine)

Each configuration (LoRA backend, attention backend) starts an engine on the same device
and runs the same jobs: every word sent to the base model and to each adapter, all in one
`generate_batch` (continuous batching over mixed adapters), then the same jobs again (their
prompts now hit the prefix cache), then one request asking for log-probabilities. Checked:
the tasks' answers (the adapters were trained to do them, so a wrong kernel shows as wrong
words), the same tokens from every configuration, and no compilation after warm-up. On a
CPU-only machine the kernels' configurations are left out. Last line:
`configs=<n> task_accuracy_min=<f> token_mismatches=<n> compiles_after_warmup=<n>`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import jax

from kernels.common import default_platform
from lora_runtime.demo import demo_adapters, demo_model_dir, tasks
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.engine import Engine
from lora_runtime.engine.sampling import SamplingParams

WORDS = ("hello", "serving", "adapter", "kernel", "device", "batch", "tensor", "model", "router", "cache",
         "slot", "token")


def configurations(platform: str) -> list[tuple[str, str]]:
    """(lora_backend, attention_backend) pairs: the kernels where the machine has them."""
    xla = [("xla", "xla")]
    if platform == "cpu":
        return xla + [("reference", "xla")]
    return [("pallas", "pallas"), ("pallas", "xla"), ("xla", "pallas")] + xla


def run_config(lora_backend: str, attention_backend: str, words) -> dict:
    adapters = demo_adapters()
    start = time.perf_counter()
    engine = Engine.from_pretrained(
        demo_model_dir(),
        EngineConfig(max_batch=16, max_seq_len=64, max_loras_per_batch=len(adapters), lora_backend=lora_backend,
                     attention_backend=attention_backend),
        model_name="demo-base",
    )
    for name, path in adapters.items():
        engine.lora_manager.register(name, str(path))
    engine.start()
    ready = time.perf_counter() - start
    jobs = [(adapter, word) for word in words for adapter in (None, *adapters)]
    prompts = [tasks.prompt_text(w) for _, w in jobs]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    try:
        t = time.perf_counter()
        first = engine.generate_batch(prompts, params, [a for a, _ in jobs])
        took = time.perf_counter() - t
        again = engine.generate_batch(prompts, params, [a for a, _ in jobs])
        lp = engine.generate_batch([prompts[1]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=2),
                                   [jobs[1][0]])[0]
        compiles = engine.compiles_after_warmup
        counters = dict(engine.counters)
    finally:
        engine.shutdown()
    right = [out.text.strip() == (word if adapter is None else tasks.answer_text(tasks.ADAPTER_TASKS[adapter], word))
             for (adapter, word), out in zip(jobs, first)]
    return {
        "lora_backend": lora_backend, "attention_backend": attention_backend, "ready_s": ready, "batch_s": took,
        "tokens": [o.token_ids for o in first], "texts": [o.text for o in first],
        "again_same": [o.token_ids for o in again] == [o.token_ids for o in first],
        "cached_tokens": sum(o.cached_tokens for o in again),
        "logprobs": _top_logprobs(lp),
        "task_accuracy": sum(right) / len(right), "wrong": [f"{a or 'base'}:{w}->{o.text!r}" for (a, w), o, r in
                                                          zip(jobs, first, right) if not r][:8],
        "compiles_after_warmup": compiles, "decode_steps": counters.get("decode_steps"),
    }


def _top_logprobs(out) -> list[list[float]]:
    """Each generated token's log-probability, then those of its two likeliest tokens."""
    return [[step.logprob, *(lp for _, lp in step.top)] for step in out.logprobs or []]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--words", type=int, default=len(WORDS), help="how many words (5 jobs each)")
    parser.add_argument("--out", default=None, help="JSON details (default $OUT/engine_device_check.json)")
    args = parser.parse_args(argv)
    platform = default_platform()
    words = WORDS[: args.words]
    rows = []
    for lora_backend, attention_backend in configurations(platform):
        try:
            rows.append(run_config(lora_backend, attention_backend, words))
        except Exception as e:  # one broken configuration must not hide the others
            rows.append({"lora_backend": lora_backend, "attention_backend": attention_backend,
                         "error": f"{type(e).__name__}: {e}"[:1500]})
        # Each engine's KV cache takes the memory plan's share of the device: the engine is
        # gone once run_config returns, and its buffers with it.
        gc.collect()
        stats = jax.devices()[0].memory_stats() or {}
        rows[-1]["device_bytes_in_use_after"] = stats.get("bytes_in_use")
        row = rows[-1]
        print(f"  lora={lora_backend:9s} attention={attention_backend:6s} "
              + (f"error {row['error'][:300]}" if "error" in row else
                 f"accuracy={row['task_accuracy']:.3f} ready={row['ready_s']:.1f}s batch={row['batch_s']:.2f}s "
                 f"cached_tokens={row['cached_tokens']} again_same={row['again_same']} "
                 f"compiles_after_warmup={row['compiles_after_warmup']} wrong={row['wrong'][:3]}")
              + f" in_use_after={(row['device_bytes_in_use_after'] or 0) / 2**30:.2f}GiB", flush=True)
    ok = [r for r in rows if "error" not in r]
    reference = ok[-1]["tokens"] if ok else []
    mismatches = sum(sum(a != b for a, b in zip(r["tokens"], reference)) for r in ok)
    for r in ok:
        r["logprob_max_abs_diff"] = max((abs(a - b) for x, y in zip(r["logprobs"], ok[-1]["logprobs"])
                                         for a, b in zip(x, y)), default=0.0)
    out = args.out or os.path.join(os.environ.get("OUT", "."), "engine_device_check.json")
    with open(out, "w") as f:
        json.dump({"platform": platform, "words": list(words), "rows": rows}, f, indent=1)
    print(f"platform={platform} jobs={len(words) * 5}; tokens compared against lora={ok[-1]['lora_backend']} "
          f"attention={ok[-1]['attention_backend']}" if ok else "no configuration ran")
    for r in ok:
        print(f"  {r['lora_backend']}/{r['attention_backend']}: logprob_max_abs_diff={r['logprob_max_abs_diff']:.4f}")
    print(f"configs={len(ok)}/{len(rows)} task_accuracy_min={min((r['task_accuracy'] for r in ok), default=0):.3f} "
          f"token_mismatches={mismatches} "
          f"compiles_after_warmup={sum(r['compiles_after_warmup'] for r in ok)}")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
