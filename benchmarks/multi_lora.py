"""Decode throughput with many adapters in one batch, against the byte roofline.

    python -m benchmarks.multi_lora [--quick]

Runs the real engine on a randomly initialised Llama sized so that weights dominate a
decode step, 8 running sequences at a time. The denominator is an engine with LoRA off
(no pool, max_loras_per_batch=0) over the same weights; the LoRA engine then decodes a
batch of base traffic (no adapter), one shared adapter and 8 distinct adapters (r=16 on
q,k,v,o,gate,up,down). A decode step is memory-bound, so its floor with D distinct
adapters is (base bytes + D * adapter bytes) / base bytes of the LoRA-off step. Also
times one slot write (host cache -> device pool) at two pool sizes, to show a load costs
the adapter's bytes, not the pool's. Then 8 distinct DoRA adapters (the same projections
plus a magnitude vector each) and 8 adapters that also target embed_tokens and lm_head,
each against its own byte roofline: DoRA reads one f32 scale per output, the head adapter
rank x (hidden + vocab) more weights. Last line: `lora_over_base_step=<f>
roofline_ratio=<f> base_traffic_over_no_lora=<f> slot_load_ms=<f> recompiles=<n>
dora_over_plain_step=<f> embed_head_over_plain_step=<f>` and benchmarks.rank_pool's
`resident_adapters_per_gib=<f> vs_padded=<f> rank_aware_over_padded_step=<f>`.
"""

from __future__ import annotations

import argparse
import gc
import tempfile

import jax
import numpy as np

from benchmarks import rank_pool
from benchmarks.common import (
    LARGE_SHAPE, best_time, decode_step_s, demo_tokenizer, print_table, synthetic_config, synthetic_engine, write_random_adapter,
)
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.lora.adapter import module_shapes
from lora_runtime.lora.memory_pool import LoRAMemoryPool, write_slot
from lora_runtime.lora.sources import SourcePolicy, load_adapter
from lora_runtime.model.sharding import make_mesh


