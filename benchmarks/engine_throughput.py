"""Prefill and decode throughput of the engine by batch size, and recompiles after warm-up.

    python -m benchmarks.engine_throughput [--quick]

Drives the real engine (scheduler, jitted steps, on-device sampling) on a randomly
initialised Llama model; tokens/s are measured over the engine's own step timers, so
HTTP and tokenisation are not counted. Last line:
`decode_tokens_per_s=<f> prefill_tokens_per_s=<f> compiles_after_warmup=<n>` for the
largest batch.
"""

from __future__ import annotations

import argparse

from benchmarks.common import demo_tokenizer, print_table, synthetic_config, synthetic_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, few batch sizes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="KV cache length per row (default: prompt + new tokens + 8); decode should not "
                        "slow down when it grows past what the sequences use")
    args = parser.parse_args(argv)
    if args.quick:
        shape = dict(hidden=512, layers=4, heads=8, kv_heads=4, intermediate=1408)
        batches, prompt_len, new_tokens = (1, 4, 16), 48, 24
    else:
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816)
        batches, prompt_len, new_tokens = (1, 4, 16, 32), 96, 64
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=args.dtype, **shape)
    max_batch = max(batches)
    seq_len = args.max_seq_len or prompt_len + new_tokens + 8
    config = EngineConfig(
        max_batch=max_batch, max_seq_len=seq_len, max_prefill_tokens=max(prompt_len * max_batch, seq_len),
        max_loras_per_batch=0, enable_prefix_caching=False,  # every prompt token is computed
    )
    engine = synthetic_engine(model_config, config, tokenizer).start()
    prompt = [3 + (i % 50) for i in range(prompt_len)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    try:
        for b in batches:
            before = dict(engine.counters)
            engine.generate_batch([prompt] * b, params)
            c = {k: engine.counters[k] - before[k] for k in engine.counters}
            prefill_tps = c["prompt_tokens"] / c["prefill_seconds"]
            decode_tps = c["decode_row_steps"] / c["decode_seconds"]
            rows.append((b, c["prefill_steps"], round(prefill_tps, 1), c["decode_steps"], round(decode_tps, 1)))
        compiles = engine.compiles_after_warmup
    finally:
        engine.shutdown()
    print(f"model: {shape} dtype={args.dtype} prompt={prompt_len} new_tokens={new_tokens} max_seq_len={seq_len}")
    print_table(["batch", "prefill_steps", "prefill_tok/s", "decode_steps", "decode_tok/s"], rows)
    last = rows[-1]
    print(f"decode_tokens_per_s={last[4]} prefill_tokens_per_s={last[2]} compiles_after_warmup={compiles}")


if __name__ == "__main__":
    main()
