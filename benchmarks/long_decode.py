"""Decode at long contexts: the step's time against the bytes it must read (weights and KV),
per attention backend.

    python -m benchmarks.long_decode [--tiny] [--batch 64] [--context 2048] [--new-tokens 32] [--attention pallas,xla]
                                     [--adapters 8 --rank 16]

A batch of `--batch` sequences with prompts of `--context` tokens decodes `--new-tokens`
tokens each, greedy, LoRA off, on 8 layers of Llama-3-8B widths in bfloat16 (`--tiny`: 2
layers of hidden 128 in float32, to check that it runs). At such contexts a decode step reads
more KV than weights: its time is mostly attention's. Each attention backend the platform
has (the Pallas kernels and XLA's formulation on an accelerator, XLA alone on CPU) runs in an
engine of its own over the same weights. A step's time is the engine's own count
(`decode_seconds`, wall clock, host work included), best mean of `--repeats` batches; the
byte roofline is the weights' bytes plus the K and V of the batch's tokens (the mean context
over the decode), over the chip's bandwidth (`--gbps`, TPU v5e's 819 by default).

With `--adapters N`, one more engine runs on the first attention backend with N distinct
random rank-`--rank` adapters on all 7 modules, the batch's rows spread over them: its step
over the same backend's step with LoRA off (an engine without LoRA slots) is what LoRA costs
at that context, against the roofline's own ratio (the adapters' bytes added to the step's).

Last line: `step_ms_<backend>=<f> ... bytes_roofline_ms=<f> kv_gbps_<backend>=<f> ...
[lora_over_base=<f> lora_roofline_ratio=<f>] compiles_after_warmup=<n>`, where kv_gbps is the
KV bytes over the step's time less the weights' time at the roofline.
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
from lora_runtime.lora.adapter import module_shapes


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2 layers of hidden 128 (a test's size)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens per sequence")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=819.0, help="the device's memory bandwidth, GB/s")
    parser.add_argument("--attention", default=None,
                        help="comma-separated attention backends (default: pallas,xla on an accelerator, xla on CPU)")
    parser.add_argument("--adapters", type=int, default=0,
                        help="also run the first backend with this many distinct adapters in the batch")
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    shape, dtype = (TINY_SHAPE, "float32") if args.tiny else (LARGE_SHAPE, "bfloat16")
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=dtype, **shape)
    prompt = [3 + (i % 50) for i in range(args.context)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    backends = (tuple(args.attention.split(",")) if args.attention
                else ("xla",) if jax.default_backend() == "cpu" else ("pallas", "xla"))
    head_dim = shape["hidden"] // shape["heads"]
    itemsize = jax.numpy.dtype(dtype).itemsize
    mean_context = args.context + args.new_tokens / 2
    kv_bytes = 2 * args.batch * shape["layers"] * shape["kv_heads"] * head_dim * itemsize * mean_context
    runs = [(backend, 0) for backend in backends] + ([(backends[0], args.adapters)] if args.adapters else [])
    step_ms, compiles, weight_bytes, adapter_bytes = {}, 0, 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for backend, adapters in runs:
            config = EngineConfig(max_batch=args.batch, max_seq_len=args.context + args.new_tokens + 1,
                                  max_loras_per_batch=adapters, max_lora_rank=args.rank, attention_backend=backend)
            engine = synthetic_engine(model_config, config, tokenizer)
            names = [f"a{i}" for i in range(adapters)]
            for i, name in enumerate(names):
                path = write_random_adapter(f"{tmp}/{name}", model_config, r=args.rank, alpha=2 * args.rank, seed=i)
                engine.lora_manager.register(name, str(path))
            if not adapters:
                weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.state))
            engine.start()
            try:
                rows = [names[i % adapters] for i in range(args.batch)] if adapters else [None] * args.batch
                label = f"{backend}+{adapters} adapters" if adapters else backend
                step_ms[label] = 1e3 * decode_step_s(engine, rows, prompt, params, args.repeats)
                compiles += engine.compiles_after_warmup
                if adapters:
                    # What a step reads of the pool: A and B of every module of each adapter the
                    # batch uses, in the engine's dtype (the pool's slots hold them at max_lora_rank).
                    adapter_bytes = len(set(rows)) * sum(
                        args.rank * (fan_in + fan_out) for fan_in, fan_out in module_shapes(model_config).values()
                    ) * model_config.num_layers * itemsize
            finally:
                engine.shutdown()
            del engine  # its KV cache goes before the next engine plans its own
            gc.collect()
    weights_ms = 1e3 * weight_bytes / (args.gbps * 1e9)
    roofline_ms = weights_ms + 1e3 * kv_bytes / (args.gbps * 1e9)
    extra_ms = {label: 1e3 * adapter_bytes / (args.gbps * 1e9) if "adapters" in label else 0.0 for label in step_ms}
    kv_gbps = {label: kv_bytes / max((t - weights_ms - extra_ms[label]) * 1e-3, 1e-9) / 1e9
               for label, t in step_ms.items()}
    print(f"device={jax.devices()[0].platform} model={shape} dtype={dtype} batch={args.batch} "
          f"context={args.context} new_tokens={args.new_tokens} weights={weight_bytes / 2**30:.2f}GiB "
          f"kv_per_step={kv_bytes / 2**30:.2f}GiB adapters_per_step={adapter_bytes / 2**20:.1f}MiB")
    print_table(["engine", "step_ms", "over roofline", "KV GB/s (the rest at the roofline)", "tokens/s"],
                [(label, t, t / (roofline_ms + extra_ms[label]), kv_gbps[label], args.batch * 1e3 / t)
                 for label, t in step_ms.items()])
    result = {**{f"step_ms_{b}": step_ms[b] for b in backends}, "bytes_roofline_ms": roofline_ms,
              **{f"kv_gbps_{b}": kv_gbps[b] for b in backends}}
    if args.adapters:
        lora_label = f"{backends[0]}+{args.adapters} adapters"
        result["lora_over_base"] = step_ms[lora_label] / step_ms[backends[0]]
        result["lora_roofline_ratio"] = (roofline_ms + extra_ms[lora_label]) / roofline_ms
    result["compiles_after_warmup"] = compiles
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


if __name__ == "__main__":
    main()
