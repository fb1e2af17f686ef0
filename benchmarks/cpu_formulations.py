"""Which XLA LoRA formulation is fastest on CPU, by tokens T and distinct adapters D.

    python -m benchmarks.cpu_formulations [--quick]

One Llama-3-8B-wide projection (4096 -> 4096), rank 64, a 64-slot pool, f32: the per-token
gather (copies T adapters' weights) against the grouped formulation (reads the D distinct
adapters once, T * D token-adapter products), tokens spread evenly over D adapters. The
winner per D sets kernels.xla.CPU_GROUPED_MAX_DISTINCT. Last line:
`grouped_over_gather_d16=<f> grouped_over_gather_d64=<f>` (time ratios at T=64).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import best_time, print_table
from kernels import xla

SLOTS, RANK, HIDDEN = 64, 64, 4096


def _time_ms(formulation: str, tokens: int, distinct: int, repeats: int) -> float:
    rng = np.random.default_rng(tokens + distinct)
    a = jnp.asarray(rng.standard_normal((SLOTS, RANK, HIDDEN), np.float32) * 0.02)
    b = jnp.asarray(rng.standard_normal((SLOTS, RANK, HIDDEN), np.float32) * 0.02)
    x = jnp.asarray(rng.standard_normal((tokens, HIDDEN), np.float32))
    base = jnp.asarray(rng.standard_normal((tokens, HIDDEN), np.float32))
    slots = jnp.asarray(rng.permutation(SLOTS)[:distinct][np.arange(tokens) % distinct], jnp.int32)
    scal = jnp.ones(SLOTS, jnp.float32)
    bound = min(distinct, tokens)
    if formulation == "grouped":
        fn = jax.jit(lambda x, base, slots: xla.lora(
            x, a, (b,), (base,), slots, scal, "grouped", xla.step_slots(slots, SLOTS, bound))[0])
    else:
        fn = jax.jit(lambda x, base, slots: xla.lora(x, a, (b,), (base,), slots, scal, formulation)[0])
    return 1e3 * best_time(lambda: jax.block_until_ready(fn(x, base, slots)), repeats=repeats, warmup=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    args = parser.parse_args(argv)
    token_counts = (64,) if args.quick else (8, 64, 512)
    distincts = (4, 16, 64) if args.quick else (1, 4, 8, 16, 32, 64)
    repeats = 3 if args.quick else 5
    rows, ratio = [], {}
    for t in token_counts:
        for d in distincts:
            if d > t:
                continue
            gather, grouped = _time_ms("gather", t, d, repeats), _time_ms("grouped", t, d, repeats)
            rows.append((t, d, gather, grouped, grouped / gather))
            if t == 64:
                ratio[d] = grouped / gather
    print(f"device={jax.devices()[0].platform} slots={SLOTS} rank={RANK} hidden={HIDDEN} f32")
    print_table(["T", "D", "gather_ms", "grouped_ms", "grouped/gather"], rows)
    print(f"grouped_over_gather_d16={ratio.get(16, float('nan')):.3f} "
          f"grouped_over_gather_d64={ratio.get(64, float('nan')):.3f}")


if __name__ == "__main__":
    main()
