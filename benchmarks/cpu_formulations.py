"""Which XLA LoRA formulation is fastest on CPU, by tokens T and distinct adapters D.

    python -m benchmarks.cpu_formulations [--quick]

One Llama-3-8B-wide projection (4096 -> 4096), rank 64, a 64-slot pool, f32, tokens spread
evenly over D adapters: the per-token gather (copies T adapters' weights), the grouped
formulation (gathers the step's U = min(T, D) possible adapters, T * U token-adapter
products) and the loop over the D adapters really used (each read in place once). The
measurements chose kernels.xla.CPU_FORMULATION. Last line:
`loop_over_gather_t8_d8=<f> loop_over_gather_t64_d16=<f> loop_over_grouped_t512_d8=<f>`.
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
    if formulation in ("grouped", "loop"):
        fn = jax.jit(lambda x, base, slots: xla.lora(
            x, a, (b,), (base,), slots, scal, formulation, xla.step_slots(slots, SLOTS, bound))[0])
    else:
        fn = jax.jit(lambda x, base, slots: xla.lora(x, a, (b,), (base,), slots, scal, formulation)[0])
    return 1e3 * best_time(lambda: jax.block_until_ready(fn(x, base, slots)), repeats=repeats, warmup=2)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    args = parser.parse_args(argv)
    distincts = (1, 16) if args.quick else (1, 4, 8, 16, 32, 64)
    repeats = 3 if args.quick else 5
    token_counts = (8, 64) if args.quick else (8, 64, 512)
    rows, ms = [], {}
    for t in token_counts:
        for d in distincts + (t,):
            if d > min(t, SLOTS) or (t, d) in ms:
                continue
            ms[t, d] = {f: _time_ms(f, t, d, repeats) for f in ("gather", "grouped", "loop")}
            rows.append((t, d, *ms[t, d].values(), ms[t, d]["loop"] / min(ms[t, d]["gather"], ms[t, d]["grouped"])))
    print(f"device={jax.devices()[0].platform} slots={SLOTS} rank={RANK} hidden={HIDDEN} f32")
    print_table(["T", "D", "gather_ms", "grouped_ms", "loop_ms", "loop/best other"], rows)

    def ratio(t, d, other):
        return ms[t, d]["loop"] / ms[t, d][other] if (t, d) in ms else float("nan")

    print(f"loop_over_gather_t8_d8={ratio(8, 8, 'gather'):.3f} loop_over_gather_t64_d16={ratio(64, 16, 'gather'):.3f} "
          f"loop_over_grouped_t512_d8={ratio(512, 8, 'grouped'):.3f}")


if __name__ == "__main__":
    main()
