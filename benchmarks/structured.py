"""What constrained decoding costs a decode step: a batch of 16 with half its rows under a
JSON schema against the same batch free, and a free batch once grammars have run against
one before any had; plus the time to compile a schema at a 128k vocabulary.

The step time is the engine's own (decode_seconds per decode step), so the mask work a step
does on the host is in it, less what overlaps the device's forward.

    python -m benchmarks.structured --quick     # hidden 1024, 2 layers, vocab 128256
    python -m benchmarks.structured             # Llama-3-8B widths, 2 layers
"""

from __future__ import annotations

import argparse
import json
import time

import jax

from benchmarks.common import large_tokenizer, print_table, synthetic_config, synthetic_engine
from lora_runtime.engine.config import EngineConfig
from lora_runtime.engine.grammar import GuidedSpec
from lora_runtime.engine.sampling import SamplingParams

BATCH = 16
QUICK_SHAPE = dict(hidden=1024, heads=16, kv_heads=4, intermediate=4096, vocab=128256)
FULL_SHAPE = dict(hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
# Rows under it cannot finish within the run: at least 40 records of an id and a note.
LONG_SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                     "note": {"type": "string", "maxLength": 12},
                                     "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["id", "note", "kind"], "additionalProperties": False}}


def _step_s(engine, params: list[SamplingParams], prompt: list[int], repeats: int) -> tuple[float, float]:
    """(best mean decode-step seconds, host mask seconds per step) over `repeats` batches."""
    best, mask = float("inf"), 0.0
    for _ in range(repeats):
        before = dict(engine.counters)
        engine.generate_batch([prompt] * len(params), params)
        steps = engine.counters["decode_steps"] - before["decode_steps"]
        step = (engine.counters["decode_seconds"] - before["decode_seconds"]) / steps
        if step < best:
            best, mask = step, (engine.counters["mask_seconds"] - before["mask_seconds"]) / steps
    return best, mask


def _compile_ms(engine, n: int) -> float:
    """Mean milliseconds to compile a schema no request used before."""
    engine.grammars.matcher(GuidedSpec("json_object"))  # the tokenizer index is built
    total = 0.0
    for i in range(n):
        schema = {**LONG_SCHEMA, "minItems": 1, "maxItems": 10 + i}
        start = time.perf_counter()
        engine.grammars.matcher(GuidedSpec("json_schema", json.dumps(schema)))
        total += time.perf_counter() - start
    return total / n * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 1024 (else Llama-3-8B widths), fewer tokens")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer.json of up to 128256 tokens")
    args = parser.parse_args(argv)
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    new_tokens, repeats = (24, 3) if args.quick else (32, 3)
    tokenizer, _ = large_tokenizer(args.tokenizer)
    on_cpu = jax.devices()[0].platform == "cpu"
    config = EngineConfig(max_batch=BATCH, max_seq_len=128, max_loras_per_batch=0, compilation_cache_dir=None,
                          scan_layers=not on_cpu)
    engine = synthetic_engine(synthetic_config(layers=2, **shape), config, tokenizer).start()
    try:
        prompt = tokenizer.encode("def main(argv: list[str] | None = None) -> None:\n    parser = ")[:32]
        free = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        constrained = SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                     guided=GuidedSpec("json_schema", json.dumps(LONG_SCHEMA)))
        plain_s, _ = _step_s(engine, [free] * BATCH, prompt, repeats)
        half = BATCH // 2
        # Mixed and free batches alternate (best of each): on a shared CPU a step's time drifts
        # by several percent from one batch to the next.
        mixed_s, mask_s, after_s, after_mask = float("inf"), 0.0, float("inf"), 0.0
        for _ in range(repeats):
            step, mask = _step_s(engine, [free] * half + [constrained] * half, prompt, 1)
            if step < mixed_s:
                mixed_s, mask_s = step, mask
            step, mask = _step_s(engine, [free] * BATCH, prompt, 1)
            if step < after_s:
                after_s, after_mask = step, mask
        compile_ms = _compile_ms(engine, 10)
        compiles = engine.compiles_after_warmup
    finally:
        engine.shutdown()
    print_table(
        [f"batch {BATCH}, hidden {shape['hidden']}, vocab {shape['vocab']}", "constrained rows", "step (ms)",
         "host mask (ms/step)"],
        [("free, before any grammar", 0, f"{plain_s * 1e3:.2f}", "0"),
         ("half under a JSON schema", half, f"{mixed_s * 1e3:.2f}", f"{mask_s * 1e3:.2f}"),
         ("free, after grammars ran", 0, f"{after_s * 1e3:.2f}", f"{after_mask * 1e3:.2f}")])
    print(f"schema compile at vocab {tokenizer.vocab_size}: {compile_ms:.2f} ms; compiles after warm-up: {compiles}")
    print(f"constrained_over_free_step={mixed_s / plain_s:.3f} free_rows_over_plain={after_s / plain_s:.3f} "
          f"grammar_compile_ms={compile_ms:.2f}")


if __name__ == "__main__":
    main()
