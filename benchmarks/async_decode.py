"""Decode steps with and without async_decode: what dispatching each step before the host
reads the tokens of the step before saves.

    python -m benchmarks.async_decode [--large | --tiny] [--backend auto] [--new-tokens 32] [--repeats 3]

The engine `benchmarks.multi_lora` measures (8 layers; hidden 1024 in float32, or
Llama-3-8B widths in bfloat16 with `--large`; `--tiny`, 2 layers of hidden 128, checks that
it runs), a batch of 8 sequences, greedy: an engine
with LoRA off and a LoRA engine decoding 8 distinct rank-16 adapters, each with
`async_decode` on and off over the same weights. A step's time is the engine's own count
(`decode_seconds`: wall clock from one decode step's tokens on the host to the next's, host
work included), best mean of `--repeats` batches.
Without an accelerator the host and the "device" share the cores, so what overlap saves
there is bounded by them; on an accelerator the host's part of a step (settling tokens,
text, the next step's inputs and launches) hides behind the device's.

Last line: `async_over_sync_lora_off=<f> async_over_sync_adapters=<f> compiles_after_warmup=<n>`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile

import jax

from benchmarks.common import (
    LARGE_SHAPE, TINY_SHAPE, decode_step_s, demo_tokenizer, print_table, synthetic_config, synthetic_engine,
    write_random_adapter,
)
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--large", action="store_true", help="Llama-3-8B layer widths, bfloat16")
    parser.add_argument("--tiny", action="store_true", help="2 layers of hidden 128 (a test's size)")
    parser.add_argument("--backend", default="auto", help="LoRA backend (auto, reference, xla, pallas)")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    batch, rank = 8, 16
    if args.large:
        shape, dtype = LARGE_SHAPE, "bfloat16"
    elif args.tiny:
        shape, dtype = TINY_SHAPE, "float32"
    else:
        shape, dtype = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816), "float32"
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=dtype, **shape)
    # --tiny: short prompts, so its engines compile fewer prefill buckets (it checks, not times).
    prompt = [3 + (i % 50) for i in range(8 if args.tiny else 32)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    # The batch's prompts in one prefill step, so every decode step counted is a steady one (a
    # prefill between decode steps would take the device time of the step in flight as its own).
    base = EngineConfig(max_batch=batch, max_seq_len=2 * len(prompt) + args.new_tokens, max_lora_rank=rank,
                        lora_backend=args.backend, max_prefill_tokens=batch * len(prompt))
    rows, step_ms, compiles = [], {}, 0
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(batch)]
        for label, slots, adapters in (("LoRA off", 0, [None] * batch), (f"{batch} adapters", batch, names)):
            for on in (True, False):
                config = base.model_copy(update={"max_loras_per_batch": slots, "async_decode": on})
                engine = synthetic_engine(model_config, config, tokenizer)
                for i, name in enumerate(names if slots else []):
                    path = write_random_adapter(f"{tmp}/{name}", model_config, r=rank, alpha=2 * rank, seed=i)
                    engine.lora_manager.register(name, str(path))
                engine.start()
                try:
                    engine.generate_batch([prompt] * batch, SamplingParams(max_tokens=2, ignore_eos=True), adapters)
                    step_s = decode_step_s(engine, adapters, prompt, params, args.repeats)
                    compiles += engine.compiles_after_warmup
                finally:
                    engine.shutdown()
                del engine  # its KV cache goes before the next engine plans its own
                gc.collect()
                step_ms[label, on] = 1e3 * step_s
            rows.append((label, step_ms[label, False], step_ms[label, True],
                         step_ms[label, True] / step_ms[label, False], batch * 1e3 / step_ms[label, True]))
    print(f"device={jax.devices()[0].platform} model={shape} dtype={dtype} batch={batch} rank={rank}")
    print_table(["decode step", "sync_ms", "async_ms", "async_over_sync", "async tokens/s"], rows)
    result = {"async_over_sync_lora_off": rows[0][3], "async_over_sync_adapters": rows[1][3],
              "compiles_after_warmup": compiles}
    print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
