"""The KV cache's write and page read as XLA compiles them for this machine: do they touch the
cache in place, or copy it?

    python -m benchmarks.kv_write [--cache-gib G (1; on CPU 1/16)] [--dtype bfloat16] [--tokens 8,64,512] [--rounds 16]

A decode step writes each token's K/V at its slot of the cache ([Hkv, L * N * bs, D] per K
or V, donated, layer l's pages from l * N) and, through the XLA formulation, gathers each
sequence's pages, once per layer inside the step's loop over layers (as the model runs
them). Both index a dimension behind the kv heads. Two formulations of each, compiled for
the default backend:
  write  `pages[heads, slots]`: (head, slot) index pairs, the leading dims (the XLA path's)
         `pages[:, slots]`:     the slot dim alone, the heads a window ahead of it
         mosaic sub-blocks:     on a TPU, kernels/paged_attention/write.py's kernel (lora_runtime's
                                there), and the same kernel writing K and V in one call
  read   `pages[heads, table]`: (head, page) pairs (kernels/paged_attention/xla.py's)
         `pages[:, table]`:     the page dim alone
For each: XLA's memory analysis of the compiled function (temporary bytes, against the
cache's bytes: a copy of the cache shows as about 1.0 per copy), the transposes and copies
left in the optimized HLO, and the device's time per layer, taken as the slope between a call
of one round of the layers and one of `--rounds` (16) rounds (writes of 8, 64 and 512 tokens; reads of 64
sequences of 4 pages). Last line:
`write_temp_over_cache=<f> read_temp_over_cache=<f> write_us_per_layer=<f> read_us_per_layer=<f>`
for the formulations lora_runtime uses, 64 tokens (else the first of --tokens).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import best_time, print_table
from kernels.common import default_platform
from kernels.paged_attention.write import tpu_write_caches, tpu_write_pages, xla_write_pages

HEADS, HEAD_DIM, BLOCK, TOKENS, PAGES_PER_SEQ, LAYERS = 8, 128, 128, 64, 4, 4


def write_pairs(flat, x, slots):  # [Hkv, S, D], [T, Hkv, D], i32[T]: the XLA path's write
    heads, total, d = flat.shape
    return xla_write_pages(flat.reshape(heads, total // BLOCK, BLOCK, d), x, slots).reshape(flat.shape)


def write_slot_axis(flat, x, slots):
    return flat.at[:, slots].set(jnp.swapaxes(x, 0, 1), mode="drop")


def mosaic_write(flat, x, slots):  # kernels/paged_attention/write.py's TPU kernel, on 128-token pages
    heads, total, d = flat.shape
    pages = tpu_write_pages(flat.reshape(heads, total // BLOCK, BLOCK, d), x, slots)
    return pages.reshape(flat.shape)


def mosaic_write_kv(flats, x, slots):  # K and V in one kernel call, as the model writes them
    heads, total, d = flats[0].shape
    pages = tuple(f.reshape(heads, total // BLOCK, BLOCK, d) for f in flats)
    return tuple(p.reshape(flats[0].shape) for p in tpu_write_caches(pages, (x, x), slots))


def read_pairs(pages, table):  # [Hkv, N, bs, D], i32[Q, P] -> [Hkv, Q, D]
    heads = jnp.arange(pages.shape[0], dtype=jnp.int32)[:, None, None]
    return pages[heads, table[None]].sum(axis=(2, 3), dtype=jnp.float32)


def read_page_axis(pages, table):
    return pages[:, table].sum(axis=(2, 3), dtype=jnp.float32)


def over_layers(write):
    """Each layer writes its own pages (slots offset by the layer), in a loop as the model's,
    `rounds` times over (the time per write is the slope over rounds: one call's dispatch and
    wait, about half a millisecond on a TPU host, is more than a write). `flat` is one cache or
    a tuple of them (K and V)."""
    def run(flat, x, slots, rounds=1):
        per_layer = jax.tree.leaves(flat)[0].shape[1] // LAYERS
        return jax.lax.fori_loop(0, LAYERS * rounds, lambda l, f: write(f, x, slots + (l % LAYERS) * per_layer), flat)
    return run


def reading_layers(read):
    def run(pages, table, rounds=1):
        per_layer = pages.shape[1] // LAYERS
        init = jnp.zeros((pages.shape[0], table.shape[0], pages.shape[3]), jnp.float32)
        return jax.lax.fori_loop(0, LAYERS * rounds,
                                 lambda l, acc: acc + read(pages, table + (l % LAYERS) * per_layer), init)
    return run


ROUNDS = 16  # the longer call's rounds of LAYERS writes
ACCELERATOR_CACHE_GIB = 1.0
# XLA's CPU backend copies the whole cache for each layer's write (temp_over_cache 2): at 1 GiB
# a run took 8.5 minutes on 2 cores. 64 MiB shows the same copies in half a minute.
CPU_CACHE_GIB = 1 / 16


def measure(fn, donate: bool, *args, rounds_long: int = ROUNDS) -> dict:
    """Temporary bytes, transposes and copies of the compiled fn, and its time for LAYERS
    calls on the device: the difference between `rounds_long` rounds and one, over
    `rounds_long` - 1."""
    times = []
    for rounds in (1, rounds_long):
        jitted = jax.jit(functools.partial(fn, rounds=rounds), donate_argnums=(0,) if donate else ())
        compiled = jitted.lower(*args).compile()
        if rounds == 1:
            memory = compiled.memory_analysis()
            text = compiled.as_text()
        state = {"args": list(args)}

        def call():
            out = jitted(*state["args"])
            if donate:
                state["args"][0] = out
            return out

        times.append(best_time(call, repeats=5, warmup=2))
        args = tuple(state["args"])
    return {"temp_bytes": getattr(memory, "temp_size_in_bytes", float("nan")),
            "transposes": text.count(" transpose("), "copies": text.count(" copy("),
            "us": 1e6 * max(times[1] - times[0], 0.0) / (rounds_long - 1), "call_us": 1e6 * times[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-gib", type=float, default=None,
                        help=f"bytes of one of K or V, in GiB (default {ACCELERATOR_CACHE_GIB} on an accelerator, "
                             f"{CPU_CACHE_GIB} on CPU)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--tokens", type=lambda v: [int(t) for t in v.split(",")], default=[8, TOKENS, 512],
                        help="tokens a write step writes (comma-separated)")
    parser.add_argument("--rounds", type=int, default=ROUNDS,
                        help="rounds of every layer in the longer timed call (at least 2)")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error(f"--rounds={args.rounds} must be at least 2")
    if args.cache_gib is None:
        args.cache_gib = CPU_CACHE_GIB if default_platform() == "cpu" else ACCELERATOR_CACHE_GIB
    dtype = jnp.dtype(args.dtype)
    slots_total = int(args.cache_gib * 2**30) // (HEADS * HEAD_DIM * dtype.itemsize) // (BLOCK * LAYERS) * BLOCK * LAYERS
    num_pages = slots_total // BLOCK
    per_layer_pages = num_pages // LAYERS
    cache_bytes = HEADS * slots_total * HEAD_DIM * dtype.itemsize
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.integers(0, per_layer_pages, (TOKENS, PAGES_PER_SEQ)), jnp.int32)
    rows, result = [], {}
    summary_tokens = TOKENS if TOKENS in args.tokens else args.tokens[0]
    writes = [("pages[heads, slots]", over_layers(write_pairs)), ("pages[:, slots]", over_layers(write_slot_axis))]
    if default_platform() == "tpu":  # lora_runtime's write on a TPU: the summary's
        writes.insert(0, ("mosaic sub-blocks", over_layers(mosaic_write)))
        writes.append(("mosaic K and V (us for both)", over_layers(mosaic_write_kv)))
    reads = (("pages[heads, table]", reading_layers(read_pairs)), ("pages[:, table]", reading_layers(read_page_axis)))
    for tokens in args.tokens:
        x = jnp.asarray(rng.standard_normal((tokens, HEADS, HEAD_DIM)), dtype)
        slots = jnp.asarray(rng.choice(slots_total // LAYERS, tokens, replace=False), jnp.int32)
        start = jnp.asarray(rng.standard_normal((HEADS, slots_total // LAYERS, HEAD_DIM)), dtype)
        want = None
        for name, fn in writes:
            # The same writes from the same cache give the same cache (checked on the first layer's rows).
            pair = name.startswith("mosaic K and V")
            cache = jnp.tile(start, (1, LAYERS, 1))
            out = jax.tree.leaves(jax.jit(fn)((cache, cache) if pair else cache, x, slots))
            out = [o[:, : slots_total // LAYERS] for o in out]
            want = out[0] if want is None else want
            same = all(bool(jnp.array_equal(o, want)) for o in out)
            del out
            zeros = jnp.zeros((HEADS, slots_total, HEAD_DIM), dtype)
            got = measure(fn, True, (zeros, jnp.zeros_like(zeros)) if pair else zeros, x, slots,
                          rounds_long=args.rounds)
            del zeros
            rows.append(("write", name, tokens, got["temp_bytes"] / cache_bytes, got["transposes"], got["copies"],
                         got["us"] / LAYERS, got["call_us"], same))
            if tokens == summary_tokens:
                result.setdefault("write", got)  # the first formulation is lora_runtime's
    for name, fn in reads:
        got = measure(fn, False, jnp.zeros((HEADS, num_pages, BLOCK, HEAD_DIM), dtype), table, rounds_long=args.rounds)
        rows.append(("read", name, TOKENS, got["temp_bytes"] / cache_bytes, got["transposes"], got["copies"],
                     got["us"] / LAYERS, got["call_us"], ""))
        result.setdefault("read", got)
    print(f"device={jax.devices()[0].platform} cache={cache_bytes / 2**30:.2f}GiB per K or V ({args.dtype}, "
          f"{HEADS} kv heads, {LAYERS} layers of {slots_total // LAYERS} slots) tokens={TOKENS}")
    print_table(["op", "formulation", "tokens", "temp_over_cache", "transposes", "copies", "us_per_layer",
                 "one_call_us", "same_cache"], rows)
    print(f"write_temp_over_cache={result['write']['temp_bytes'] / cache_bytes:.4f} "
          f"read_temp_over_cache={result['read']['temp_bytes'] / cache_bytes:.4f} "
          f"write_us_per_layer={result['write']['us'] / LAYERS:.1f} read_us_per_layer={result['read']['us'] / LAYERS:.1f}")


if __name__ == "__main__":
    main()
