"""LoRA op benchmark: the kernel against the one-hot, gather and grouped formulations, per shape.

Each formulation runs a scan (or, with --unrolled, a Python loop) over `layers` stacked projections (each layer its own A and
B, so the adapters are not served from cache between layers) of one square projection:
h <- base + scale * (h @ A[slot]ᵀ) @ B[slot]. Time is per layer. "kernel" is the Pallas
kernel on GPU/TPU and the chosen XLA formulation (kernels.xla.CPU_FORMULATION) on
CPU. Bytes that must move per layer: D·r·(H+O) adapter bytes for the D distinct adapters,
plus T·(H + 2·O) for x and the base output read and written; bandwidth_fraction is that
over the time, over the copy bandwidth measured here.

    python -m benchmarks.lora_kernels --quick
Last line: speedup_vs_onehot=<f> speedup_vs_gather=<f> bandwidth_fraction=<f>
(T=64, S=64, H=O=4096, r=16).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from kernels import xla
from kernels.bgmv import bgmv
from kernels.bgmv.ops import bgmv_metadata, block_sizes
from kernels.bgmv.tuned_block_sizes import BlockSizes
from kernels.common import default_platform

HEADLINE = dict(num_tokens=64, num_slots=64, hidden=4096, rank=16)


def bench(fn, *args, repeats: int) -> float:
    """Median wall time of fn(*args) in seconds, after two warm-up calls."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(num_bytes: int, repeats: int) -> float:
    """Bytes/s of an elementwise bf16 pass (read + write) over `num_bytes`."""
    big = jnp.full((num_bytes // 2,), 1.5, jnp.bfloat16)
    f = jax.jit(lambda a: a * jnp.bfloat16(1.0001))
    return 2 * big.nbytes / bench(f, big, repeats=repeats)


def lora_fn(name: str, platform: str, interpret: bool, shape: Shape, block: BlockSizes | None = None):
    """(prepare, layer) for a formulation: kernel, onehot, gather or sorted.

    prepare(slots) runs once per batch (the kernel's slot sort, as an engine step would
    do once for all its projections); layer(x, a, b, layer, base, slots, scal, ranks, prep)
    is one projection's y = base + LoRA(x) with layer `layer` of the stacked pool a, b
    ([L, S, r, H]). The kernel reads that layer in place; the XLA formulations index it
    (a dynamic slice that XLA fuses into their gathers and einsums).
    """
    num_slots = shape.num_slots
    if name == "kernel" and platform == "cpu":
        name = xla.CPU_FORMULATION
    if name == "kernel":
        bs = block or block_sizes(platform, shape.num_tokens, shape.hidden, jnp.bfloat16)

        def prepare(slots):
            return bgmv_metadata(slots, num_slots, block=bs, platform=platform)

        def kernel(x, a, b, layer, base, slots, scal, ranks, meta):
            return bgmv(x, a, (b,), (base,), slots, scal, ranks, layer=layer, platform=platform,
                        interpret=interpret, block=bs, meta=meta)[0]
        return prepare, kernel

    def formulation(x, a, b, layer, base, slots, scal, ranks, prep):
        return xla.lora(x, a[layer], (b[layer],), (base,), slots, scal, name)[0]
    return (lambda slots: None), formulation


def stack_fn(prepare, layer, unrolled: bool = False):
    """A scan over layers, each with its own adapters, chaining through the layers.

    Layer l computes y = base + LoRA_l(x); the next layer takes x = y and base = this x.
    So x depends on the previous layer (no layer's work can be hoisted or batched with
    another's), and x and base are always distinct arrays, as in the model (x is the
    normed hidden state, base the projection's output): the kernel adds into base in
    place, which with x and base one array would cost XLA a copy per layer.
    unrolled: a Python loop instead (straight-line code, as the model's layer loop is),
    so no per-layer while-loop iteration is timed."""
    def run(x, a, b, slots, scal, ranks):
        prep = prepare(slots)
        carry = (x, x[::-1])  # a distinct array as the first base
        if unrolled:
            for index in range(a.shape[0]):
                cur, base = carry
                carry = (layer(cur, a, b, index, base, slots, scal, ranks, prep), cur)
            return carry[0]

        def body(carry, index):
            cur, base = carry
            return (layer(cur, a, b, index, base, slots, scal, ranks, prep), cur), None
        carry, _ = lax.scan(body, carry, jnp.arange(a.shape[0], dtype=jnp.int32))
        return carry[0]
    return jax.jit(run)


@dataclasses.dataclass
class Shape:
    num_tokens: int
    num_slots: int
    hidden: int
    rank: int


def make_stack(shape: Shape, layers: int, dtype, seed: int):
    """Random stacked pool ([L, S, r, H] and [L, S, r, H]) and a random slot per token."""
    k = jax.random.key(seed)
    ka, kb, kx, ks = jax.random.split(k, 4)
    s, r, h = shape.num_slots, shape.rank, shape.hidden
    a = (jax.random.normal(ka, (layers, s, r, h), jnp.float32) * 0.02).astype(dtype)
    b = (jax.random.normal(kb, (layers, s, r, h), jnp.float32) * 0.02).astype(dtype)
    x = jax.random.normal(kx, (shape.num_tokens, h), jnp.float32).astype(dtype)
    slots = jax.random.randint(ks, (shape.num_tokens,), 0, s, jnp.int32)
    scal = jnp.full((s,), 2.0, jnp.float32)
    ranks = jnp.full((s,), r, jnp.int32)
    return x, a, b, slots, scal, ranks


def must_move_bytes(shape: Shape, distinct: int, itemsize: int) -> int:
    h, t = shape.hidden, shape.num_tokens
    return distinct * shape.rank * 2 * h * itemsize + t * 3 * h * itemsize


def run_shape(shape: Shape, *, platform: str, interpret: bool, layers: int, repeats: int, copy_bps: float,
              dtype=jnp.bfloat16, names=("kernel", "onehot", "gather"), block: BlockSizes | None = None,
              unrolled: bool = False) -> dict:
    """Times each formulation on one shape; returns a row with us/layer, GB/s and errors."""
    args = make_stack(shape, layers, dtype, seed=shape.num_tokens + shape.num_slots)
    distinct = int(np.unique(np.asarray(args[3])).size)
    moved = must_move_bytes(shape, distinct, jnp.dtype(dtype).itemsize)
    row = dict(dataclasses.asdict(shape), distinct=distinct, bytes_per_layer=moved, platform=platform)
    ref = None
    for name in names:
        try:
            f = stack_fn(*lora_fn(name, platform, interpret, shape, block), unrolled=unrolled)
            t = bench(f, *args, repeats=repeats) / layers
            row[f"{name}_us"] = t * 1e6
            row[f"{name}_GBps"] = moved / t / 1e9
            out = np.asarray(f(*args), np.float32)
            if ref is None:
                ref = out
            row[f"{name}_relerr"] = float(np.linalg.norm(out - ref) / (np.linalg.norm(ref) + 1e-12))
        except Exception as e:  # one failing formulation must not hide the others
            row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
    if "kernel_us" in row:
        row["bandwidth_fraction"] = moved / (row["kernel_us"] * 1e-6) / copy_bps
    return row


def shapes(quick: bool, platform: str) -> list[Shape]:
    """The measured shapes; the headline shape is always last."""
    head = Shape(**HEADLINE)
    if quick:
        rest = [Shape(16, 8, 4096, 16)]
    else:
        rest = [Shape(t, s, 4096, 16) for s in (8, 64, 256) for t in (16, 64, 256) if (t, s) != (64, 64)]
    if platform == "cpu" and not quick:
        rest = [r for r in rest if r.num_slots * r.num_tokens <= 64 * 256]
    return rest + [head]


def format_row(row: dict) -> str:
    def cell(name):
        if f"{name}_us" not in row:
            return f"{name}=ERR"
        return f"{name}={row[name + '_us']:8.1f}us {row[name + '_GBps']:7.1f}GB/s"
    return (f"T={row['num_tokens']:4d} S={row['num_slots']:4d} H={row['hidden']} r={row['rank']} "
            f"D={row['distinct']:3d} " + " ".join(cell(n) for n in ("kernel", "onehot", "gather", "grouped", "sorted") if
                                                  f"{n}_us" in row or f"{n}_error" in row))


def summary_line(row: dict) -> str:
    """The machine-readable last line for the headline shape."""
    k = row.get("kernel_us", float("nan"))
    return (f"speedup_vs_onehot={row.get('onehot_us', float('nan')) / k:.3f} "
            f"speedup_vs_gather={row.get('gather_us', float('nan')) / k:.3f} "
            f"bandwidth_fraction={row.get('bandwidth_fraction', float('nan')):.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two shapes, few repeats")
    p.add_argument("--layers", type=int, default=None, help="stacked layers per timed call")
    p.add_argument("--with-sorted", action="store_true", help="also time sort + ragged_dot")
    p.add_argument("--unrolled", action="store_true", help="layers as straight-line code, not a scan")
    p.add_argument("--headline", action="store_true", help="only the headline shape (T=64, S=64, 4096, r=16)")
    args = p.parse_args(argv)
    platform = default_platform()
    on_cpu = platform == "cpu"
    layers = args.layers or (2 if on_cpu else 16)
    repeats = 5 if on_cpu else (10 if args.quick else 30)
    copy_bps = copy_bandwidth((64 << 20) if on_cpu else (1 << 30), repeats=5 if on_cpu else 20)
    print(f"platform={platform} devices={jax.devices()} copy_bandwidth={copy_bps / 1e9:.1f}GB/s "
          f"kernel={'xla (' + xla.CPU_FORMULATION + ')' if on_cpu else 'pallas'} layers={layers} "
          f"{'unrolled' if args.unrolled else 'scan'}", flush=True)
    names = ("kernel", "onehot", "gather", "grouped") + (("sorted",) if args.with_sorted else ())
    row = {}
    measured = shapes(args.quick, platform)
    for shape in measured[-1:] if args.headline else measured:
        row = run_shape(shape, platform=platform, interpret=False, layers=layers, repeats=repeats,
                        copy_bps=copy_bps, names=names, unrolled=args.unrolled)
        print(format_row(row), flush=True)
        for key, val in row.items():
            if key.endswith("_error"):
                print(f"  {key}: {val}", flush=True)
    print(summary_line(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