def _slot_write_ms(model_config, adapter, slots: int, rank: int) -> float:
    pool = LoRAMemoryPool.create(model_config, make_mesh(1), num_slots=slots, max_lora_rank=rank,
                                 dtype=model_config.dtype)
    weights = adapter.pool_weights(model_config, rank, np.dtype(model_config.dtype))
    state = {"pool": pool, "slot": 0}

    def write():
        state["slot"] = (state["slot"] + 1) % slots
        state["pool"] = write_slot(state["pool"], state["slot"], weights)
        return state["pool"]

    return 1e3 * best_time(write, repeats=5, warmup=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    parser.add_argument("--backend", default="auto", help="LoRA backend (auto, reference, xla, pallas)")
    parser.add_argument("--large", action="store_true",
                        help="Llama-3-8B layer shapes (8 layers, bf16) for accelerators")
    args = parser.parse_args(argv)
    rank, distinct = 16, 8
    if args.large:
        shape, dtype = LARGE_SHAPE, "bfloat16"
    else:
        shape = dict(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=2816)
        dtype = "float32"
    new_tokens, repeats = (24, 2) if args.quick else (64, 3)
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype=dtype, **shape)
    config = EngineConfig(max_batch=distinct, max_seq_len=64 + new_tokens, max_loras_per_batch=distinct,
                          max_lora_rank=rank, lora_backend=args.backend)
    prompt = [3 + (i % 50) for i in range(32)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    lora_off = synthetic_engine(model_config, config.model_copy(update={"max_loras_per_batch": 0}), tokenizer)
    lora_off.start()
    try:
        off_s = decode_step_s(lora_off, [None] * distinct, prompt, params, repeats)
        recompiles = lora_off.compiles_after_warmup
    finally:
        lora_off.shutdown()
    # Its KV cache took the plan's share of device memory: free it before the next engine plans its own.
    del lora_off
    gc.collect()
    engine = synthetic_engine(model_config, config, tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        kinds = {"plain": {}, "dora": {"dora": True}, "embed_head": {"outer": True}}
        names = {kind: [f"{kind}-{i}" for i in range(distinct)] for kind in kinds}
        for kind, extra in kinds.items():
            for i, name in enumerate(names[kind]):
                path = write_random_adapter(f"{tmp}/{name}", model_config, r=rank, alpha=2 * rank, seed=i, **extra)
                engine.lora_manager.register(name, str(path))
        engine.start()
        try:
            warm = SamplingParams(max_tokens=2, ignore_eos=True)
            # Make every adapter resident first: this measures decoding, not loading.
            engine.generate_batch([prompt] * distinct, warm, names["plain"])
            base_s = decode_step_s(engine, [None] * distinct, prompt, params, repeats)
            one_s = decode_step_s(engine, [names["plain"][0]] * distinct, prompt, params, repeats)
            many_s = decode_step_s(engine, names["plain"], prompt, params, repeats)
            kind_s = {"plain": many_s}
            for kind in ("dora", "embed_head"):
                engine.generate_batch([prompt] * distinct, warm, names[kind])
                kind_s[kind] = decode_step_s(engine, names[kind], prompt, params, repeats)
            recompiles += engine.compiles_after_warmup
            names = names["plain"]
            adapter = load_adapter(names[0], f"{tmp}/{names[0]}", SourcePolicy(None, 1 << 30), model_config, rank)
        finally:
            engine.shutdown()
    itemsize = np.dtype(model_config.dtype).itemsize
    base_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(engine.runner.state))
    adapter_bytes = model_config.num_layers * sum(rank * (i + o) for i, o in module_shapes(model_config).values()) * itemsize
    roofline = {1: 1 + adapter_bytes / base_bytes, distinct: 1 + distinct * adapter_bytes / base_bytes}
    # DoRA: an f32 scale per output of each module; embed/head: the gathered rows of the
    # embedding's A (negligible), its B [r, hidden] and the head's A [r, hidden] and B [r, vocab].
    h, v = model_config.hidden_size, model_config.vocab_size
    extra = {"dora": model_config.num_layers * sum(o for _, o in module_shapes(model_config).values()) * 4,
             "embed_head": rank * (2 * h + v) * itemsize}
    kind_roof = {kind: 1 + distinct * (adapter_bytes + extra[kind]) / base_bytes for kind in extra}
    backend_name = engine.runner.backend.name
    del engine  # free its KV cache before the pools below and rank_pool's engines take the device
    gc.collect()
    write_small = _slot_write_ms(model_config, adapter, 8, rank)
    write_large = _slot_write_ms(model_config, adapter, 64, rank)
    print(f"device={jax.devices()[0].platform} backend={backend_name} model={shape} "
          f"base_bytes={base_bytes / 2**20:.1f}MiB adapter_bytes={adapter_bytes / 2**20:.2f}MiB")
    print_table(
        ["batch of 8", "step_ms", "tokens/s", "over_lora_off", "roofline"],
        [
            ("LoRA off", 1e3 * off_s, distinct / off_s, 1.0, 1.0),
            ("LoRA on, no adapter", 1e3 * base_s, distinct / base_s, base_s / off_s, 1.0),
            ("1 adapter", 1e3 * one_s, distinct / one_s, one_s / off_s, roofline[1]),
            (f"{distinct} adapters", 1e3 * many_s, distinct / many_s, many_s / off_s, roofline[distinct]),
            *((f"{distinct} {kind} adapters", 1e3 * kind_s[kind], distinct / kind_s[kind], kind_s[kind] / off_s,
               kind_roof[kind]) for kind in kind_roof),
        ],
    )
    print_table(["pool slots", "slot_write_ms"], [(8, write_small), (64, write_large)])
    ranked = rank_pool.report(args.quick)  # the rank-aware pool against the padded one
    print(f"lora_over_base_step={many_s / off_s:.4f} roofline_ratio={roofline[distinct]:.4f} "
          f"base_traffic_over_no_lora={base_s / off_s:.4f} slot_load_ms={write_small:.3f} recompiles={recompiles} "
          f"dora_over_plain_step={kind_s['dora'] / many_s:.4f} "
          f"embed_head_over_plain_step={kind_s['embed_head'] / many_s:.4f} {ranked}")


if __name__ == "__main__":
    main()
