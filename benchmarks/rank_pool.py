"""The rank-aware pool against the padded one: adapters resident per GiB, and the decode step.

    python -m benchmarks.rank_pool [--quick]      (also run by benchmarks.multi_lora)

Capacity: a manager over Llama-3-8B widths (hidden 4096, intermediate 14336, one layer,
bf16; the ratio does not depend on the layer count) with the pool bytes of 64 padded
rank-64 slots, once padded and once in rank classes {8, 16, 64} sized by the memory plan
(equal bytes per class, `lora_rank_classes: [8, 16, 64]`). Adapters of ranks 8, 16 and 64
in proportions 6:3:1 are registered and loaded one after another until the first load
evicts another: the adapters loaded before it are what the pool holds at once. Each adapter
is distinct content (its own scaling over shared weight files, hard-linked).

Step: two engines over one random model, max_lora_rank 64, the same pool bytes, one padded
and one in classes, each decoding 8 requests on 8 distinct adapters of the mix.
Last line: `resident_adapters_per_gib=<f> vs_padded=<f> rank_aware_over_padded_step=<f>`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import tempfile

import jax

from benchmarks.common import (
    decode_step_s, demo_tokenizer, print_table, synthetic_config, synthetic_engine, write_random_adapter,
)
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.memory_plan import pool_classes
from lora_runtime.engine.sampling import SamplingParams
from lora_runtime.lora.manager import LoRAManager
from lora_runtime.lora.sources import SourcePolicy
from lora_runtime.model.sharding import make_mesh

MIX = (8, 16, 8, 64, 8, 16, 8, 8, 16, 8)  # ranks 8 / 16 / 64 in proportions 6 : 3 : 1
CLASSES = [8, 16, 64]
GIB = float(1 << 30)


def _variant(base: pathlib.Path, out: pathlib.Path, alpha: float) -> pathlib.Path:
    """Another adapter of the same weights with its own alpha (so its own content id)."""
    out.mkdir(parents=True)
    os.link(base / "adapter_model.safetensors", out / "adapter_model.safetensors")
    cfg = json.loads((base / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": alpha}))
    return out


def resident_capacity(model_config, config: EngineConfig, tmp: pathlib.Path, limit: int) -> tuple[int, int]:
    """(adapters of the mix held at once, pool bytes) of the pool `config` asks for."""
    classes = pool_classes(model_config, config, 1)
    shape = dict(rank_classes=classes) if classes else dict(num_slots=config.max_loras_per_batch)
    manager = LoRAManager(model_config, make_mesh(1), **shape, max_lora_rank=config.max_lora_rank,
                          max_cpu_loras=4, max_cpu_bytes=1 << 30, source_policy=SourcePolicy(None, 1 << 31),
                          dtype=model_config.dtype, outer=False, dora=False)
    bases = {r: tmp / f"base-r{r}" for r in set(MIX)}
    for i, (r, path) in enumerate(sorted(bases.items())):
        if not path.exists():
            write_random_adapter(path, model_config, r=r, alpha=2 * r, seed=i)
    tag = "classes" if classes else "padded"
    try:
        for i in range(limit):
            r = MIX[i % len(MIX)]
            name = f"{tag}-{i}"
            manager.register(name, str(_variant(bases[r], tmp / name, alpha=r + 0.01 * (i + 1))))
            manager.acquire_slot(name)
            manager.release_slot(name)
            if manager.stats().evictions:
                return i, manager.pool.nbytes
        raise RuntimeError(f"{limit} adapters loaded without an eviction; raise the limit")
    finally:
        manager.close()


def capacity() -> tuple[dict, dict]:
    slots = 64
    model_config = synthetic_config(vocab=1024, dtype="bfloat16", hidden=4096, layers=1, heads=32, kv_heads=8,
                                    intermediate=14336)
    padded = EngineConfig(max_batch=slots, max_loras_per_batch=slots, max_lora_rank=64, lora_dora=False,
                          lora_bias=False, lora_embedding_modules=False)
    ranked = padded.model_copy(update={"lora_rank_classes": CLASSES})
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, config in (("padded", padded), ("rank classes", ranked)):
            held, nbytes = resident_capacity(model_config, config, pathlib.Path(tmp), limit=8 * slots)
            out[kind] = {"resident": held, "pool_gib": nbytes / GIB, "per_gib": held / (nbytes / GIB),
                         "classes": pool_classes(model_config, config, 1)}
    return out, {"slots": slots}


def mixed_rank_steps(quick: bool) -> dict[str, float]:
    """Decode step ms of 8 mixed-rank adapters on the padded pool and on the class pool."""
    tokenizer = demo_tokenizer()
    model_config = synthetic_config(vocab=tokenizer.vocab_size, dtype="float32", hidden=1024, layers=8, heads=16,
                                    kv_heads=8, intermediate=2816)
    new_tokens, repeats = (24, 2) if quick else (64, 3)
    ranks = [MIX[i] for i in range(8)]  # 5 x 8, 2 x 16, 1 x 64
    config = EngineConfig(max_batch=8, max_seq_len=64 + new_tokens, max_loras_per_batch=8, max_lora_rank=64)
    prompt = [3 + (i % 50) for i in range(32)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"mix-{i}-r{r}" for i, r in enumerate(ranks)]
        for i, (name, r) in enumerate(zip(names, ranks)):
            write_random_adapter(f"{tmp}/{name}", model_config, r=r, alpha=2 * r, seed=i)
        ranked = config.model_copy(update={"lora_rank_classes": CLASSES})
        for kind, cfg in (("padded", config), ("rank classes", ranked)):
            engine = synthetic_engine(model_config, cfg, tokenizer)
            for name in names:
                engine.lora_manager.register(name, f"{tmp}/{name}")
            engine.start()
            try:
                engine.generate_batch([prompt] * 8, SamplingParams(max_tokens=2, ignore_eos=True), names)
                out[kind] = 1e3 * decode_step_s(engine, names, prompt, params, repeats)
                out[kind + " recompiles"] = engine.compiles_after_warmup
            finally:
                engine.shutdown()
            # Its KV cache took the plan's share of device memory: free it before the next engine plans its own.
            del engine
            gc.collect()
    return out


def report(quick: bool) -> str:
    """Prints the tables; returns the key=value fields of the last line."""
    cap, meta = capacity()
    steps = mixed_rank_steps(quick)
    print(f"capacity at Llama-3-8B widths (1 layer, bf16), the bytes of {meta['slots']} padded rank-64 slots, "
          "mix of ranks 8/16/64 as 6:3:1")
    print_table(["pool", "classes (rank, slots)", "pool_GiB", "adapters_held", "per_GiB"],
                [(k, str(v["classes"] or "padded"), v["pool_gib"], v["resident"], v["per_gib"])
                 for k, v in cap.items()])
    print(f"decode step, 8 adapters of ranks {[MIX[i] for i in range(8)]} (device={jax.devices()[0].platform})")
    print_table(["pool", "step_ms", "recompiles"],
                [(k, steps[k], steps[k + " recompiles"]) for k in ("padded", "rank classes")])
    vs = cap["rank classes"]["per_gib"] / cap["padded"]["per_gib"]
    return (f"resident_adapters_per_gib={cap['rank classes']['per_gib']:.2f} vs_padded={vs:.3f} "
            f"rank_aware_over_padded_step={steps['rank classes'] / steps['padded']:.4f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    args = parser.parse_args(argv)
    print(report(args.quick))


if __name__ == "__main__":
    main()
